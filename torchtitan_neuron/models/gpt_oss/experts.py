"""GPT-OSS experts in the parameter dtype, on the project's expert kernel.

torchtitan 0.3.0's ``GptOssGroupedExperts.forward`` casts the tokens and both
weight stacks to bfloat16 with ``.bfloat16()`` before each grouped GEMM and
returns bfloat16, whatever the parameters are: an fp32 CPU rehearsal then
runs its experts in bf16 and no layout comparison holds to 1e-4. The only
change here is that cast: the GEMMs run in the parameters' dtype (bf16 under
bf16 mixed precision, as upstream; fp32 in the fp32 parity runs) and the result
takes the tokens' dtype, as torchtitan's ``GroupedExperts`` does. Biases, the
clamped interleaved SwiGLU (upstream's ``swiglu``) and the TP bias scaling
(upstream's ``ScaleBiasForward``) are upstream's, and the parameter names are
upstream's, so checkpoints and the state-dict adapter are unchanged.

The GEMMs go through ``_grouped_mm``, which the kernel choice of
``components/experts.py`` (grouped_mm or a per-expert loop) replaces. torch
2.14.1 traces ``grouped_mm`` in bf16/fp16 only, so fp32 GEMMs take the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import spmd_types as spmd
import torch
from torch.distributed.tensor import DTensor

from torchtitan.distributed.spmd_types import spmd_mesh_size
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, ScaleBiasForward, swiglu

from torchtitan_neuron.components.expert_kernels import (
    KERNELS,
    ExpertImplementation,
    grouped_mm,
    per_expert_loop,
    resolve_implementation,
)
from torchtitan_neuron.components.experts import register_local_experts

# torch 2.14.1's grouped_mm meta kernel, which every traced graph goes
# through, takes only these (eager CPU grouped_mm also takes fp32).
GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16)


def _local(param: torch.Tensor) -> torch.Tensor:
    # Upstream's reason: dynamic-shape token groups are not DTensors.
    return param.to_local() if isinstance(param, DTensor) else param


def _tp_degree(param: torch.Tensor) -> int:
    if not isinstance(param, DTensor):
        return 1
    names = param.device_mesh.mesh_dim_names or ()
    return param.device_mesh.size(names.index("tp")) if "tp" in names else 1


def _counts_as_varying(counts_E: torch.Tensor) -> None:
    # Upstream's step under spmd_types type checking without EP: the counts
    # are partial over dp/cp and must read as varying to mix with the weights.
    checking = get_spmd_backend() == "spmd_types" and spmd.is_type_checking()
    if checking and spmd_mesh_size("ep") == 1:
        for axis in ("dp", "cp"):
            spmd.mutate_type(counts_E, axis, src=spmd.P, dst=spmd.V)


def _per_token_bias(bias_EX: torch.Tensor, counts_E: torch.Tensor, rows: int) -> torch.Tensor:
    """Each routed row's expert bias; rows past the last expert's (padding) get 0.

    Upstream's construction: a zero row for the tail slack, so the output size
    is static and repeat_interleave needs no host sync."""
    offsets_end = counts_E.sum().unsqueeze(0)
    slack = (rows - offsets_end).to(counts_E.dtype)
    repeats = torch.cat([counts_E, slack]).long()
    padded = torch.cat([bias_EX, bias_EX.new_zeros(1, bias_EX.shape[-1])])
    return padded.repeat_interleave(repeats, dim=0, output_size=rows)


class GptOssLocalExperts(GptOssGroupedExperts):
    """``GptOssGroupedExperts`` in the parameter dtype, with a selectable kernel."""

    @dataclass(kw_only=True, slots=True)
    class Config(GptOssGroupedExperts.Config):
        implementation: ExpertImplementation = "auto"
        """grouped_mm, loop, or auto (fastest measured on this platform)."""

    def __init__(self, config: Config):
        super().__init__(config)
        # mlp1 maps dim to 2 x hidden (gate and linear interleaved).
        self.implementation = resolve_implementation(
            config.implementation, config.dim, 2 * config.hidden_dim, config.num_experts
        )
        self._kernel = KERNELS[self.implementation]

    def _grouped_mm(
        self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor
    ) -> torch.Tensor:
        # An fp32 run (the CPU parity runs) cannot trace grouped_mm; the
        # per-expert loop computes the same function in fp32.
        if self._kernel is grouped_mm and A.dtype not in GROUPED_MM_DTYPES:
            return per_expert_loop(A, B_t, offs)
        return self._kernel(A, B_t, offs)

    def forward(
        self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
    ) -> torch.Tensor:
        w1_EGD, b1_EG = _local(self.mlp1_weight_EGD), _local(self.mlp1_bias_EG)
        w2_EDF, b2_ED = _local(self.mlp2_weight_EDF), _local(self.mlp2_bias_ED)
        dtype, rows = w1_EGD.dtype, x_RD.shape[0]
        _counts_as_varying(num_tokens_per_expert_E)
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

        h_RG = self._grouped_mm(A=x_RD.to(dtype), B_t=w1_EGD.transpose(-2, -1), offs=offsets_E)
        h_RG = h_RG + _per_token_bias(b1_EG, num_tokens_per_expert_E, rows).to(dtype)
        h_RF = swiglu(h_RG, limit=self.swiglu_limit)
        h_RD = self._grouped_mm(A=h_RF, B_t=w2_EDF.transpose(-2, -1), offs=offsets_E)
        # Row-wise TP sums the partial outputs, so the replicated bias is
        # scaled by 1/TP in forward (not in backward), as upstream does.
        b2_RD = _per_token_bias(b2_ED, num_tokens_per_expert_E, rows)
        b2_RD = ScaleBiasForward.apply(b2_RD, _tp_degree(self.mlp1_weight_EGD), dtype)
        return (h_RD + b2_RD).type_as(x_RD)


# ExpertKernelConverter puts GPT-OSS's experts on this class.
register_local_experts(GptOssGroupedExperts.Config, GptOssLocalExperts.Config)
