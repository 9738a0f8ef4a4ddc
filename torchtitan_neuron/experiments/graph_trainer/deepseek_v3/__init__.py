"""DeepSeek-V3 on SimpleFSDP, the Neuron JIT path (GraphTrainer recipes).

Select with ``--module torchtitan_neuron.experiments.graph_trainer.deepseek_v3``.
"""

from dataclasses import replace

from torchtitan.experiments.graph_trainer.deepseek_v3 import (
    model_registry as graph_trainer_model_registry,
)
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.components.moe import register_load_balancing_hook

from ..parallelize import parallelize_deepseekv3


def model_registry(flavor: str) -> ModelSpec:
    """graph_trainer's DeepSeek-V3 spec with this project's parallelize function.

    ``neuron_simple_fsdp`` takes only the model class and functions from here;
    the model config itself comes from the plain recipe it converts.
    """
    spec = graph_trainer_model_registry(flavor)
    return replace(
        spec,
        name="simple_fsdp/deepseek_v3",
        parallelize_fn=parallelize_deepseekv3,
        post_optimizer_build_fn=register_load_balancing_hook,
    )
