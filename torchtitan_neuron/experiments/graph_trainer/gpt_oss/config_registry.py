"""SimpleFSDP GPT-OSS recipes for the Neuron JIT path.

Each derives from a plain Neuron recipe (layout, SDPA sink attention,
expert-kernel conversion, load-balancing hook), turns on torch.compile on the
``neuron`` backend over the model, the loss and gradient clipping, converts
through ``neuron_simple_fsdp`` (jit mode), and then sets the layout and batch,
as the DeepSeek SimpleFSDP recipes do.
"""

from collections.abc import Callable

from torchtitan.trainer import Trainer

from torchtitan_neuron.experiments.graph_trainer.configs import simple_fsdp_from_plain
from torchtitan_neuron.models.gpt_oss.config_registry import (
    gpt_oss_20b_neuron_tp2_fsdp32,
    gpt_oss_120b_neuron_tp8,
    gpt_oss_debugmodel_neuron_tp2_fsdp2,
)
from torchtitan_neuron.experiments.graph_trainer.trainer import NeuronGraphTrainer

from . import model_registry


def _neuron_simple_fsdp_gpt_oss_config(
    config_factory: Callable[[], Trainer.Config],
    *,
    full_ac: bool = False,
    tp: int | None = None,
    ep: int | None = None,
    global_batch_size: int | None = None,
    free_gradients: bool | None = None,
) -> NeuronGraphTrainer.Config:
    # free_gradients: zero_grad sets the gradients to None
    # (torchtitan's training.disable_cuda_graphs; no CUDA graph is captured
    # off CUDA either way), so a step without accumulation holds only the
    # gradients its backward returns, not those beside the last step's.
    return simple_fsdp_from_plain(
        config_factory, model_registry, model_name="simple_fsdp/gpt_oss", full_ac=full_ac,
        training={"global_batch_size": global_batch_size,
                  "disable_cuda_graphs": free_gradients},
        parallelism={"tensor_parallel_degree": tp, "expert_parallel_degree": ep})


def simple_fsdp_gpt_oss_20b() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_gpt_oss_config(gpt_oss_20b_neuron_tp2_fsdp32)


def simple_fsdp_gpt_oss_20b_fullac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_gpt_oss_config(gpt_oss_20b_neuron_tp2_fsdp32, full_ac=True)


def simple_fsdp_gpt_oss_120b_fullac() -> NeuronGraphTrainer.Config:
    # Planned only: TP8 x FSDP16 on two trn2.48xlarge (docs/gpt_oss.md).
    return _neuron_simple_fsdp_gpt_oss_config(gpt_oss_120b_neuron_tp8, full_ac=True)


def simple_fsdp_gpt_oss_120b_ep8() -> NeuronGraphTrainer.Config:
    # Two trn2.48xlarge: TP8 x EP8 x FSDP16, the 128 experts split 8 ways over
    # the TP ranks (16 per rank, each sharded again over its 16-rank
    # expert-FSDP group). Global batch 16 (one sequence per FSDP rank, no
    # accumulation) with the gradients freed each step: planned at 74% of a
    # core, where accumulating to 128 holds a second copy of the gradients
    # at the end of each backward (89%; docs/parallelisms.md#gpt-oss-120b).
    return _neuron_simple_fsdp_gpt_oss_config(
        gpt_oss_120b_neuron_tp8, full_ac=True, ep=8, global_batch_size=16,
        free_gradients=True)


def simple_fsdp_gpt_oss_debugmodel() -> NeuronGraphTrainer.Config:
    # FSDP only: 2 CPU ranks x local batch 2.
    return _neuron_simple_fsdp_gpt_oss_config(
        gpt_oss_debugmodel_neuron_tp2_fsdp2, tp=1, global_batch_size=4
    )


def simple_fsdp_gpt_oss_debugmodel_fullac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_gpt_oss_config(
        gpt_oss_debugmodel_neuron_tp2_fsdp2, full_ac=True, tp=1, global_batch_size=4
    )


def simple_fsdp_gpt_oss_debugmodel_tp2_fsdp2() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_gpt_oss_config(gpt_oss_debugmodel_neuron_tp2_fsdp2)


def simple_fsdp_gpt_oss_debugmodel_tp2_ep2() -> NeuronGraphTrainer.Config:
    # CPU flavor of the EP recipe: TP2 x EP2 x FSDP2 on 4 ranks.
    return _neuron_simple_fsdp_gpt_oss_config(gpt_oss_debugmodel_neuron_tp2_fsdp2, ep=2)
