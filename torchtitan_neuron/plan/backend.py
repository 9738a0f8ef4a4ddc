"""The planner's compile backend: torch 2.14's ``aot_eager``, run op by op.

AOTAutograd with the min-cut rematerialization partitioner (the one
aot_eager, inductor and neuron all use) and input mutations kept in the
graph; each partitioned graph runs through boxed code that drops every input
and intermediate after its last use, and each run is one compiled program
(a NEFF on Neuron) for the tracker. While ``outputs_only`` is on, programs
return outputs of the shapes their graphs record without running.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from types import SimpleNamespace

import torch

from torchtitan_neuron.tracing.ops import op_name, recorded_outputs

_NAMES = itertools.count()
# The tracker that marker nodes report to (``mark_blocks``), while one is on.
_tracking = SimpleNamespace(tracker=None)
_BLOCK = re.compile(r"(?:^|\W)layers[\W_]*(\d+)")


def enter_block(index: int | None) -> None:
    """A marker node's call: the ops after it are transformer block
    ``index``'s (None: no block's)."""
    if _tracking.tracker is not None:
        _tracking.tracker.enter_block(index)


def node_block(node: torch.fx.Node) -> int | None:
    """The transformer block (``layers.<i>``) a node was traced from: its
    module stack, or for a backward node its forward node's."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    for path, _ in stack.values():
        found = _BLOCK.search(str(path))
        if found:
            return int(found.group(1))
    return None


def mark_blocks(graph: torch.fx.Graph) -> set[int]:
    """Insert an ``enter_block`` call wherever the block of the ops changes.
    Ops traced from no block (a bucket's collective, the loss) stay with
    the block before them; ops before the first block belong to none (the
    tracker's state when a program starts). Returns the blocks marked; the
    markers take and return no tensors, so no lifetime changes."""
    current, marked = None, set()
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        block = node_block(node)
        if block is None or block == current:
            continue
        with graph.inserting_before(node):
            graph.call_function(enter_block, (block,))
        current = block
        marked.add(block)
    return marked


class PlanBackend:
    """One registered Dynamo backend, with the tracker its programs report
    to and whether they run at all."""

    def __init__(self, name: str | None = None):
        from torch._dynamo.backends.common import aot_autograd

        self.tracker = None
        self.skip_ops = False
        # Shallow traces (plan/depth.py): tell the tracker each op's block.
        self.marks_blocks = False
        self.marked: list[list[int]] = []  # per graph, the blocks it marked
        # Each partitioned graph's op histogram, named as the rehearsal names
        # them, so a plan can show it traced the graphs the rehearsal checks.
        self.graphs: list = []
        serial = next(_NAMES)
        # On a Neuron target it stands in for torch.compile's ``neuron``
        # backend, the name the neuron platform resolves recipes to.
        self.name = name or "torchtitan_neuron_plan" + (f"_{serial}" if serial else "")
        torch._dynamo.register_backend(name=self.name,
                                       compiler_fn=aot_autograd(**self.aot_settings()))

    def aot_settings(self) -> dict:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        return dict(fw_compiler=self._compile, bw_compiler=self._compile,
                    partition_fn=min_cut_rematerialization_partition,
                    keep_inference_input_mutations=True)

    @contextlib.contextmanager
    def outputs_only(self):
        """Programs return recorded outputs without running (the first step,
        which only compiles and creates gradients and optimizer state)."""
        self.skip_ops = True
        try:
            yield
        finally:
            self.skip_ops = False

    @contextlib.contextmanager
    def tracking(self, tracker):
        """Each program run reports to ``tracker`` as one compiled program."""
        self.tracker = tracker
        _tracking.tracker = tracker
        try:
            with tracker:
                yield
        finally:
            self.tracker = None
            _tracking.tracker = None

    def _compile(self, gm, example_inputs):
        from collections import Counter

        from torch.fx.graph import _BoxedCodeGen


        self.graphs.append(Counter(op_name(n.target) for n in gm.graph.nodes
                                   if n.op == "call_function"))

        if self.marks_blocks:
            self.marked.append(sorted(mark_blocks(gm.graph)))
        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()
        forward = gm.forward

        def run(args):
            if self.skip_ops:
                return recorded_outputs(gm, args)
            if self.tracker is None:
                return forward(args)
            with self.tracker.program(id(gm)):
                return forward(args)

        run._boxed_call = True
        return run

    def traced_clip(self, clip, dynamo_clip):
        """``clip`` (torchtitan's ``clip_grad_norm_``) traced by AOTAutograd
        with this backend's settings, without Dynamo's capture in front.

        Dynamo adds nothing to this graph (no control flow on values, no
        graph breaks; the parameters are read only for ``.grad``), but its
        capture makes a fake copy and guards for each of the 2 x 291
        DTensors of the 8B model. With pipeline stages (an all-reduce of the
        norm across them) or expert parallelism (which reads each
        parameter's mesh), ``dynamo_clip``, the run's own, is used.
        """
        from torch._functorch.aot_autograd import aot_function

        compiled = {}

        def clip_grads(parameters, max_norm, **kwargs):
            if kwargs.get("pp_mesh") is not None or kwargs.get("ep_enabled"):
                return dynamo_clip(parameters, max_norm, **kwargs)
            grads = [p.grad for p in parameters if p.grad is not None]
            key = (len(grads), max_norm, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])))
            if key not in compiled:

                def on_grads(*grads):
                    return clip([SimpleNamespace(grad=g) for g in grads], max_norm, **kwargs)

                compiled[key] = aot_function(on_grads, **self.aot_settings())
            return compiled[key](*grads)

        return clip_grads
