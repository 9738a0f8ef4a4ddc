"""Plain-FSDP GPT-OSS recipes for Neuron (torchtitan's Trainer, ``fully_shard``).

``gpt_oss_20b_neuron_tp2_fsdp32`` is the recipe the SimpleFSDP GPT-OSS
recipes derive from: the layout, SDPA sink attention, the expert-kernel
conversion and the expert load-balancing hook come from here. Its layout and
batch come from the memory planner (docs/gpt_oss.md).
"""

from torchtitan.models.gpt_oss.config_registry import (
    gpt_oss_20b,
    gpt_oss_120b,
    gpt_oss_debugmodel,
)
from torchtitan.trainer import Trainer

from torchtitan_neuron.components.experts import ExpertKernelConverter
from torchtitan_neuron.models.recipes import neuron_trainer_config
from torchtitan_neuron.trainer import NeuronTrainer

from . import model_registry


def _neuron_gpt_oss_config(
    base: Trainer.Config, *, tp: int, global_batch_size: int
) -> NeuronTrainer.Config:
    spec = model_registry(base.model_spec.flavor, converters=[ExpertKernelConverter.Config()])
    # Experts are sharded by TP and FSDP, not by expert parallelism (as the
    # DeepSeek recipes): the preflight refuses an EP degree here.
    base.parallelism.expert_parallel_degree = 1
    base.training.global_batch_size = global_batch_size
    return neuron_trainer_config(base, spec, tp=tp)


def cpu_rehearsal_gpt_oss_debugmodel() -> Trainer.Config:
    """Upstream's GPT-OSS debug recipe on the ``debugmodel_cpu`` flavor, at a
    sequence (256, four sliding windows of 64) and batch CPU ranks step
    through in seconds."""
    config = gpt_oss_debugmodel()
    config.model_spec = model_registry("debugmodel_cpu")
    config.training.seq_len = 256
    config.training.local_batch_size = 2
    return config


def gpt_oss_20b_neuron_tp2_fsdp32() -> NeuronTrainer.Config:
    # TP2 x FSDP32 on a trn2.48xlarge: 32 data-parallel ranks x local batch 1
    # = 32 sequences of 8192 a step, 64 by 2 accumulation steps. The planner
    # puts selective AC at 57% of a core's 24 GiB (docs/gpt_oss.md); TP2
    # halves TP4's activation all-reduces for 2.6 GiB more.
    return _neuron_gpt_oss_config(gpt_oss_20b(), tp=2, global_batch_size=64)


def gpt_oss_120b_neuron_tp8() -> NeuronTrainer.Config:
    # Two trn2.48xlarge: TP8 x FSDP16 on 128 NeuronCores, global batch 128
    # (8 accumulation steps). Planned, never run (docs/gpt_oss.md).
    return _neuron_gpt_oss_config(gpt_oss_120b(), tp=8, global_batch_size=128)


def gpt_oss_debugmodel_neuron_tp2_fsdp2() -> NeuronTrainer.Config:
    return _neuron_gpt_oss_config(
        cpu_rehearsal_gpt_oss_debugmodel(), tp=2, global_batch_size=4
    )
