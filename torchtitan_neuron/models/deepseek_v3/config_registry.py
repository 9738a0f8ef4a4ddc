"""Plain-FSDP DeepSeek-V3 recipes for Neuron (torchtitan's Trainer).

``deepseek_v3_16b_neuron_tp4_fsdp16`` is the recipe the SimpleFSDP DeepSeek
recipes derive from: the TP4 layout, the expert-kernel conversion and the
expert load-balancing hook come from here.
"""

from torchtitan.models.deepseek_v3.config_registry import (
    deepseek_v3_16b,
    deepseek_v3_debugmodel,
)
from torchtitan.trainer import Trainer

from torchtitan_neuron.components.experts import ExpertKernelConverter
from torchtitan_neuron.models.recipes import neuron_trainer_config
from torchtitan_neuron.trainer import NeuronTrainer

from . import model_registry


def _neuron_deepseek_v3_config(
    base: Trainer.Config, *, tp: int, global_batch_size: int
) -> NeuronTrainer.Config:
    spec = model_registry(base.model_spec.flavor, converters=[ExpertKernelConverter.Config()])
    # Experts are sharded by TP and SimpleFSDP, not by expert parallelism.
    base.parallelism.expert_parallel_degree = 1
    base.training.global_batch_size = global_batch_size
    base.hf_assets_path = "./tests/assets/tokenizer"
    return neuron_trainer_config(base, spec, tp=tp)


def cpu_rehearsal_deepseek_v3_debugmodel() -> Trainer.Config:
    """Upstream's DeepSeek-V3 debug model (8 experts, top-3) at a sequence and
    batch 4 CPU ranks step through in seconds."""
    config = deepseek_v3_debugmodel()
    config.training.seq_len = 256
    config.training.local_batch_size = 2
    return config


def deepseek_v3_16b_neuron_tp4_fsdp16() -> NeuronTrainer.Config:
    # 16 data-parallel ranks x local batch 4 = 64 sequences: no accumulation.
    return _neuron_deepseek_v3_config(deepseek_v3_16b(), tp=4, global_batch_size=64)


def deepseek_v3_debugmodel_neuron_tp2_fsdp2() -> NeuronTrainer.Config:
    return _neuron_deepseek_v3_config(
        cpu_rehearsal_deepseek_v3_debugmodel(), tp=2, global_batch_size=4
    )
