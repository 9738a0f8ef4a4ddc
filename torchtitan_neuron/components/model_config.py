"""Model-config shaping shared by every Neuron model registry."""

from collections.abc import Callable
from dataclasses import replace

from torchtitan.experiments.graph_trainer.common_utils import (
    build_decoder_config_for_backend,
)
from torchtitan.components.lora import LoRAConverter
from torchtitan.models.common.linear import Linear
from torchtitan.models.utils import validate_converter_order
from torchtitan.protocols.module import Module
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
            check_lora(converter, config)
            config = converter.build().convert(config)
    return config


def check_lora(converter: ModelConfigConverter.Config, model_config) -> None:
    """A LoRA converter's rank is at least 1 and each of its target modules
    names a linear of the model: upstream's ``LoRAConverter`` only warns
    about a target that matches nothing, and the run then trains fewer
    adapters than asked."""
    if not isinstance(converter, LoRAConverter.Config):
        return
    if converter.rank < 1:
        raise ValueError(f"LoRAConverter.Config(rank={converter.rank}): the LoRA rank must "
                         "be at least 1 (the recipes use 8).")
    linears = {fqn.rsplit(".", 1)[-1]
               for fqn, cfg, _, _ in model_config.traverse(Module.Config, recurse=True)
               if isinstance(cfg, Linear.Config)}
    missing = sorted(set(converter.target_modules or ()) - linears)
    if missing:
        raise ValueError(f"LoRAConverter.Config(target_modules=...): the model has no linear "
                         f"named {', '.join(missing)}; its linears are {', '.join(sorted(linears))}.")


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
