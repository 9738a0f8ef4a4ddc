"""Rotary embeddings with the prefix-cache positions path, in real arithmetic.

torchtitan's dataloader hands the model per-document positions, and RoPE
gathers the cached frequencies at those positions (``torch.gather`` over the
batch). Neuron does not support that gather. With
``use_prefix_cache_for_positions`` the positions are 0..S-1 for every row, so the
cache is sliced (``cache[0:S]``) and broadcast over the batch instead.

``PrefixCacheComplexRoPE`` also computes torchtitan's ``ComplexRoPE`` without
complex tensors: inductor does not generate code for complex ops (it falls
back to eager on CPU) and TorchNeuron has to decompose them
(``TORCH_NEURONX_COMPLEX_DECOMPOSE``). Its cache holds upstream's frequencies
(``ComplexRoPE._precompute_cache``, with the llama and yarn scaling) as
(cos, sin) pairs, and the rotation is upstream's complex multiply of
adjacent-dim pairs written out: the same function, with no complex dtype in
any graph.
"""

from dataclasses import dataclass

import torch

from torchtitan.models.common.rope import (
    ComplexRoPE,
    CosSinRoPE,
    RoPE,
    _maybe_check_max_pos,
    _maybe_wrap_positions,
    _reshape_for_broadcast,
)

from torchtitan_neuron.config_utils import promote


class _PrefixCachePositions:
    cp_ranges: tuple[tuple[int, int], ...] = ()
    """Under context parallelism, the runs of sequence positions this rank
    holds (``components/context_parallel.py`` sets them): the prefix path
    then takes those rows of the cache, the same for every batch row, in
    place of rows 0..S-1."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.use_prefix_cache_for_positions:
            positions = None
            if self.cp_ranges:
                positions = torch.cat([
                    torch.arange(start, stop, device=query.device)
                    for start, stop in self.cp_ranges
                ]).unsqueeze(0)
        return super().forward(query, key, positions)


class PrefixCacheComplexRoPE(_PrefixCachePositions, ComplexRoPE):
    """``ComplexRoPE`` on a real cache of shape ``(max_seq_len, dim / 2, 2)``
    holding (cos, sin); equal to upstream up to float32 rounding."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        use_prefix_cache_for_positions: bool = False
        """Use positions 0..S-1 (a slice of the cache) instead of gathering the
        dataloader's per-document positions."""

    def _precompute_cache(self) -> torch.Tensor:
        # Eager, once per build (also from upstream's _init_self_buffers, on
        # the target, meta or fake device), so no graph sees the complex cis.
        # The clone gives the buffer float32 storage of its own: faking a view
        # for a trace fakes its base too, which would be the complex cis.
        return torch.view_as_real(super()._precompute_cache()).clone()

    def _reshape_cache(
        self, query: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Upstream's slice or per-row gather of the cache, as
        ``(1 or batch, seq_len, 1, dim / 2, 2)``."""
        positions = _maybe_wrap_positions(positions, query)
        if positions is not None:
            _maybe_check_max_pos(positions, max_valid_pos=self.cache.shape[0] - 1)
        # _reshape_for_broadcast takes a cache of rows: one row of width dim
        # per position, the (cos, sin) pairs side by side.
        rows = _reshape_for_broadcast(self.cache.flatten(1), query.shape, positions)
        return rows.unflatten(-1, (-1, 2))

    @staticmethod
    def apply_rotary_emb(
        query: torch.Tensor, key: torch.Tensor, rope_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate adjacent-dim pairs, as upstream's complex multiply does."""
        cos, sin = rope_cache.unbind(-1)
        return _rotate_pairs(query, cos, sin), _rotate_pairs(key, cos, sin)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x0 + i x1) * (cos + i sin) in float32, for each pair of ``x``'s last dim."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


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
