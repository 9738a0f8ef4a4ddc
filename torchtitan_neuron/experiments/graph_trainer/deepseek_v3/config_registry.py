"""SimpleFSDP DeepSeek-V3 recipes for the Neuron JIT path.

They read like the Llama ones: each starts from an upstream recipe (or the
CPU rehearsal base), puts it on the Neuron DeepSeek layout the plain recipes
use (pinned TP, no expert parallelism), then takes the model from
``model_registry`` with the expert-kernel conversion, the prefix-cache rotary
path, the AC mode and torch.compile on the ``neuron`` backend over the model,
the loss and gradient clipping, and converts through ``neuron_simple_fsdp``
(jit mode).
"""

from collections.abc import Callable

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_16b
from torchtitan.trainer import Trainer

from torchtitan_neuron.components.experts import ExpertKernelConverter
from torchtitan_neuron.components.rope import use_prefix_cache_positions
from torchtitan_neuron.experiments.graph_trainer.configs import neuron_simple_fsdp
from torchtitan_neuron.models.deepseek_v3.config_registry import (
    cpu_rehearsal_deepseek_v3_debugmodel,
    neuron_deepseek_v3_layout,
)
from torchtitan_neuron.trainer import NeuronGraphTrainer, neuron_compile_config

from . import model_registry


def _neuron_simple_fsdp_deepseek_v3_config(
    config_factory: Callable[[], Trainer.Config],
    *,
    tp: int,
    global_batch_size: int,
    full_ac: bool = False,
    local_batch_size: int | None = None,
    seq_len: int | None = None,
) -> NeuronGraphTrainer.Config:
    base = neuron_deepseek_v3_layout(
        config_factory(), tp=tp, global_batch_size=global_batch_size
    )
    if local_batch_size is not None:
        base.training.local_batch_size = local_batch_size
    if seq_len is not None:
        base.training.seq_len = seq_len
    base.model_spec = model_registry(
        base.model_spec.flavor, attn_backend="sdpa", converters=[ExpertKernelConverter.Config()]
    )
    use_prefix_cache_positions(base.model_spec.model)
    base.activation_checkpoint = FullAC.Config() if full_ac else SelectiveAC.Config()
    base.compile = neuron_compile_config()
    return neuron_simple_fsdp(base, model_registry, model_name="simple_fsdp/deepseek_v3")


# The whole step is one graph whose activations stay live until backward:
# a local batch of 1 at seq 4096 (global 64 by 4 accumulation steps).
def simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_deepseek_v3_config(
        deepseek_v3_16b, tp=4, global_batch_size=64, local_batch_size=1, seq_len=4096
    )


def simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16_fac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_deepseek_v3_config(
        deepseek_v3_16b, tp=4, global_batch_size=64, local_batch_size=1, seq_len=4096,
        full_ac=True,
    )


def simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_deepseek_v3_config(
        cpu_rehearsal_deepseek_v3_debugmodel, tp=2, global_batch_size=4
    )


def simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2_fac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_deepseek_v3_config(
        cpu_rehearsal_deepseek_v3_debugmodel, tp=2, global_batch_size=4, full_ac=True
    )
