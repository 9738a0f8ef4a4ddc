"""The planner's patches and overrides of torch and torchtitan still fit upstream.

Proves: every upstream function the planner patches
(``torchtitan_neuron.tracing.patches.PATCHED``) has its source pinned in
tests/test_upstream_drift.py (docs/upstream-workarounds.md, section
"Memory planner"); torchtitan's selective-AC save list still lacks the CPU
attention kernel and holds the CUDA and Neuron ones (what ``AttentionSavingSAC``
works around); ``fast_tracing`` leaves the partitioned graphs of a
selectively checkpointed function op for op as torch's defaults make them.

Tier: fast.

Run: .venv/bin/python -m pytest tests/test_plan_upstream.py -q
"""

import pytest
import torch

from test_upstream_drift import PINNED
from torchtitan_neuron.tracing.patches import PATCHED


def test_every_patch_is_pinned():
    """Each upstream function plan.patches replaces has its source pinned in
    tests/test_upstream_drift.py, under a planner row."""
    pinned = {target for row, targets in PINNED.items() if row.startswith("plan-")
              for target in targets}
    missing = [f"{m}:{q}" for m, q in PATCHED if f"{m}:{q}" not in pinned]
    assert not missing, f"planner patches without a pinned source: {missing}"


def test_selective_ac_saves_device_attention_but_not_cpu_attention():
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import AttentionSavingSAC

    aten = torch.ops.aten
    upstream = SelectiveAC(SelectiveAC.Config()).get_save_ops()
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in upstream
    assert aten._scaled_dot_product_flash_attention.default in upstream
    assert aten._scaled_dot_product_fused_attention_overrideable.default in upstream
    ours = AttentionSavingSAC(AttentionSavingSAC.Config()).get_save_ops()
    assert ours - upstream == {aten._scaled_dot_product_flash_attention_for_cpu.default}


def _partitioned_ops(fast: bool) -> list[list[str]]:
    """The forward and backward graphs' ops for a selectively checkpointed
    block, compiled by the plan backend."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, \
        create_selective_checkpoint_contexts

    from torchtitan_neuron.plan.backend import PlanBackend
    from torchtitan_neuron.tracing.patches import fast_tracing

    graphs = []

    class Recording(PlanBackend):
        def _compile(self, gm, example_inputs):
            graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
            return super()._compile(gm, example_inputs)

    backend = Recording()

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    def block(x, w):
        return torch.relu(torch.sin(x) @ w).cos() @ w

    def step(x, w):
        return checkpoint(block, x, w, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts, policy))

    torch._dynamo.reset()
    fn = torch.compile(step, backend=backend.name)
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    if fast:
        with fast_tracing():
            fn(x, w).sum().backward()
    else:
        fn(x, w).sum().backward()
    return graphs


def test_fast_tracing_leaves_the_graphs_as_they_are():
    from unittest import mock

    from torch._subclasses.functional_tensor import FunctionalTensor

    helper = torch.utils.checkpoint._detach_helper
    with mock.patch.object(torch.utils.checkpoint, "_detach_helper", wraps=helper) as spy:
        default = _partitioned_ops(False)
    # The patch has work to do: tracing detaches FunctionalTensors.
    assert any(isinstance(c.args[0], FunctionalTensor) for c in spy.call_args_list)
    fast = _partitioned_ops(True)
    assert len(default) == 2 and "aten.mm.default" in default[0]
    assert fast == default
