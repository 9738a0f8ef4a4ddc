"""GPT-OSS on SimpleFSDP, the Neuron JIT path (GraphTrainer recipes).

Select with ``--module torchtitan_neuron.experiments.graph_trainer.gpt_oss``.
"""

from dataclasses import fields, replace

from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.models.gpt_oss import model_registry as plain_model_registry

from ..parallelize import parallelize_gpt_oss
from .model import GraphTrainerGptOssModel


def model_registry(flavor: str) -> ModelSpec:
    """The plain GPT-OSS spec (SDPA sink attention with shared masks,
    count-once MoE, the load-balancing hook) as a GraphTrainer model with
    this project's SimpleFSDP parallelize function.

    ``neuron_simple_fsdp`` takes the model class and functions from here; the
    model config itself comes from the plain recipe it converts.
    """
    spec = plain_model_registry(flavor)
    model = GraphTrainerGptOssModel.Config(
        **{f.name: getattr(spec.model, f.name) for f in fields(spec.model)}
    )
    return replace(
        spec, name="simple_fsdp/gpt_oss", model=model, parallelize_fn=parallelize_gpt_oss
    )
