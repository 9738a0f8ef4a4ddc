"""SimpleFSDP Llama 3 recipes for the Neuron JIT path.

Each recipe starts from an upstream torchtitan recipe and adds the Neuron
pieces: SDPA attention, the prefix-cache rotary path, and torch.compile on the
``neuron`` backend over the model, the loss and gradient-norm clipping.
``neuron_simple_fsdp`` then makes it a SimpleFSDP GraphTrainer recipe in jit
mode. No recipe pins a parallelism degree: SimpleFSDP shards across every rank.
"""

from collections.abc import Callable

from torchtitan.config import CompileConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.llama3.config_registry import llama3_70b, llama3_8b
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.trainer import Trainer

from torchtitan_neuron.experiments.graph_trainer.configs import neuron_simple_fsdp
from torchtitan_neuron.models.llama3.config_registry import (
    cpu_rehearsal_llama3_debugmodel,
)
from torchtitan_neuron.experiments.graph_trainer.trainer import NeuronGraphTrainer

from . import model_registry


def _neuron_simple_fsdp_llama3_config(
    config_factory: Callable[[], Trainer.Config],
    *,
    full_ac: bool = False,
    converters: list[ModelConfigConverter.Config] | None = None,
) -> NeuronGraphTrainer.Config:
    base = config_factory()
    base.model_spec = model_registry(
        base.model_spec.flavor, attn_backend="sdpa", converters=converters
    )
    # Neuron does not support the RoPE gather; use the prefix-cache positions path.
    for layer in base.model_spec.model.layers:
        layer.attention.rope.use_prefix_cache_for_positions = True
    base.activation_checkpoint = FullAC.Config() if full_ac else SelectiveAC.Config()
    base.compile = CompileConfig(
        enable=True,
        components=["model", "loss", "grad_clip"],
        backend="neuron",
    )
    config = neuron_simple_fsdp(base, model_registry, model_name="simple_fsdp/llama3")
    return config


def simple_fsdp_llama3_8b() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_llama3_config(llama3_8b)


def simple_fsdp_llama3_8b_fullac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_llama3_config(llama3_8b, full_ac=True)


def simple_fsdp_llama3_70b_fullac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_llama3_config(llama3_70b, full_ac=True)


def simple_fsdp_llama3_debugmodel() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_llama3_config(cpu_rehearsal_llama3_debugmodel)


def simple_fsdp_llama3_debugmodel_fullac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_llama3_config(cpu_rehearsal_llama3_debugmodel, full_ac=True)
