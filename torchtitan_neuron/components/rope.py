"""Rotary embeddings with the prefix-cache positions path.

torchtitan's dataloader hands the model per-document positions, and RoPE
gathers the cached frequencies at those positions (``torch.gather`` over the
batch). Neuron does not support that gather. With
``use_prefix_cache_for_positions`` the positions are 0..S-1 for every row, so the
cache is sliced (``cache[0:S]``) and broadcast over the batch instead.
"""

from dataclasses import dataclass

import torch

from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE, RoPE

from torchtitan_neuron.config_utils import promote


class _PrefixCachePositions:
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.use_prefix_cache_for_positions:
            positions = None
        return super().forward(query, key, positions)


class PrefixCacheComplexRoPE(_PrefixCachePositions, ComplexRoPE):
    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        use_prefix_cache_for_positions: bool = False
        """Use positions 0..S-1 (a slice of the cache) instead of gathering the
        dataloader's per-document positions."""


class PrefixCacheCosSinRoPE(_PrefixCachePositions, CosSinRoPE):
    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        use_prefix_cache_for_positions: bool = False
        """Use positions 0..S-1 (a slice of the cache) instead of gathering the
        dataloader's per-document positions."""


_PREFIX_CACHE_CONFIG = {
    ComplexRoPE.Config: PrefixCacheComplexRoPE.Config,
    CosSinRoPE.Config: PrefixCacheCosSinRoPE.Config,
}


def with_prefix_cache_rope(rope: RoPE.Config) -> RoPE.Config:
    """Return ``rope`` as a config that has ``use_prefix_cache_for_positions``."""
    if hasattr(rope, "use_prefix_cache_for_positions"):
        return rope
    target = _PREFIX_CACHE_CONFIG.get(type(rope))
    if target is None:
        raise ValueError(
            f"No prefix-cache variant for RoPE config {type(rope).__qualname__}; "
            f"supported: {[c.__qualname__ for c in _PREFIX_CACHE_CONFIG]}"
        )
    return promote(rope, target)


def convert_decoder_rope(model_config) -> None:
    """Give every layer's attention a RoPE config with the prefix-cache switch."""
    for layer in model_config.layers:
        layer.attention.rope = with_prefix_cache_rope(layer.attention.rope)


def use_prefix_cache_positions(model_config) -> None:
    """Turn the switch on in every layer (after ``convert_decoder_rope``):
    what a recipe for Neuron, which does not support the RoPE gather, does."""
    for layer in model_config.layers:
        layer.attention.rope.use_prefix_cache_for_positions = True
