"""Llama 3 on torchtitan's plain Trainer (FSDP2), with the Neuron model pieces.

Select with ``--module torchtitan_neuron.models.llama3``.
"""

from dataclasses import replace

from torchtitan.experiments.graph_trainer.common_utils import (
    build_decoder_config_for_backend,
)
from torchtitan.models.llama3 import llama3_configs
from torchtitan.models.llama3 import model_registry as llama3_model_registry
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.models.common import neuron_decoder_config


def model_registry(flavor: str, attn_backend: str = "sdpa") -> ModelSpec:
    """Upstream's Llama 3 spec on SDPA with the prefix-cache RoPE switch."""
    spec = llama3_model_registry(flavor)
    # Upstream's get_attention_config refuses "sdpa" for language models;
    # graph_trainer's builder swaps it in per layer (SDPA ignores document
    # boundaries, see the README).
    config = build_decoder_config_for_backend(llama3_configs[flavor], attn_backend)
    return replace(spec, model=neuron_decoder_config(config, None))
