"""GPT-OSS's state-dict adapter with the expert tensors mapped.

Upstream's ``GptOssStateDictAdapter`` (torchtitan 0.3.0) maps the experts to
``inner_experts.mlp1_weight``, ``mlp1_bias``, ``mlp2_weight`` and
``mlp2_bias``; the parameters are ``mlp1_weight_EGD``, ``mlp1_bias_EG``,
``mlp2_weight_EDF`` and ``mlp2_bias_ED``, and ``to_hf`` skips keys it does not
know, so an export held no expert at all and an import left them random.
Its expert targets are also the MXFP4 ``*_blocks`` names of the released
checkpoints, not the bf16/fp32 tensors transformers writes.

This adapter maps them to what ``transformers.GptOssForCausalLM`` holds:
``mlp.experts.gate_up_proj`` ``[E, dim, 2 * hidden]`` (gate and up
interleaved on the last dim, as upstream's ``mlp1_weight_EGD`` interleaves
its rows), ``gate_up_proj_bias``, ``down_proj`` ``[E, hidden, dim]`` and
``down_proj_bias``: the weights transposed, the biases as they are. The
expert-selection bias ``expert_bias_E`` has no place in transformers and is
not written (``torchtitan_neuron.hf`` names it at export). The other keys
are upstream's.

MXFP4 import (``--checkpoint.initial_load_in_hf_quantized``) is refused by
the preflight check: see docs/hf.md.
"""

from __future__ import annotations

import re
from typing import Any

from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

INNER = "layers.{}.moe.routed_experts.inner_experts."
HF = "model.layers.{}.mlp.experts."
# model key -> (HF key, transpose the last two dims)
EXPERTS = {
    INNER + "mlp1_weight_EGD": (HF + "gate_up_proj", True),
    INNER + "mlp1_bias_EG": (HF + "gate_up_proj_bias", False),
    INNER + "mlp2_weight_EDF": (HF + "down_proj", True),
    INNER + "mlp2_bias_ED": (HF + "down_proj_bias", False),
}
# Upstream's expert entries (MXFP4 names onto parameter names the model lacks).
UPSTREAM_EXPERT_KEYS = (
    "model.layers.{}.mlp.experts.gate_up_proj_blocks",
    "model.layers.{}.mlp.experts.gate_up_proj_bias",
    "model.layers.{}.mlp.experts.down_proj_blocks",
    "model.layers.{}.mlp.experts.down_proj_bias",
)


def _transposed(value):
    return value.transpose(1, 2).contiguous()


class GptOssHFStateDictAdapter(GptOssStateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        for key in UPSTREAM_EXPERT_KEYS:
            self.from_hf_map.pop(key, None)
        self._experts_from_hf = {hf: (model, t) for model, (hf, t) in EXPERTS.items()}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        experts, rest = {}, {}
        for key, value in state_dict.items():
            abstract = re.sub(r"(\d+)", "{}", key, count=1)
            if abstract in EXPERTS:
                hf_key, transpose = EXPERTS[abstract]
                layer = re.search(r"\d+", key).group(0)
                experts[hf_key.format(layer)] = _transposed(value) if transpose else value
            else:
                rest[key] = value
        return {**super().to_hf(rest), **experts}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        experts, rest = {}, {}
        for key, value in hf_state_dict.items():
            abstract = re.sub(r"(\d+)", "{}", key, count=1)
            if abstract in self._experts_from_hf:
                model_key, transpose = self._experts_from_hf[abstract]
                layer = re.search(r"\d+", key).group(0)
                experts[model_key.format(layer)] = _transposed(value) if transpose else value
            else:
                rest[key] = value
        return {**super().from_hf(rest), **experts}
