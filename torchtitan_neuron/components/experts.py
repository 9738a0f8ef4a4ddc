"""Expert-kernel conversion for MoE layers.

``ExpertKernelConverter`` is a ``ModelConfigConverter``: it swaps every MoE
layer's grouped-experts config for a kernel-selectable one (``LocalExperts``,
or ``GptOssLocalExperts`` for GPT-OSS's biased experts) with an
``implementation``: ``grouped_mm``, ``loop`` or ``auto``
(``components.expert_kernels``).

Both kernels compute the same function, forward and backward, including
experts that receive no tokens, and both trace under
torch.compile(fullgraph=True).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
from torchtitan.protocols.model import ModelConfigConverter

from torchtitan_neuron.components.expert_kernels import (
    KERNELS,
    ExpertImplementation,
    resolve_implementation,
)
from torchtitan_neuron.components.gpt_oss_experts import GptOssLocalExperts
from torchtitan_neuron.config_utils import promote


class LocalExperts(GroupedExperts):
    """torchtitan's GroupedExperts with a selectable grouped-GEMM kernel."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        implementation: ExpertImplementation = "auto"
        """grouped_mm, loop, or auto (fastest measured on this platform)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.implementation = resolve_implementation(
            config.implementation, config.dim, config.hidden_dim, config.num_experts
        )
        self._kernel = KERNELS[self.implementation]

    def _grouped_mm(
        self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor
    ) -> torch.Tensor:
        return self._kernel(A, B_t, offs)


class ExpertKernelConverter(ModelConfigConverter):
    """Put every MoE layer's experts on the chosen expert kernel."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        implementation: ExpertImplementation = "auto"

    def __init__(self, config: Config):
        self.config = config

    def convert(self, model_config):
        for layer in model_config.layers:
            moe = getattr(layer, "moe", None)
            if moe is None:
                continue
            inner = moe.routed_experts.inner_experts
            moe.routed_experts.inner_experts = promote(
                inner, _local_experts_config(inner), implementation=self.config.implementation
            )
        return model_config


def _local_experts_config(inner) -> type:
    """The kernel-selectable experts class for an upstream experts config."""
    if isinstance(inner, GptOssGroupedExperts.Config):
        # GPT-OSS experts have biases and a clamped SwiGLU.
        return GptOssLocalExperts.Config
    if isinstance(inner, LocalExperts.Config) or type(inner) is GroupedExperts.Config:
        return LocalExperts.Config
    raise TypeError(
        f"ExpertKernelConverter has no kernel-selectable variant of "
        f"{type(inner).__qualname__}; it converts GroupedExperts and GptOssGroupedExperts"
    )
