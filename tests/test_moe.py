"""Expert kernels and auxiliary-loss-free load balancing for DeepSeek-V3.

Proves: both expert kernels the converter can pick (``grouped_mm`` and the
per-expert ``loop``) equal a plain per-token reference, forward and backward,
with uneven token counts and experts that receive none, eagerly and under
torch.compile(fullgraph=True); the converter puts every MoE layer on them;
per-expert token counts are the same with no AC, selective AC and full AC,
eager and compiled (upstream's MoE double-counts under eager AC); and from a
deliberately skewed router the bias updates drive the measured imbalance down
while keeping the biases mean-centred.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_moe.py -q
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.moe import MoE

from torchtitan_neuron.components.experts import LocalExperts
from torchtitan_neuron.components.moe import (
    CountOnceMoE,
    load_imbalance,
    update_expert_bias,
)
from torchtitan_neuron.config_utils import promote
from torchtitan_neuron.models.deepseek_v3.config_registry import (
    deepseek_v3_debugmodel_neuron_tp2_fsdp2,
)

D, HID, E = 32, 24, 6
COUNTS = [5, 0, 17, 1, 0, 9]  # uneven, two idle experts


def _reference(x, w1, w2, w3, counts):
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start:start + n].float()
        h = F.silu(xe @ w1[e].float().T) * (xe @ w3[e].float().T)
        outs.append(h @ w2[e].float().T)
        start += n
    return torch.cat(outs)


def _assert_close_bf16(got, want):
    # The kernels keep bf16 intermediates; the reference is fp32 from the same
    # bf16 operands. Errors are judged against the tensor's scale.
    got, want = got.float(), want.float()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2e-2 * scale + 1e-6, (got - want).abs().max() / scale


@pytest.mark.parametrize("implementation", ["grouped_mm", "loop"])
@pytest.mark.parametrize("compiled", [False, True])
def test_expert_kernel_matches_reference(implementation, compiled):
    torch.manual_seed(0)
    experts = LocalExperts.Config(
        dim=D, hidden_dim=HID, num_experts=E, implementation=implementation
    ).build()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    counts = torch.tensor(COUNTS)
    x = torch.randn(int(counts.sum()), D, requires_grad=True)
    fn = torch.compile(experts, backend="aot_eager", fullgraph=True) if compiled else experts
    out = fn(x, counts)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    # The reference sees the same bf16-rounded operands the kernels use.
    params = [p.detach().bfloat16().requires_grad_() for p in
              (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD)]
    xr = x.detach().bfloat16().requires_grad_()
    ref = _reference(xr, *params, COUNTS)
    ref.backward(grad_out.float())

    _assert_close_bf16(out, ref)
    _assert_close_bf16(x.grad, xr.grad)
    for got, want in zip((experts.w1_EFD, experts.w2_EDF, experts.w3_EFD), params):
        _assert_close_bf16(got.grad, want.grad)
    # Idle experts get exactly zero gradient.
    for idle in (1, 4):
        assert experts.w1_EFD.grad[idle].abs().max() == 0


def _debug_moe_config():
    return deepseek_v3_debugmodel_neuron_tp2_fsdp2().model_spec.model.layers[1].moe


def test_auto_expert_kernel_is_measured_once_per_compile_cache(tmp_path, monkeypatch):
    """A run with a warm compile cache uses the kernel the run that filled it
    measured, so it traces the same graph and reuses the compiled step."""
    import json

    from torchtitan_neuron.components import expert_kernels as experts

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    stored = tmp_path / experts.CHOICES_FILE

    def run(measure):
        monkeypatch.setattr(experts, "_measured", {})
        monkeypatch.setattr(experts, "_measure", measure)
        return experts.measure_fastest(16, 32, 4)

    assert run(lambda *a: "loop") == "loop"
    assert json.loads(stored.read_text()) == {"4x16x32": "loop"}

    def measured_again(*args):
        raise AssertionError("measured again with a warm compile cache")

    assert run(measured_again) == "loop"
    # An unreadable file is measured over, not an error.
    stored.write_text("{not json")
    assert run(lambda *a: "grouped_mm") == "grouped_mm"
    assert json.loads(stored.read_text()) == {"4x16x32": "grouped_mm"}


def test_converter_puts_every_moe_layer_on_local_experts():
    layers = deepseek_v3_debugmodel_neuron_tp2_fsdp2().model_spec.model.layers
    moes = [layer.moe for layer in layers if getattr(layer, "moe", None) is not None]
    assert moes
    for moe in moes:
        assert isinstance(moe, CountOnceMoE.Config)
        assert isinstance(moe.routed_experts.inner_experts, LocalExperts.Config)


def _build(moe_config):
    torch.manual_seed(0)
    moe = moe_config.build()
    moe.init_states()
    moe.train()
    return moe


def _counts_after_step(moe_config, wrap, compiled=False):
    module = _build(moe_config)
    block = wrap(module)
    fn = torch.compile(block, backend="aot_eager", fullgraph=True) if compiled else block
    torch.manual_seed(1)
    x = torch.randn(2, 32, moe_config.routed_experts.inner_experts.dim, requires_grad=True)
    fn(x).sum().backward()
    return module.tokens_per_expert_E.clone()


AC_WRAPPERS = {
    "none": lambda m: m,
    "full": lambda m: FullAC(FullAC.Config())._wrap_block(m),
    "selective": lambda m: SelectiveAC(SelectiveAC.Config())._wrap_block(m),
}


@pytest.mark.parametrize("compiled", [False, True])
def test_counts_are_the_same_with_and_without_ac(compiled):
    config = _debug_moe_config()
    counts = {
        mode: _counts_after_step(config, wrap, compiled) for mode, wrap in AC_WRAPPERS.items()
    }
    top_k = config.router.top_k
    assert counts["none"].sum() == 2 * 32 * top_k
    torch.testing.assert_close(counts["full"], counts["none"], rtol=0, atol=0)
    torch.testing.assert_close(counts["selective"], counts["none"], rtol=0, atol=0)


def test_upstream_moe_double_counts_under_eager_full_ac():
    # Why CountOnceMoE exists: the same step with torchtitan's MoE.
    config = _debug_moe_config()
    upstream = promote(config, MoE.Config)
    counts_plain = _counts_after_step(upstream, AC_WRAPPERS["none"])
    counts_full = _counts_after_step(upstream, lambda m: checkpoint_wrapper(m))
    torch.testing.assert_close(counts_full, 2 * counts_plain, rtol=0, atol=0)


def test_skewed_router_is_balanced_by_bias_updates():
    config = _debug_moe_config()
    config.load_balance_coeff = 1e-2
    moe = _build(config)
    with torch.no_grad():
        # Skew: expert 0's gate row follows the inputs' mean direction, so
        # every token's top-k starts with expert 0.
        moe.router.gate.weight[0] += 0.01
    model = SimpleNamespace(get_submodule=lambda name: {"0": SimpleNamespace(moe_enabled=True, moe=moe)})
    no_dist = SimpleNamespace(ep_enabled=False, tp=1, get_optional_mesh=lambda name: None)
    torch.manual_seed(2)
    dim = config.routed_experts.inner_experts.dim
    imbalance = []
    for _ in range(40):
        with torch.no_grad():
            moe(torch.randn(4, 64, dim) + 0.5)
        update_expert_bias([model], no_dist)
        imbalance.append(float(moe.load_imbalance))
        assert abs(float(moe.expert_bias_E.mean())) < 1e-6  # mean-centred
    print("imbalance over steps:", [round(v, 2) for v in imbalance])
    assert imbalance[0] > 2.5, "the router must start skewed"
    assert sum(imbalance[-5:]) / 5 < 0.7 * imbalance[0]
    assert float(load_imbalance(torch.ones(8))) == 1.0
