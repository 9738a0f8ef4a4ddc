"""Model-config shaping shared by every Neuron model registry."""

from torchtitan.models.utils import validate_converter_order
from torchtitan.protocols.model import ModelConfigConverter

from .moe import convert_moe_layers
from .rope import convert_decoder_rope


def neuron_decoder_config(config, converters: list[ModelConfigConverter.Config] | None):
    """Prefix-cache RoPE switch on every layer, count-once MoE, then converters."""
    convert_decoder_rope(config)
    convert_moe_layers(config)
    if converters:
        validate_converter_order(converters)
        for converter in converters:
            config = converter.build().convert(config)
    return config
