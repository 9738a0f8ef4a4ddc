"""Llama 3 on torchtitan's plain Trainer (FSDP2), with the Neuron model pieces.

Select with ``--module torchtitan_neuron.models.llama3``.
"""

from torchtitan.models.llama3 import llama3_configs
from torchtitan.models.llama3 import model_registry as llama3_model_registry
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.components.model_config import neuron_model_spec


def model_registry(flavor: str, attn_backend: str = "sdpa") -> ModelSpec:
    """Upstream's Llama 3 spec on SDPA with the prefix-cache RoPE switch."""
    return neuron_model_spec(
        llama3_model_registry, llama3_configs, flavor, attn_backend=attn_backend
    )
