"""A medium Llama 3 for the CPU benchmarks: between the debug model and 1B.

The debug model (6 layers, dim 256, 6.2 M parameters) is activation-bound at
any useful sequence length; this one (8 layers, dim 768, 2048-token vocab,
about 58 M parameters) gives parameters, gradients and optimizer state a
real share of the memory while one step still runs in seconds on a 2-core
CPU. Select with ``--module scripts.bench_recipes`` from the repository root.
"""

from dataclasses import dataclass, replace

import torchtitan.models.llama3 as upstream
from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

from torchtitan_neuron.experiments.graph_trainer.llama3.config_registry import (
    _neuron_simple_fsdp_llama3_config,
)
from torchtitan_neuron.models.llama3.config_registry import (
    cpu_rehearsal_llama3_debugmodel,
)
from torchtitan_neuron.config_utils import promote
from torchtitan_neuron.data import layout_invariant
from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import save_attention
from torchtitan_neuron.experiments.graph_trainer.trainer import NeuronGraphTrainer
from torchtitan_neuron.seeded_init import layout_invariant_init
from torchtitan_neuron.trainer import NeuronTrainer

MEDIUM = "bench_medium"


def _medium(attn_backend: str, tp_gemm_backend: str = "default"):
    dim, n_heads, n_layers, vocab = 768, 12, 8, 2048
    return upstream.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=upstream.Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=upstream._EMBEDDING_INIT
        ),
        norm=upstream.RMSNorm.Config(normalized_shape=dim, param_init=upstream._NORM_INIT),
        lm_head=upstream.Linear.Config(
            in_features=dim, out_features=vocab,
            param_init=upstream._output_linear_init(dim),
        ),
        layers=upstream._build_llama3_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads,
            hidden_dim=upstream.compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=upstream.ComplexRoPE.Config(
                dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"
            ),
            attn_backend=attn_backend, tp_gemm_backend=tp_gemm_backend,
        ),
    )


upstream.llama3_configs.setdefault(MEDIUM, _medium)


def _medium_base():
    config = cpu_rehearsal_llama3_debugmodel()
    config.model_spec = replace(config.model_spec, flavor=MEDIUM)
    return config


def simple_fsdp_llama3_medium() -> NeuronGraphTrainer.Config:
    return _neuron_simple_fsdp_llama3_config(_medium_base)


# The peers `make bench` runs the same models under (scripts/bench.py):
# torchtitan's FSDP2 Trainer, eager and compiled per block, and upstream's
# GraphTrainer in its aot_fx_trace mode. Each starts from the same CPU
# rehearsal base as the SimpleFSDP recipe, with SDPA attention (FlexAttention
# has no backward on CPU in torch 2.14), the same initial weights and the same
# batches, so every cell's step-1 loss is the same.


class FSDP2Peer(NeuronTrainer):
    """The FSDP2 peer: selective AC saves CPU attention, as the SimpleFSDP
    recipes' does (``save_attention``), so both do the same work under it."""

    @dataclass(kw_only=True, slots=True)
    class Config(NeuronTrainer.Config):
        pass

    def _prepare(self, config) -> None:
        config.activation_checkpoint = save_attention(config.activation_checkpoint)
        super()._prepare(config)


class SeededGraphTrainer(GraphTrainer):
    """Upstream's GraphTrainer as it is, with this project's initial weights:
    each parameter drawn from the seed whatever the layout
    (torchtitan_neuron.seeded_init), as every Neuron recipe's are."""

    @dataclass(kw_only=True, slots=True)
    class Config(GraphTrainer.Config):
        pass

    def __init__(self, config):
        with layout_invariant_init(config.debug.seed):
            super().__init__(config)


def llama3_debugmodel_fsdp2() -> FSDP2Peer.Config:
    from torchtitan_neuron.models.llama3 import model_registry
    from torchtitan_neuron.models.recipes import neuron_trainer_config

    base = cpu_rehearsal_llama3_debugmodel()
    return promote(neuron_trainer_config(base, model_registry(base.model_spec.flavor)),
                   FSDP2Peer.Config)


def llama3_medium_fsdp2() -> FSDP2Peer.Config:
    from torchtitan_neuron.models.llama3 import model_registry
    from torchtitan_neuron.models.recipes import neuron_trainer_config

    return promote(neuron_trainer_config(_medium_base(), model_registry(MEDIUM)),
                   FSDP2Peer.Config)


def deepseek_v3_debugmodel_fsdp2() -> FSDP2Peer.Config:
    from torchtitan_neuron.models.deepseek_v3.config_registry import (
        deepseek_v3_debugmodel_neuron_tp2_fsdp2,
    )

    config = promote(deepseek_v3_debugmodel_neuron_tp2_fsdp2(), FSDP2Peer.Config)
    config.parallelism.tensor_parallel_degree = 1
    return config


def _graph_trainer(base, registry, flavor: str):
    from torchtitan.experiments.graph_trainer.configs import (
        GraphTrainerCompileConfig,
        to_graph_trainer_config,
    )

    base.model_spec = registry(flavor, attn_backend="sdpa")
    base.dataloader = layout_invariant(base.dataloader)
    config = to_graph_trainer_config(base, registry)
    config.compile = GraphTrainerCompileConfig(enable=True, mode="aot_fx_trace")
    return promote(config, SeededGraphTrainer.Config)


def graph_trainer_llama3_debugmodel_cpu():
    from torchtitan.experiments.graph_trainer.llama3 import model_registry

    return _graph_trainer(cpu_rehearsal_llama3_debugmodel(), model_registry, "debugmodel")


def graph_trainer_llama3_medium():
    from torchtitan.experiments.graph_trainer.llama3 import model_registry

    return _graph_trainer(cpu_rehearsal_llama3_debugmodel(), model_registry, MEDIUM)


def graph_trainer_deepseek_v3_debugmodel_cpu():
    from torchtitan.experiments.graph_trainer.deepseek_v3 import model_registry

    from torchtitan_neuron.models.deepseek_v3.config_registry import (
        cpu_rehearsal_deepseek_v3_debugmodel,
    )

    base = cpu_rehearsal_deepseek_v3_debugmodel()
    base.parallelism.expert_parallel_degree = 1
    return _graph_trainer(base, model_registry, "debugmodel")
