"""DeepSeek-V3 on SimpleFSDP, the Neuron JIT path (GraphTrainer recipes).

Select with ``--module torchtitan_neuron.experiments.graph_trainer.deepseek_v3``.
"""

from torchtitan.experiments.graph_trainer.deepseek_v3 import (
    model_registry as graph_trainer_model_registry,
)
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.components.model_config import neuron_spec
from torchtitan_neuron.components.moe import register_load_balancing_hook

from ..parallelize import parallelize_deepseekv3


def model_registry(
    flavor: str,
    attn_backend: str = "sdpa",
    converters: list[ModelConfigConverter.Config] | None = None,
) -> ModelSpec:
    """graph_trainer's DeepSeek-V3 spec with the prefix-cache RoPE switch
    available on every layer, count-once MoE layers, ``converters``, this
    project's parallelize function and its load-balancing hook."""
    return neuron_spec(
        graph_trainer_model_registry(flavor, attn_backend=attn_backend),
        converters,
        name="simple_fsdp/deepseek_v3",
        parallelize_fn=parallelize_deepseekv3,
        post_optimizer_build_fn=register_load_balancing_hook,
    )
