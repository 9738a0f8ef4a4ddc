"""SimpleFSDP DeepSeek-V3 recipes for the Neuron JIT path.

Each derives from a plain Neuron recipe (TP layout, expert-kernel conversion,
load-balancing hook), turns on torch.compile on the ``neuron`` backend over the
model, the loss and gradient clipping, converts through ``neuron_simple_fsdp``
(jit mode), and then adjusts batch and sequence sizing.
"""

from collections.abc import Callable

from torchtitan.trainer import Trainer

from torchtitan_neuron.experiments.graph_trainer.configs import simple_fsdp_from_plain
from torchtitan_neuron.models.deepseek_v3.config_registry import (
    deepseek_v3_16b_neuron_tp4_fsdp16,
    deepseek_v3_debugmodel_neuron_tp2_fsdp2,
)
from torchtitan_neuron.experiments.graph_trainer.trainer import NeuronGraphTrainer

from . import model_registry


def _neuron_simple_fsdp_deepseek_v3_config(
    config_factory: Callable[[], Trainer.Config],
    *,
    full_ac: bool = False,
    local_batch_size: int | None = None,
    seq_len: int | None = None,
    global_batch_size: int | None = None,
    parallelism: dict | None = None,
) -> NeuronGraphTrainer.Config:
    return simple_fsdp_from_plain(
        config_factory, model_registry, model_name="simple_fsdp/deepseek_v3",
        full_ac=full_ac, parallelism=parallelism,
        training={"local_batch_size": local_batch_size, "seq_len": seq_len,
                  "global_batch_size": global_batch_size})


def simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16() -> NeuronGraphTrainer.Config:
    # The whole step is one graph whose activations stay live until backward:
    # a local batch of 1 at seq 4096 (global 64 by 4 accumulation steps).
    return _neuron_simple_fsdp_deepseek_v3_config(
        deepseek_v3_16b_neuron_tp4_fsdp16, local_batch_size=1, seq_len=4096
    )


def simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16_fac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_deepseek_v3_config(
        deepseek_v3_16b_neuron_tp4_fsdp16, full_ac=True, local_batch_size=1, seq_len=4096
    )


def simple_fsdp_deepseek_v3_16b_nki_tp4_ep4() -> NeuronGraphTrainer.Config:
    # Expert parallelism on one trn2.48xlarge: the TP4 x FSDP16 recipe with the
    # 64 routed experts split over the 4 TP ranks (16 whole experts per rank,
    # each sharded again over its 16-rank expert-FSDP group) in place of
    # slicing every expert 4 ways; tokens reach them by all-to-all inside the
    # compiled step, within each TP group. The lowest planned peak of the
    # one-node EP layouts (docs/parallelisms.md#deepseek-v3-16b-on-one-trn2-node).
    return _neuron_simple_fsdp_deepseek_v3_config(
        deepseek_v3_16b_neuron_tp4_fsdp16, local_batch_size=1, seq_len=4096,
        parallelism={"expert_parallel_degree": 4})


def simple_fsdp_deepseek_v3_debugmodel_nki_ep2() -> NeuronGraphTrainer.Config:
    # CPU flavor of the EP recipe: EP2 x FSDP on 4 ranks (FSDP 4, experts over
    # EP2 x expert-FSDP 2), local batch 2 x 4 ranks = global batch 8.
    return _neuron_simple_fsdp_deepseek_v3_config(
        deepseek_v3_debugmodel_neuron_tp2_fsdp2, global_batch_size=8,
        parallelism={"tensor_parallel_degree": 1, "expert_parallel_degree": 2})


def simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_deepseek_v3_config(deepseek_v3_debugmodel_neuron_tp2_fsdp2)


def simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2_fac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_deepseek_v3_config(
        deepseek_v3_debugmodel_neuron_tp2_fsdp2, full_ac=True
    )
