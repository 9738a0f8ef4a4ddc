"""What a rehearsal looks for in the graphs handed to the compiler, and in the
ops a step runs eagerly.

Each check reads FX node metadata (``meta["val"]``, ``meta["stack_trace"]``)
as AOTAutograd leaves it; nothing runs.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_neuron.tracing.ops import op_name, user_frame

# Ops that read a device value back to the host while the graph runs: a
# compiled program would stop and wait on them (and their output shapes or
# values depend on data).
HOST_SYNC_OPS = frozenset({
    "aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select",
    "aten.equal", "aten.is_nonzero", "aten.allclose", "aten._unique2",
    "aten.unique_dim", "aten.unique_consecutive",
})
# Namespaces of collectives: functional collectives in compiled graphs,
# c10d's in-place ops in eager code.
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d")
# A collective's bytes are those of the largest buffer it touches: the
# gathered tensor of an all-gather, the tensor to reduce of a reduce-scatter
# or all-reduce (what moves is proportional to it).
# Not transfers: a wait on a collective issued earlier, barriers, and the
# autograd wrapper functional collectives put around their outputs.
NOT_COLLECTIVES = frozenset({"wait_tensor", "barrier", "monitored_barrier",
                             "_wrap_tensor_autograd"})

# Host tensors allowed inside a graph handed to the neuron backend:
#  - 0-dim CPU tensors: PyTorch treats them as scalars wherever a device
#    tensor is expected (type promotion, no transfer of a buffer);
#  - the philox seed and offset of SDPA's fused op, which its meta kernel
#    puts on the host, as CUDA's fused kernels do.
# Anything else on cpu or cuda is a transfer or a wrong device string.
ALLOWED_HOST_TENSORS = ("0-dim cpu tensor (a scalar)",
                        "philox seed/offset of the fused SDPA op")
_FOREIGN = ("cpu", "cuda")
def _values(node: torch.fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _tensors(vals) -> list[torch.Tensor]:
    return [v for v in vals if isinstance(v, torch.Tensor)]


def largest_bytes(tensors) -> int:
    return max((int(t.numel()) * t.element_size() for t in tensors), default=0)


@dataclass
class GraphFacts:
    """One graph handed to the compiler (a forward, backward or inference
    graph after AOTAutograd's partitioner)."""

    name: str
    ops: Counter = field(default_factory=Counter)
    dtypes: Counter = field(default_factory=Counter)
    complex_ops: Counter = field(default_factory=Counter)
    host_syncs: list = field(default_factory=list)
    collectives: dict = field(default_factory=dict)
    by_mesh: Counter = field(default_factory=Counter)
    """Collectives counted by (kind, mesh dimension of their group)."""
    foreign_devices: list = field(default_factory=list)
    dynamic_shapes: list = field(default_factory=list)
    program: str = ""
    """What the compiler is handed, hashed: the graph's code and its inputs'
    shapes and dtypes (``program_fingerprint``). Two ranks with equal
    fingerprints hand neuronx-cc the same program."""


def program_fingerprint(gm) -> str:
    """A hash of ``gm``'s code (ops, constants, process-group names) and of
    its inputs' shapes and dtypes: the graph TorchNeuron lowers to StableHLO
    and compiles, whose NEFF cache key is a hash of that graph and the
    compiler's flags."""
    import hashlib

    inputs = [(tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor)
              # A script object (an opaque process group) by its type: its
              # repr carries an address.
              else str(v) if isinstance(v, (int, float, bool, torch.SymInt)) else type(v).__name__
              for v in (n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder")]
    return hashlib.sha256(f"{gm.code}\n{inputs}".encode()).hexdigest()[:16]


def _where(node) -> dict:
    frame = user_frame(node)
    return {"file": frame[0], "line": frame[1]} if frame else {"file": None, "line": None}


def _check_devices(facts: GraphFacts, node, tensors) -> None:
    devices = [(t.device, t.dim()) for t in tensors]
    devices += [(torch.device(a), None) for a in
                [*node.args, *node.kwargs.values()] if isinstance(a, torch.device)]
    target = op_name(node.target) if node.op == "call_function" else node.op
    for device, dim in devices:
        if device.type not in _FOREIGN:
            continue
        if device.type == "cpu" and dim == 0:
            continue  # a scalar
        if "scaled_dot_product_fused_attention_overrideable" in target:
            continue  # philox seed/offset
        facts.foreign_devices.append({"graph": facts.name, "node": node.name, "op": target,
                                      "device": str(device), **_where(node)})


def _check_shapes(facts: GraphFacts, node, vals, seen: set) -> None:
    from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

    for v in vals:
        if not isinstance(v, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue
        symbols = free_symbols(v)
        new = {s for s in symbols if s not in seen}
        if not new:
            continue
        seen.update(new)
        unbacked = bool(free_unbacked_symbols(v))
        shape = list(v.shape) if isinstance(v, torch.Tensor) else [v]
        facts.dynamic_shapes.append({
            "graph": facts.name, "node": node.name,
            "kind": "data-dependent" if unbacked else "symbolic",
            "shape": str(shape), **_where(node)})


def mesh_groups(parallel_dims) -> dict[str, str]:
    """Process-group name -> the mesh dimension it is (``fsdp``, ``cp``,
    ``tp``, ``ep``, ...), for the dimensions this layout has."""
    groups: dict[str, str] = {}
    for dim in ("tp", "cp", "ep", "efsdp", "fsdp", "dp_replicate", "pp", "loss", "batch"):
        try:
            mesh = parallel_dims.get_optional_mesh(dim)
        except (KeyError, ValueError, RuntimeError, AttributeError):
            mesh = None
        if mesh is not None and mesh.ndim == 1:
            groups.setdefault(mesh.get_group().group_name, dim)
    return groups


def _group_dim(node, groups: dict[str, str]) -> str:
    for arg in reversed(node.args):
        if isinstance(arg, str) and arg in groups:
            return groups[arg]
    return "?"


def check_graph(gm: torch.fx.GraphModule, name: str,
                groups: dict[str, str] | None = None) -> GraphFacts:
    """Every fact a rehearsal reports about one partitioned graph. ``groups``
    (``mesh_groups``) names the mesh dimension of each collective's group."""
    facts = GraphFacts(name)
    seen: set = set()
    for node in gm.graph.nodes:
        vals = _values(node)
        tensors = _tensors(vals)
        _check_shapes(facts, node, vals, seen)
        _check_devices(facts, node, tensors)
        if node.op != "call_function":
            continue
        target = op_name(node.target)
        facts.ops[target] += 1
        facts.dtypes.update(str(t.dtype).replace("torch.", "") for t in tensors)
        inputs = _tensors([a.meta.get("val") for a in node.all_input_nodes])
        if any(t.is_complex() for t in tensors + inputs):
            facts.complex_ops[target] += 1
        if target in HOST_SYNC_OPS:
            facts.host_syncs.append({"graph": name, "op": target, **_where(node)})
        namespace, _, short = target.partition(".")
        if namespace in COLLECTIVE_NAMESPACES and short not in NOT_COLLECTIVES:
            entry = facts.collectives.setdefault(short, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += largest_bytes(tensors + inputs)
            if groups:
                facts.by_mesh[(short, _group_dim(node, groups))] += 1
    return facts


# Eager ops worth naming in a compiled recipe: each runs on Neuron op by op,
# outside any compiled graph.
HEAVY_EAGER_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten._grouped_mm",
                             "aten._scaled_dot_product_fused_attention_overrideable"})
_TORCH_DIR = str(Path(torch.__file__).parent) + "/"
_REHEARSAL_DIR = str(Path(__file__).parent) + "/"
# The stand-in device's modes (its torch.tensor redirect) are no caller.
_STAND_IN = str(Path(__file__).parent.parent / "tracing" / "neuron_device.py")


def caller() -> str | None:
    """The innermost frame outside torch, the rehearsal and its stand-in
    device, as file:line."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith((_TORCH_DIR, _REHEARSAL_DIR, _STAND_IN)):
            return f"{frame.filename}:{frame.lineno}"
    return None


class EagerOps(TorchDispatchMode):
    """Ops a step runs outside compiled graphs, op by op: counts, dtypes,
    device types and collectives. It steps aside while torch.compile traces
    (``ignore_compile_internals``), so compiled graphs are checked as graphs."""

    def __init__(self):
        super().__init__()
        self.paused = False
        self.ops: Counter = Counter()
        self.dtypes: Counter = Counter()
        self.devices: Counter = Counter()
        self.collectives: dict = {}
        self.where: dict[str, str | None] = {}
        """First caller of each heavy op or collective."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def reset(self) -> None:
        self.ops.clear(), self.dtypes.clear(), self.devices.clear()
        self.collectives, self.where = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = op_name(func)
        self.ops[name] += 1
        flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        self.dtypes.update(str(t.dtype).replace("torch.", "") for t in tensors)
        self.devices.update(t.device.type for t in tensors)
        self.devices.update(a.type for a in flat if isinstance(a, torch.device))
        namespace, _, short = name.partition(".")
        collective = namespace in COLLECTIVE_NAMESPACES and short not in NOT_COLLECTIVES
        if collective:
            entry = self.collectives.setdefault(short, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += largest_bytes(tensors)
        if (collective or name in HEAVY_EAGER_OPS) and name not in self.where:
            self.where[name] = caller()
        return out
