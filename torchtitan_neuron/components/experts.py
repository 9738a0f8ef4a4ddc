"""Expert-kernel conversion for MoE layers.

``ExpertKernelConverter`` is a ``ModelConfigConverter``: it swaps every MoE
layer's grouped-experts config for a kernel-selectable one (``LocalExperts``,
or a model family's own, such as GPT-OSS's biased experts) with an
``implementation``: ``grouped_mm``, ``loop`` or ``auto``
(``components.expert_kernels``).

Which kernel-selectable class stands in for an upstream experts config is
looked up in ``LOCAL_EXPERTS``: this module registers torchtitan's
``GroupedExperts``; a model family with its own experts registers them with
``register_local_experts`` beside its model code (GPT-OSS's in
``models/gpt_oss/experts.py``), so this building block imports no family.

Both kernels compute the same function, forward and backward, including
experts that receive no tokens, and both trace under
torch.compile(fullgraph=True).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.model import ModelConfigConverter

from torchtitan_neuron.components.expert_kernels import (
    KERNELS,
    ExpertImplementation,
    resolve_implementation,
)
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


# Upstream experts config class -> its kernel-selectable config class.
LOCAL_EXPERTS: dict[type, type] = {}


def register_local_experts(upstream_config: type, local_config: type) -> None:
    """Make ``ExpertKernelConverter`` put ``upstream_config`` experts (and the
    already converted ``local_config``) on ``local_config``."""
    LOCAL_EXPERTS[upstream_config] = local_config
    LOCAL_EXPERTS[local_config] = local_config


register_local_experts(GroupedExperts.Config, LocalExperts.Config)


def _local_experts_config(inner) -> type:
    """The kernel-selectable experts class for an upstream experts config."""
    local = LOCAL_EXPERTS.get(type(inner))
    if local is None:
        raise TypeError(
            f"ExpertKernelConverter has no kernel-selectable variant of "
            f"{type(inner).__qualname__}; it converts "
            f"{sorted(c.__qualname__ for c in LOCAL_EXPERTS)}. A family's experts "
            "are registered by its model package (GPT-OSS's by importing "
            "torchtitan_neuron.models.gpt_oss)"
        )
    return local
