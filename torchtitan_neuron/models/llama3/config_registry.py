"""Plain-FSDP Llama 3 recipes for Neuron (torchtitan's Trainer, ``fully_shard``).

The eager recipes are the baseline SimpleFSDP is compared with; ``_compiled``
adds torch.compile on the ``neuron`` backend. ``llama3_8b_tp4_fsdp16_sac`` is
the Llama counterpart of the basic tutorial's ``qwen3_8b_tp4_fsdp16_sac``.
"""

from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.trainer import Trainer

from torchtitan_neuron.models.recipes import neuron_trainer_config
from torchtitan_neuron.trainer import NeuronTrainer

from . import model_registry


def cpu_rehearsal_llama3_debugmodel() -> Trainer.Config:
    """Upstream's debug model (6 layers, dim 256, vocab 2048) at a sequence and
    batch a 2-core CPU steps through in seconds. Every Llama debug recipe,
    plain and SimpleFSDP, starts here so they compare directly."""
    config = llama3_debugmodel()
    config.training.seq_len = 512
    config.training.local_batch_size = 4
    return config


def _llama3(base: Trainer.Config, **kwargs) -> NeuronTrainer.Config:
    return neuron_trainer_config(base, model_registry(base.model_spec.flavor), **kwargs)


def _sac(base: Trainer.Config) -> Trainer.Config:
    base.activation_checkpoint = SelectiveAC.Config()
    return base


def llama3_8b_neuron() -> NeuronTrainer.Config:
    return _llama3(llama3_8b())


def llama3_debugmodel_neuron() -> NeuronTrainer.Config:
    return _llama3(cpu_rehearsal_llama3_debugmodel())


def llama3_8b_neuron_compiled() -> NeuronTrainer.Config:
    return _llama3(llama3_8b(), compiled=True)


def llama3_debugmodel_neuron_compiled() -> NeuronTrainer.Config:
    return _llama3(cpu_rehearsal_llama3_debugmodel(), compiled=True)


def llama3_8b_tp4_fsdp16_sac() -> NeuronTrainer.Config:
    return _llama3(_sac(llama3_8b()), tp=4)


def llama3_debugmodel_tp2_fsdp2_sac() -> NeuronTrainer.Config:
    return _llama3(_sac(cpu_rehearsal_llama3_debugmodel()), tp=2)
