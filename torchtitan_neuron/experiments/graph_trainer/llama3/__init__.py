"""Llama 3 on SimpleFSDP, the Neuron JIT path (GraphTrainer recipes).

Select with ``--module torchtitan_neuron.experiments.graph_trainer.llama3``.
"""

from torchtitan.experiments.graph_trainer.llama3 import (
    model_registry as graph_trainer_model_registry,
)
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.components.model_config import neuron_spec

from ..parallelize import parallelize_llama


def model_registry(
    flavor: str,
    attn_backend: str = "sdpa",
    converters: list[ModelConfigConverter.Config] | None = None,
) -> ModelSpec:
    """graph_trainer's Llama 3 spec with the prefix-cache RoPE switch available
    on every layer and this project's parallelize function."""
    return neuron_spec(
        graph_trainer_model_registry(flavor, attn_backend=attn_backend),
        converters,
        name="simple_fsdp/llama3",
        parallelize_fn=parallelize_llama,
    )
