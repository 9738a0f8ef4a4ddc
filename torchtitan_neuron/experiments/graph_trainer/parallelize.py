"""SimpleFSDP parallelization for the Neuron JIT path (Llama, DeepSeek, GPT-OSS).

Upstream's graph_trainer ``parallelize_llama`` / ``parallelize_deepseekv3`` in
0.3.0 apply TP (and EP), SimpleFSDP and compile but ignore ``ac_config``. This
is the same sequence, built from upstream's pieces, with activation
checkpointing and reshard-after-forward applied between TP and SimpleFSDP.
"""

from collections.abc import Callable

from torchtitan.experiments.graph_trainer.common_utils import (
    annotate_module_fqns,
    annotate_moe_ep_regions,
    apply_cp_to_attention,
    apply_simple_fsdp,
)
from torchtitan.experiments.graph_trainer.compile import apply_compile
from torchtitan.experiments.graph_trainer.deepseek_v3.parallelize import (
    annotate_deepseekv3,
)
from torchtitan.experiments.graph_trainer.llama3.parallelize import annotate_llama

from torchtitan_neuron.activation_checkpoint import (
    apply_activation_checkpointing,
    reshard_after_forward,
)


def parallelize_simple_fsdp(
    model,
    *,
    annotate: Callable,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder: str,
):
    """TP/EP, then activation checkpointing, then SimpleFSDP, then torch.compile."""
    if training.seq_len % parallel_dims.seq_len_divisor != 0:
        raise ValueError(
            f"--training.seq_len {training.seq_len} must be divisible by "
            f"{parallel_dims.seq_len_divisor} (TP degree {parallel_dims.tp} x "
            f"2 x CP degree {parallel_dims.cp}); change the sequence length or "
            "the parallel degrees"
        )
    if parallel_dims.cp_enabled:
        apply_cp_to_attention(model, parallel_dims)
    # Annotate before AC wraps the blocks, so FX nodes carry clean module FQNs.
    annotate(model)
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    apply_activation_checkpointing(model, ac_config, dump_folder)
    model = apply_simple_fsdp(model, parallel_dims=parallel_dims, training=training)
    reshard_after_forward(model)
    return apply_compile(
        model,
        compile_config=compile_config,
        parallelism=parallelism,
        parallel_dims=parallel_dims,
        dump_folder=dump_folder,
    )


def parallelize_llama(model, **kwargs):
    return parallelize_simple_fsdp(model, annotate=annotate_llama, **kwargs)


def parallelize_deepseekv3(model, **kwargs):
    return parallelize_simple_fsdp(model, annotate=annotate_deepseekv3, **kwargs)


def annotate_gpt_oss(model) -> None:
    """graph_trainer has no GPT-OSS recipe; these are the annotations its
    ``annotate_deepseekv3`` attaches to an MoE decoder: the MoE dispatch,
    combine and compute regions, and every submodule's FQN."""
    annotate_moe_ep_regions()
    annotate_module_fqns(model)


def parallelize_gpt_oss(model, **kwargs):
    return parallelize_simple_fsdp(model, annotate=annotate_gpt_oss, **kwargs)
