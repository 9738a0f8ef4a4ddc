"""Qwen3 on torchtitan's plain Trainer, with the Neuron model pieces.

Select with ``--module torchtitan_neuron.models.qwen3``.
"""

from torchtitan.models.qwen3 import model_registry as qwen3_model_registry
from torchtitan.models.qwen3 import qwen3_configs
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.components.model_config import neuron_model_spec


def model_registry(flavor: str, attn_backend: str = "sdpa") -> ModelSpec:
    """Upstream's Qwen3 spec on SDPA with the prefix-cache RoPE switch."""
    return neuron_model_spec(
        qwen3_model_registry, qwen3_configs, flavor, attn_backend=attn_backend
    )
