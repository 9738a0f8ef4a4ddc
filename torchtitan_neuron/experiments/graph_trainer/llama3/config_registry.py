"""SimpleFSDP Llama 3 recipes for the Neuron JIT path.

Each recipe starts from an upstream torchtitan recipe and adds the Neuron
pieces: SDPA attention, the prefix-cache rotary path, and torch.compile on the
``neuron`` backend over the model, the loss and gradient-norm clipping.
``neuron_simple_fsdp`` then makes it a SimpleFSDP GraphTrainer recipe in jit
mode. SimpleFSDP shards across every rank; only the long-sequence and the
pipelined recipes pin a degree, their context or pipeline parallelism.
"""

from collections.abc import Callable

from torchtitan.components.lora import LoRAConverter
from torchtitan.components.optimizer import default_adamw
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


def simple_fsdp_llama3_8b_cp4_32k() -> NeuronGraphTrainer.Config:
    """Llama 3.1 8B on sequences of 32768 tokens, one trn2 node (64 ranks):
    context parallelism 4 x FSDP 16, full AC, one sequence per rank.

    The planner (docs/parallelisms.md has the table) puts CP2 at 77% of a
    core, and over it without the contiguous scratchpad; CP4 is the smallest
    degree that fits in both scratchpad modes with more than 15% headroom.
    Each CP rank holds 8192 of a sequence's tokens and gathers the keys and
    values of all 32768 in every layer."""
    config = _neuron_simple_fsdp_llama3_config(llama3_8b, full_ac=True)
    config.training.seq_len = 32768
    config.training.local_batch_size = 1
    config.parallelism.context_parallel_degree = 4
    return config


def simple_fsdp_llama3_70b_tp8_fsdp16() -> NeuronGraphTrainer.Config:
    """Llama 3.1 70B on two trn2 nodes (NGPU=64 x NNODES=2): upstream's TP 8,
    FSDP 16 over the rest, full AC, local batch 2, global batch 128 (4
    accumulation steps).

    The planner (docs/parallelisms.md has the table): one node OOMs even at
    local batch 1 (111% of a core); on two, TP8 x FSDP16 at local batch 2
    plans at 65% in both scratchpad modes, TP4 x FSDP32 at local batch 1 at
    66%, local batch 1 at TP8 at 59%. Local batch 2 is the largest that keeps
    more than 15% headroom, for fewer, larger microbatches."""
    config = _neuron_simple_fsdp_llama3_config(llama3_70b, full_ac=True)
    config.training.local_batch_size = 2
    config.training.global_batch_size = 128
    return config


def simple_fsdp_llama3_debugmodel() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_llama3_config(cpu_rehearsal_llama3_debugmodel)


def simple_fsdp_llama3_debugmodel_fullac() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_llama3_config(cpu_rehearsal_llama3_debugmodel, full_ac=True)


def simple_fsdp_llama3_debugmodel_cp2() -> NeuronGraphTrainer.Config:
    """The CPU flavor of ``simple_fsdp_llama3_8b_cp4_32k``: the debug model
    with context parallelism 2 (NGPU=2: CP2; NGPU=4: CP2 x FSDP2)."""
    config = _neuron_simple_fsdp_llama3_config(cpu_rehearsal_llama3_debugmodel)
    config.parallelism.context_parallel_degree = 2
    return config


def simple_fsdp_llama3_debugmodel_pp2() -> NeuronGraphTrainer.Config:
    """The debug model in 2 pipeline stages of 2 virtual stages each
    (torchtitan's default Interleaved1F1B, 4 microbatches of 1):
    NGPU=4 is PP2 x FSDP2. Only the last stage's ranks see the loss:
    LOG_RANK=2 shows it."""
    config = _neuron_simple_fsdp_llama3_config(cpu_rehearsal_llama3_debugmodel)
    config.parallelism.pipeline_parallel_degree = 2
    return config


def _sft(config: NeuronGraphTrainer.Config) -> NeuronGraphTrainer.Config:
    """Supervised fine-tuning on chat data: the bundled chat set (one user turn,
    one assistant turn; only the assistant's tokens in the loss), each
    conversation its own document (block-causal attention, never split
    between sequences), the validator on its held-out 1/20."""
    config.dataloader.dataset = "chat_test"
    config.dataloader.dataset_path = None
    config.model.attn_mask_type = "block_causal"
    config.validator.enable = True
    config.validator.freq = 5
    config.validator.steps = 1
    return config


def simple_fsdp_llama3_debugmodel_sft() -> NeuronGraphTrainer.Config:
    """The CPU flavor of ``simple_fsdp_llama3_8b_sft``: the debug model (from
    its seeded initialisation: no released weights exist for it) on the
    bundled chat set, 20 steps, with the bundled tokenizer."""
    config = _sft(_neuron_simple_fsdp_llama3_config(cpu_rehearsal_llama3_debugmodel))
    config.hf_assets_path = "./tests/assets/tokenizer"
    config.training.seq_len = 256
    config.training.steps = 20
    return config


def simple_fsdp_llama3_8b_sft() -> NeuronGraphTrainer.Config:
    """Full fine-tuning of Llama 3.1 8B from its Hugging Face weights
    (``hf_assets_path``, read with ``--checkpoint.initial_load_in_hf``) on
    chat data, full AC: the bundled chat set unless ``--dataloader.dataset
    chat --dataloader.dataset_path <folder>`` names your own."""
    return _from_hf_weights(_sft(_neuron_simple_fsdp_llama3_config(llama3_8b, full_ac=True)),
                            lr=2e-5)


def _from_hf_weights(config: NeuronGraphTrainer.Config, lr: float) -> NeuronGraphTrainer.Config:
    """An 8B fine-tuning run: the Hugging Face weights of ``hf_assets_path``
    loaded at step 0, seq 2048, 500 steps at ``lr`` after 20 of warmup."""
    config.checkpoint.enable = True
    config.checkpoint.initial_load_in_hf = True
    config.training.seq_len = 2048
    config.training.steps = 500
    config.optimizer = default_adamw(lr=lr)
    config.lr_scheduler.warmup_steps = 20
    return config


# LoRA on the attention (fused wqkv, wo) and MLP projections (torchtitan's LoRAConverter):
# every other weight frozen; rank 8, alpha 16.
LORA_TARGETS = ["wqkv", "wo", "w1", "w2", "w3"]


def _lora() -> list[ModelConfigConverter.Config]:
    return [LoRAConverter.Config(rank=8, alpha=16.0, target_modules=list(LORA_TARGETS))]


def simple_fsdp_llama3_debugmodel_lora() -> NeuronGraphTrainer.Config:
    """The CPU flavor of ``simple_fsdp_llama3_8b_lora``: the debug model's
    SFT recipe with LoRA adapters, the base frozen."""
    config = _sft(_neuron_simple_fsdp_llama3_config(cpu_rehearsal_llama3_debugmodel,
                                                    converters=_lora()))
    config.hf_assets_path = "./tests/assets/tokenizer"
    config.training.seq_len = 256
    config.training.steps = 20
    config.optimizer = default_adamw(lr=4e-3)
    return config


def simple_fsdp_llama3_8b_lora() -> NeuronGraphTrainer.Config:
    """LoRA fine-tuning of Llama 3.1 8B from its Hugging Face weights on chat
    data: adapters of rank 8 on the attention and MLP projections, the base
    frozen (gathered for compute, never reduce-scattered, no optimizer
    state); full AC."""
    return _from_hf_weights(_sft(_neuron_simple_fsdp_llama3_config(
        llama3_8b, full_ac=True, converters=_lora())), lr=2e-4)
