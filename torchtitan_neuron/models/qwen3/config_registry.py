"""Plain-FSDP Qwen3 recipes for Neuron, from the basic tutorial.

``qwen3_8b_tp4_fsdp16_sac`` runs TP4 x FSDP16 (on 64 NeuronCores) in eager
mode with selective AC. torchtitan 0.3.0 has no plain Qwen3 8B pretraining
recipe, so it starts from upstream's ``qwen3_14b`` (C4, AdamW, schedule) on
the 8B model.
"""

from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.qwen3.config_registry import qwen3_14b, qwen3_debugmodel
from torchtitan.trainer import Trainer

from torchtitan_neuron.models.recipes import neuron_trainer_config
from torchtitan_neuron.trainer import NeuronTrainer

from . import model_registry


def _tp_sac(base: Trainer.Config, flavor: str, tp: int) -> NeuronTrainer.Config:
    base.activation_checkpoint = SelectiveAC.Config()
    return neuron_trainer_config(base, model_registry(flavor), tp=tp)


def qwen3_8b_tp4_fsdp16_sac() -> NeuronTrainer.Config:
    base = qwen3_14b()
    base.hf_assets_path = "./assets/hf/Qwen3-8B"
    base.training.local_batch_size = 1
    return _tp_sac(base, "8B", tp=4)


def qwen3_debugmodel_tp2_fsdp2_sac() -> NeuronTrainer.Config:
    """The tiny CPU flavor: 4 ranks as TP2 x FSDP2."""
    base = qwen3_debugmodel()
    base.training.seq_len = 256
    base.training.local_batch_size = 2
    return _tp_sac(base, "debugmodel", tp=2)
