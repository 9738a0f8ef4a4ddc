"""Plain-FSDP Llama 3 recipes for Neuron (torchtitan's Trainer, ``fully_shard``).

The eager recipes are the baseline SimpleFSDP is compared with; the
``_compiled`` ones add torch.compile on the ``neuron`` backend over the model,
the loss and gradient clipping.
"""

from collections.abc import Callable
from dataclasses import fields

from torchtitan.config import CompileConfig
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.trainer import Trainer

from torchtitan_neuron.trainer import NeuronTrainer

from . import model_registry


def _neuron_llama3_config(
    config_factory: Callable[[], Trainer.Config], *, compiled: bool = False
) -> NeuronTrainer.Config:
    base = config_factory()
    base.model_spec = model_registry(base.model_spec.flavor)
    for layer in base.model_spec.model.layers:
        layer.attention.rope.use_prefix_cache_for_positions = True
    if compiled:
        base.compile = CompileConfig(
            enable=True, components=["model", "loss", "grad_clip"], backend="neuron"
        )
    return NeuronTrainer.Config(**{f.name: getattr(base, f.name) for f in fields(base)})


def cpu_rehearsal_llama3_debugmodel() -> Trainer.Config:
    """Upstream's debug model (6 layers, dim 256, vocab 2048) at a sequence and
    batch a 2-core CPU steps through in seconds. Every debug recipe, plain and
    SimpleFSDP, starts here so they compare directly."""
    config = llama3_debugmodel()
    config.training.seq_len = 512
    config.training.local_batch_size = 4
    return config


def llama3_8b_neuron() -> NeuronTrainer.Config:
    return _neuron_llama3_config(llama3_8b)


def llama3_8b_neuron_compiled() -> NeuronTrainer.Config:
    return _neuron_llama3_config(llama3_8b, compiled=True)


def llama3_debugmodel_neuron() -> NeuronTrainer.Config:
    return _neuron_llama3_config(cpu_rehearsal_llama3_debugmodel)


def llama3_debugmodel_neuron_compiled() -> NeuronTrainer.Config:
    return _neuron_llama3_config(cpu_rehearsal_llama3_debugmodel, compiled=True)
