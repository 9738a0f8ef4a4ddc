"""GPT-OSS experts in the parameter dtype, on either expert kernel.

Proves: in fp32, ``GptOssLocalExperts`` (grouped_mm and the per-expert loop,
eager and under torch.compile(fullgraph=True)) equals a plain per-expert loop
with upstream's biases and ``swiglu`` within 1e-6, forward and every gradient,
with uneven counts and idle experts (in fp32 both settings run the loop:
torch 2.14's traced grouped_mm takes bf16/fp16 only); in bf16 it equals upstream's
``GptOssGroupedExperts`` exactly (the only change is the dtype of the GEMMs);
upstream's own forward returns bf16 for fp32 parameters (why this exists); the
parameter names are upstream's; and the expert-kernel converter puts GPT-OSS
experts on this class and DeepSeek's on ``LocalExperts``.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_gpt_oss_experts.py -q
"""

import pytest
import torch

from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, swiglu

from torchtitan_neuron.components.experts import ExpertKernelConverter, LocalExperts
from torchtitan_neuron.models.gpt_oss.experts import GptOssLocalExperts

D, HID, E = 32, 16, 6
COUNTS = [5, 0, 17, 1, 0, 9]  # uneven, two idle experts
NAMES = ["mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED"]


def _experts(cls, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    experts = cls.Config(dim=D, hidden_dim=HID, num_experts=E, **kwargs).build()
    for p in experts.parameters():
        # std 0.5 puts some SwiGLU inputs past the clamp at 7 after the GEMM.
        torch.nn.init.normal_(p, std=0.5)
    return experts.to(dtype)


def _reference(x, w1, b1, w2, b2, counts):
    """One expert at a time: x_e @ W1_e^T + b1_e, upstream's swiglu, @ W2_e^T + b2_e."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        x_e = x[start:start + n]
        h = swiglu(x_e @ w1[e].T + b1[e])
        outs.append(h @ w2[e].T + b2[e])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("implementation", ["grouped_mm", "loop"])
def test_fp32_experts_equal_a_per_expert_reference(implementation, compiled):
    experts = _experts(GptOssLocalExperts, implementation=implementation)
    counts = torch.tensor(COUNTS)
    x = torch.randn(int(counts.sum()), D, requires_grad=True)
    fn = torch.compile(experts, backend="aot_eager", fullgraph=True) if compiled else experts
    out = fn(x, counts)
    assert out.dtype == torch.float32
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    params = [getattr(experts, n).detach().clone().requires_grad_() for n in NAMES]
    xr = x.detach().clone().requires_grad_()
    ref = _reference(xr, *params, COUNTS)
    ref.backward(grad_out)
    # Some gate inputs were clamped: the SwiGLU limit is exercised.
    assert (xr @ params[0][2].T + params[1][2]).abs().max() > 7

    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-6, atol=1e-6)
    for name, want in zip(NAMES, params):
        torch.testing.assert_close(getattr(experts, name).grad, want.grad, rtol=1e-6, atol=1e-6)
    for idle in (1, 4):
        assert experts.mlp1_weight_EGD.grad[idle].abs().max() == 0
        assert experts.mlp2_bias_ED.grad[idle].abs().max() == 0


def test_bf16_experts_equal_upstream_exactly_and_upstream_casts_fp32_to_bf16():
    counts = torch.tensor(COUNTS)
    x = torch.randn(int(counts.sum()), D)
    ours = _experts(GptOssLocalExperts, torch.bfloat16, implementation="grouped_mm")
    upstream = _experts(GptOssGroupedExperts, torch.bfloat16)
    assert [n for n, _ in ours.named_parameters()] == NAMES
    assert [n for n, _ in upstream.named_parameters()] == NAMES
    for name in NAMES:
        assert torch.equal(getattr(ours, name), getattr(upstream, name))
    assert torch.equal(ours(x.bfloat16(), counts), upstream(x.bfloat16(), counts))
    # Upstream in fp32 still computes, and returns, bf16.
    assert _experts(GptOssGroupedExperts)(x, counts).dtype == torch.bfloat16


def test_converter_picks_the_experts_class_by_upstream_type():
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.gpt_oss import gptoss_configs

    config = gptoss_configs["debugmodel"](moe_comm_backend="standard", attn_backend="flex")
    config = ExpertKernelConverter.Config(implementation="loop").build().convert(config)
    for layer in config.layers:
        inner = layer.moe.routed_experts.inner_experts
        assert type(inner) is GptOssLocalExperts.Config and inner.implementation == "loop"
        assert inner.swiglu_limit == 7.0 and inner.param_init is not None
    plain = GroupedExperts.Config(dim=D, hidden_dim=HID, num_experts=E)
    from torchtitan_neuron.components.experts import _local_experts_config

    assert _local_experts_config(plain) is LocalExperts.Config
