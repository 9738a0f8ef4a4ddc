"""Model-config shaping shared by every Neuron model registry."""

from collections.abc import Callable
from dataclasses import replace

from torchtitan.experiments.graph_trainer.common_utils import (
    build_decoder_config_for_backend,
)
from torchtitan.models.utils import validate_converter_order
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.model_spec import ModelSpec

from .moe import convert_moe_layers
from .rope import convert_decoder_rope


def neuron_decoder_config(config, converters: list[ModelConfigConverter.Config] | None):
    """The prefix-cache RoPE switch (off) on every layer, count-once MoE, then
    ``converters``."""
    convert_decoder_rope(config)
    convert_moe_layers(config)
    if converters:
        validate_converter_order(converters)
        for converter in converters:
            config = converter.build().convert(config)
    return config


def neuron_spec(
    spec: ModelSpec, converters: list[ModelConfigConverter.Config] | None, **changes
) -> ModelSpec:
    """``spec`` with its model shaped by ``neuron_decoder_config`` and the other
    ``changes`` (name, parallelize function, ...) applied."""
    return replace(spec, model=neuron_decoder_config(spec.model, converters), **changes)


def neuron_model_spec(
    upstream_registry: Callable[[str], ModelSpec],
    flavor_configs: dict[str, Callable],
    flavor: str,
    *,
    attn_backend: str,
    converters: list[ModelConfigConverter.Config] | None = None,
    **builder_kwargs,
) -> ModelSpec:
    """An upstream plain-Trainer spec whose model is rebuilt for ``attn_backend``
    and shaped by ``neuron_decoder_config``.

    Upstream's ``get_attention_config`` refuses ``sdpa`` for language models;
    graph_trainer's builder swaps it in per layer (SDPA ignores document
    boundaries, see docs/documents.md).
    """
    config = build_decoder_config_for_backend(
        flavor_configs[flavor], attn_backend, **builder_kwargs
    )
    return neuron_spec(replace(upstream_registry(flavor), model=config), converters)
