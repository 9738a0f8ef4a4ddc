"""Qwen3 on torchtitan's plain Trainer, with the Neuron model pieces.

Select with ``--module torchtitan_neuron.models.qwen3``.
"""

from dataclasses import replace

from torchtitan.experiments.graph_trainer.common_utils import (
    build_decoder_config_for_backend,
)
from torchtitan.models.qwen3 import model_registry as qwen3_model_registry
from torchtitan.models.qwen3 import qwen3_configs
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.models.common import neuron_decoder_config


def model_registry(flavor: str, attn_backend: str = "sdpa") -> ModelSpec:
    """Upstream's Qwen3 spec on SDPA with the prefix-cache RoPE switch."""
    spec = qwen3_model_registry(flavor)
    config = build_decoder_config_for_backend(qwen3_configs[flavor], attn_backend)
    return replace(spec, model=neuron_decoder_config(config, None))
