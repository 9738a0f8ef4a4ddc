"""The planner's patches and overrides of torch and torchtitan still fit upstream.

Proves: the source of every upstream function the planner patches
(``torchtitan_neuron.plan.patches.PATCHED``) or overrides is the one recorded
for torch 2.14.1 / torchtitan 0.3.0 (docs/upstream-workarounds.md, section
"Memory planner"); torchtitan's selective-AC save list still lacks the CPU
attention kernel and holds the CUDA and Neuron ones (what ``DeviceAttentionSAC``
works around); ``fast_tracing`` leaves the partitioned graphs of a
selectively checkpointed function op for op as torch's defaults make them.
A failure here means: re-check the row, then update the recorded hash.

Run: .venv/bin/python -m pytest tests/test_plan_upstream.py -q
"""

import hashlib
import importlib
import inspect

import pytest
import torch

from torchtitan_neuron.plan.patches import PATCHED

# sha256 (first 16 hex digits) of inspect.getsource, torch 2.14.1, torchtitan 0.3.0.
RECORDED = {
    ("torchtitan.protocols.module", "Module._init_param"): "aa81b06f115fdc62",
    ("torchtitan.protocols.model", "BaseModel.init_weights"): "fb00f4c07ccd87d8",
    ("torch.nn.modules.module", "Module.to_empty"): "994daf3cc973b29e",
    ("torch._functorch._aot_autograd.graph_compile", "_log_joint_graph"): "b6cc3aa71cbbe167",
    ("torch._functorch._aot_autograd.graph_compile", "_log_fw_bw_graphs"): "685f255abe252610",
    ("torch.utils.checkpoint", "_detach_helper"): "99872a9c0fa7483a",
    # Overridden by subclasses (trainer.QuietMetricsProcessor,
    # plan.trace.DeviceAttentionSAC); train_step is what reads values only
    # when should_log says so.
    ("torchtitan.components.metrics", "MetricsProcessor.should_log"): "5318ecb51f2ba737",
    ("torchtitan.trainer", "Trainer.train_step"): "911f8077fc175e7f",
    ("torchtitan.distributed.activation_checkpoint", "SelectiveAC.get_save_ops"): "6bcf9c7e582835c2",
}


def _source_hash(module: str, qualname: str) -> str:
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def test_every_patch_is_recorded():
    assert set(PATCHED) <= RECORDED.keys()


@pytest.mark.parametrize("target", sorted(RECORDED), ids=lambda t: t[1])
def test_upstream_source_is_the_recorded_one(target):
    assert _source_hash(*target) == RECORDED[target], (
        f"{target[0]}.{target[1]} changed upstream: re-check its row in "
        "docs/upstream-workarounds.md, then record the new hash here."
    )


def test_selective_ac_saves_device_attention_but_not_cpu_attention():
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from torchtitan_neuron.plan.trace import DeviceAttentionSAC

    aten = torch.ops.aten
    upstream = SelectiveAC(SelectiveAC.Config()).get_save_ops()
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in upstream
    assert aten._scaled_dot_product_flash_attention.default in upstream
    assert aten._scaled_dot_product_fused_attention_overrideable.default in upstream
    ours = DeviceAttentionSAC(DeviceAttentionSAC.Config()).get_save_ops()
    assert ours - upstream == {aten._scaled_dot_product_flash_attention_for_cpu.default}


def _partitioned_ops(fast: bool) -> list[list[str]]:
    """The forward and backward graphs' ops for a selectively checkpointed
    block, compiled by the plan backend."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, \
        create_selective_checkpoint_contexts

    from torchtitan_neuron.plan.backend import PlanBackend
    from torchtitan_neuron.plan.patches import fast_tracing

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
