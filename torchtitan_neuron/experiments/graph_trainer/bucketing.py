"""One all-gather per transformer block for SimpleFSDP, in the model's code.

SimpleFSDP gathers each parameter through its own property getter: one
all-gather per parameter per use, and one reduce-scatter per gradient.
``bucket_blocks`` gives every transformer block one gather per FSDP mesh for
all of its FSDP-sharded parameters:

- the block's local shards are padded to equal rows, flattened and
  concatenated, cast to ``param_dtype`` and all-gathered once;
- the full parameters are views into the result (re-wrapped as TP DTensors
  under TP x FSDP, as upstream's getter does);
- the backward of that gather is one reduce-scatter of the flat gradient in
  ``reduce_dtype``; parameters that do not train (a LoRA base) are
  bucketed apart from those that do, so they are never reduce-scattered.

A bucket holds at most ``bucket_mib`` MiB in the wider of the two dtypes
(the flat gather or the flat gradient); a block that needs more gets several,
its parameters in order, and a parameter over the bound is a bucket of its
own. The default, 512 MiB, is the Neuron runtime's default scratchpad page:
under paged scratchpad a tensor over a page is allocated on its own
(docs/planner.md), which an unbounded bucket of a large MoE block would be.

It is expressed with functional collectives inside the block's forward, so
the graph every compile backend receives (``neuron``, inductor, aot_eager)
already has one collective per block; nothing depends on a backend's own
passes. The parameters stay per-parameter DTensors sharded on dim 0, so DCP,
the optimizer, initialisation and gradient clipping see no change.

The gather runs inside its own checkpoint region, within the block's AC
region when the block has one, so it is recomputed in backward as the
per-parameter gathers are (``activation_checkpoint.reshard_after_forward``):
resharding after forward holds under full, selective and no AC. Under
``--parallelism.fsdp_reshard_after_forward never`` it runs before the block's
AC region instead, with no checkpoint, so the gathered parameters are kept
for backward and nothing is gathered again.

Left per parameter: parameters FSDP shards on another dim than 0 (routed
experts when EP x FSDP exceeds the experts), HSDP and DDP layouts, and blocks
with fewer than two such parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch._functorch.config
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.checkpoint import checkpoint
from torchtitan.experiments.graph_trainer import simple_fsdp

from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import is_simple_fsdp_module
from torchtitan_neuron.devices.neuron import NEURON_DEFAULT_SCRATCHPAD_PAGE_MB

# The default bound: above one paged-scratchpad page, a tensor is allocated
# on its own (devices/neuron.py).
DEFAULT_BUCKET_MIB = NEURON_DEFAULT_SCRATCHPAD_PAGE_MB

# The attribute of a module (in its __dict__) that holds its parameters as
# gathered for the current step, where the overridden getters find them.
GATHERED_ATTR = "_torchtitan_neuron_bucket"
# The mesh dims upstream's apply_simple_fsdp shards over (common_utils.py).
FSDP_DIMS = ("fsdp", "efsdp")


class _GatherBucket(torch.autograd.Function):
    """All-gather of one flat shard in param_dtype; backward: reduce-scatter
    (sum, as SimpleFSDP's ``Partial("sum")``) of the flat gradient in
    reduce_dtype, returned in the shard's dtype."""

    @staticmethod
    def forward(ctx, flat, group_name: str, param_dtype, reduce_dtype):
        ctx.group_name, ctx.reduce_dtype, ctx.dtype = group_name, reduce_dtype, flat.dtype
        return funcol.wait_tensor(funcol.all_gather_tensor(flat.to(param_dtype), 0, group_name))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.to(ctx.reduce_dtype)
        out = funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 0, ctx.group_name)
        return funcol.wait_tensor(out).to(ctx.dtype), None, None, None


def _mixed(param_dtype, reduce_dtype) -> bool:
    """Gathers in one dtype and reduce-scatters in another: ``_GatherBucket``."""
    return param_dtype is not None and reduce_dtype is not None and param_dtype != reduce_dtype


def allow_caching_gather_buckets() -> None:
    """Let AOTAutograd's on-disk cache keep graphs that hold ``_GatherBucket``.

    torch 2.14 bypasses that cache for any graph with a custom autograd.Function
    ("Can't cache HigherOrderOperator: autograd_function_apply") unless
    ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions``
    is set; then the Function's forward and backward are traced subgraphs of
    the graph, hashed into its key like the rest of it. Without it a new
    process traces and compiles the bf16 recipes' block graphs again (warm
    first step of the default debug recipe: 14.9 s against 4.1 s with it,
    docs/architecture.md). ``TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0``
    in the environment still wins over this."""
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True


def _all_gather(flat, group_name: str, param_dtype, reduce_dtype):
    """The bucket's all-gather in param_dtype; its backward reduce-scatters
    (sum) in reduce_dtype.

    When the two dtypes agree: torch's own differentiable functional
    all-gather (backward: reduce-scatter, sum). Otherwise ``_GatherBucket``,
    an autograd.Function, which AOTAutograd's cache keeps only when told to
    (``allow_caching_gather_buckets``)."""
    if not _mixed(param_dtype, reduce_dtype):
        if param_dtype is not None:
            flat = flat.to(param_dtype)  # autograd casts the gradient back
        return funcol.wait_tensor(funcol.all_gather_single(flat, 0, group_name))
    return _GatherBucket.apply(flat, group_name, param_dtype, reduce_dtype)


@dataclass(frozen=True)
class _Entry:
    module: nn.Module
    name: str
    rows: int  # dim 0 of the gathered (TP-local) parameter on this rank
    pad_rows: int  # rows every FSDP rank contributes: ceil(rows / FSDP degree)
    shape: tuple[int, ...]  # the gathered (TP-local) shape on this rank
    tp: tuple | None  # (TP mesh, TP placements) to re-wrap with, or None
    numel: int  # elements it adds to the bucket's gathered flat tensor, padding included


def _fsdp_sharded(param) -> bool:
    """Sharded on dim 0 by FSDP, the first dim of its mesh (``fsdp``, or
    ``efsdp`` for routed experts)."""
    if not isinstance(param, DTensor):
        return False
    first, mesh = param.placements[0], param.device_mesh
    return (isinstance(first, (Shard, _StridedShard)) and first.dim == 0
            and mesh.mesh_dim_names is not None
            and mesh.mesh_dim_names[0] in FSDP_DIMS)


def _entry(module: nn.Module, name: str, param: DTensor, fsdp_size: int) -> _Entry:
    mesh = param.device_mesh
    if mesh.ndim == 1:
        shape, tp = tuple(param.shape), None
    else:
        # What upstream's getter returns: the TP-local tensor, wrapped on the
        # non-FSDP mesh with the parameter's TP placements.
        tp_placements = tuple(param.placements[1:])
        shape, _ = compute_local_shape_and_global_offset(
            param.shape, mesh, (Replicate(),) + tp_placements)
        tp = (mesh[tuple(mesh.mesh_dim_names[1:])], tp_placements)
    rows = shape[0]
    pad_rows = math.ceil(rows / fsdp_size)
    return _Entry(module, name, rows, pad_rows, tuple(shape), tp,
                  fsdp_size * pad_rows * math.prod(shape[1:]))


def fsdp_groups(block: nn.Module) -> dict[str, list[_Entry]]:
    """The block's FSDP-sharded parameters, by FSDP process group name."""
    groups: dict[str, list[_Entry]] = {}
    for module in block.modules():
        if not is_simple_fsdp_module(module):
            continue
        for name, param in module._parameters.items():
            if not _fsdp_sharded(param):
                continue
            fsdp = param.device_mesh[param.device_mesh.mesh_dim_names[0]] \
                if param.device_mesh.ndim > 1 else param.device_mesh
            group_name = fsdp.get_group().group_name
            groups.setdefault(group_name, []).append(
                _entry(module, name, param, fsdp.size()))
    return groups


def gather_shards(group_name, param_dtype, reduce_dtype, layout, *shards):
    """The full parameters of one bucket from this rank's shards."""
    padded = []
    for t, (rows, pad_rows, shape) in zip(shards, layout):
        if t.shape[0] < pad_rows:
            t = torch.cat([t, t.new_zeros((pad_rows - t.shape[0], *t.shape[1:]))])
        padded.append(t.reshape(-1))
    full = _all_gather(torch.cat(padded), group_name, param_dtype, reduce_dtype)
    sizes = [p.numel() for p in padded]
    world = full.numel() // sum(sizes)
    # One split (its backward is one cat into the flat gradient), then each
    # parameter's rows from every rank: rank r's rows are r * pad_rows onward
    # (torch.chunk's split, which DTensor's Shard(0) uses), padding at the end.
    out = []
    for part, (rows, pad_rows, shape) in zip(full.view(world, -1).split(sizes, dim=1), layout):
        t = part.reshape(world * pad_rows, *shape[1:])
        out.append(t if rows == world * pad_rows else t[:rows])
    return tuple(out)


def _split(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """``entries`` in order, cut into runs of at most ``limit`` elements
    (an entry over it alone)."""
    buckets: list[list[_Entry]] = []
    size = limit + 1
    for e in entries:
        if size + e.numel > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(e)
        size += e.numel
    return buckets


def _by_training(entries: list[_Entry]) -> list[list[_Entry]]:
    """``entries`` that train, then those that do not (a LoRA base): apart,
    so a frozen weight is gathered for compute but its bucket has no
    gradient to reduce-scatter. Together, the flat gradient of the whole
    bucket (zeros where the base is) was reduce-scattered, and the
    adapters' gradients were views of it."""
    trains = [e for e in entries if e.module._parameters[e.name].requires_grad]
    frozen = [e for e in entries if not e.module._parameters[e.name].requires_grad]
    return [part for part in (trains, frozen) if part]


def require_positive_bound(bucket_mib: float) -> None:
    """A bucket bound must be a positive size (checked when the config is
    parsed, before any rank starts)."""
    if bucket_mib <= 0:
        raise ValueError(
            f"--compile.bucket_mib {bucket_mib} is not a bucket size: give a positive "
            f"number of MiB (default {DEFAULT_BUCKET_MIB}), or --compile.no-bucketing to "
            "gather each parameter on its own."
        )


def bucket_blocks(model: nn.Module, param_dtype, reduce_dtype,
                  bucket_mib: float | None = DEFAULT_BUCKET_MIB,
                  reshard_after_forward: bool = True) -> tuple[int, int, int]:
    """Give each block of ``model.layers`` one gather per FSDP mesh, or a
    few where its parameters exceed ``bucket_mib``.

    With ``reshard_after_forward=False`` (``--parallelism.fsdp_reshard_after_forward
    never``) the gathers run before the block's AC region and outside any
    checkpoint, so their output is kept for backward; the block's other
    SimpleFSDP parameters are gathered there too, each on its own. With
    ``bucket_mib=None`` nothing is bucketed: that keeps every parameter's own
    gather, moved before the AC region.

    Returns (blocks bucketed, parameters bucketed, buckets)."""
    if bucket_mib is not None:
        require_positive_bound(bucket_mib)
        itemsize = max((d or torch.float32).itemsize for d in (param_dtype, reduce_dtype))
        limit = int(bucket_mib * 2**20) // itemsize
    blocks = params = count = 0
    for block in model.layers.values():
        groups = [] if bucket_mib is None else [
            (g, chunk) for g, es in fsdp_groups(block).items()
            for part in _by_training(es) if len(part) >= 2
            for chunk in _split(part, limit)]
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        singles = [] if reshard_after_forward or inner is block else _singles(inner, groups)
        if not groups and not singles:
            continue
        if reshard_after_forward:
            # Inside the block's AC region, so the gathered parameters are
            # recomputed with the block. The hand-off to the getters is a
            # module attribute set and cleared within the forward, a Python
            # side effect Dynamo refuses inside a checkpoint ("HOP: Unsafe
            # side effect") unless told not to replay it in the backward's
            # recompute; there is nothing to replay, it only routes tensors
            # to the getters.
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        if _mixed(param_dtype, reduce_dtype):
            allow_caching_gather_buckets()
        _install(inner if reshard_after_forward else block, groups, singles,
                 param_dtype, reduce_dtype, reshard_after_forward)
        blocks += 1
        params += sum(len(es) for _, es in groups)
        count += len(groups)
    return blocks, params, count


def _singles(block: nn.Module, groups) -> list[tuple[nn.Module, str]]:
    """The block's SimpleFSDP parameters no bucket of ``groups`` holds."""
    bucketed = {(id(e.module), e.name) for _, es in groups for e in es}
    return [(module, name) for module in block.modules()
            if is_simple_fsdp_module(module)
            for name in module._parameters
            if isinstance(vars(type(module)).get(name), property)
            and (id(module), name) not in bucketed]


def _install(block: nn.Module, groups: list[tuple[str, list[_Entry]]],
             singles: list[tuple[nn.Module, str]], param_dtype, reduce_dtype,
             reshard_after_forward: bool):
    forward = block.forward
    plan = [(group_name, es, tuple((e.rows, e.pad_rows, e.shape) for e in es))
            for group_name, es in groups]

    def bucketed_forward(*args, **kwargs):
        if not simple_fsdp._active_parametrization:
            return forward(*args, **kwargs)
        routed = []
        for group_name, entries, layout in plan:
            shards = [e.module._parameters[e.name].to_local() for e in entries]
            if reshard_after_forward:
                full = checkpoint(gather_shards, group_name, param_dtype, reduce_dtype,
                                  layout, *shards, use_reentrant=False,
                                  preserve_rng_state=False)
            else:
                full = gather_shards(group_name, param_dtype, reduce_dtype, layout, *shards)
            for e, t in zip(entries, full):
                if e.tp is not None:
                    t = DTensor.from_local(t, e.tp[0], e.tp[1])
                e.module.__dict__.setdefault(GATHERED_ATTR, {})[e.name] = t
                routed.append((e.module, e.name))
        for module, name in singles:
            # Its own getter (SimpleFSDP's gather, kept: reshard_after_forward
            # marked the module), called here, before the AC region.
            module.__dict__.setdefault(GATHERED_ATTR, {})[name] = getattr(module, name)
            routed.append((module, name))
        try:
            return forward(*args, **kwargs)
        finally:
            for module, name in routed:
                module.__dict__[GATHERED_ATTR].pop(name, None)

    block.forward = bucketed_forward
    for cls in {type(e.module) for _, es in groups for e in es} | {type(m) for m, _ in singles}:
        override_getters(cls)


def override_getters(cls: type) -> int:
    """Make each property getter of a ``SimpleFSDP`` class return the
    block's gathered parameter while its bucketed forward runs, and call the
    getter underneath otherwise. Idempotent; returns the getters changed."""
    changed = 0
    for name, attr in list(vars(cls).items()):
        if isinstance(attr, property) and not getattr(attr.fget, GATHERED_ATTR, False):
            setattr(cls, name, property(_bucket_first(name, attr.fget)))
            changed += 1
    return changed


def _bucket_first(name, fget):
    def getter(module):
        bucket = module.__dict__.get(GATHERED_ATTR)
        if bucket and name in bucket:
            return bucket[name]
        return fget(module)

    setattr(getter, GATHERED_ATTR, True)
    return getter
