"""``neuron_simple_fsdp``: the one converter every SimpleFSDP recipe goes through.

It turns a base Trainer recipe into a GraphTrainer recipe whose compile
settings are the base's (``enable``, ``components``, ``backend``) with the mode
fixed to ``jit``, the only mode SimpleFSDP supports on Neuron in this release,
torchtitan's text loader replaced by the layout-invariant one
(``torchtitan_neuron.data``) with the same settings, and this project's
metrics processor and checkpoint manager (``trainer.neuron_components``).
"""

from collections.abc import Callable

from torchtitan.config import CompileConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.experiments.graph_trainer.chunked_loss import ChunkedLossWrapperWithParamGrads
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.experiments.graph_trainer.configs import to_graph_trainer_config
from torchtitan.experiments.graph_trainer.graph_pp.pipeline import graph_pipeline_llm
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from torchtitan_neuron.config_utils import promote
from torchtitan_neuron.data import layout_invariant
from torchtitan_neuron.experiments.graph_trainer.chunked_loss import SimpleFSDPChunkedLoss
from torchtitan_neuron.experiments.graph_trainer.trainer import (
    NeuronCompileConfig,
    NeuronGraphTrainer,
)
from torchtitan_neuron.trainer import neuron_compile_config, neuron_components


def neuron_simple_fsdp(
    base: Trainer.Config,
    model_registry: Callable[[str], ModelSpec],
    *,
    model_name: str,
) -> NeuronGraphTrainer.Config:
    """Convert ``base`` to a SimpleFSDP GraphTrainer recipe in jit mode."""
    compile_config: CompileConfig = base.compile
    # A base that is already a Neuron recipe carries this project's ``model``
    # options, which upstream's converter does not know: convert the Trainer
    # fields, then carry the options over.
    options = getattr(base, "model", None)
    if options is not None:
        base = promote(base, Trainer.Config, drop=["model"])
    graph_config = to_graph_trainer_config(base, model_registry)
    # to_graph_trainer_config replaces any AC with SelectiveAC because upstream
    # applies graph-level policies only in aot_fx_trace; in jit mode this
    # project applies the base recipe's own choice per block.
    graph_config.activation_checkpoint = base.activation_checkpoint
    graph_config.model_spec.name = model_name
    # graph_trainer's specs pipeline with GraphPP, which torchtitan 0.3.0 runs
    # only in aot_fx_trace mode. In jit mode the stages come from torchtitan's
    # own pipeline_llm, each stage through the spec's parallelize_fn (TP, AC,
    # SimpleFSDP, bucketing and compile, per stage). Row pp-jit-stages.
    if graph_config.model_spec.pipelining_fn is graph_pipeline_llm:
        graph_config.model_spec.pipelining_fn = pipeline_llm
    graph_config.dataloader = layout_invariant(graph_config.dataloader)
    # The same chunked loss, with lm_head gathered once per microbatch under SimpleFSDP.
    if type(graph_config.loss) is ChunkedLossWrapperWithParamGrads.Config:
        graph_config.loss = promote(graph_config.loss, SimpleFSDPChunkedLoss.Config)
    graph_config.compile = NeuronCompileConfig(
        enable=compile_config.enable,
        components=list(compile_config.components),
        backend=compile_config.backend,
        mode="jit",
    )
    config = promote(graph_config, NeuronGraphTrainer.Config)
    if options is not None:
        config.model = options
    neuron_components(config)
    return config


def simple_fsdp_from_plain(
    config_factory: Callable[[], Trainer.Config],
    model_registry: Callable[[str], ModelSpec],
    *,
    model_name: str,
    full_ac: bool = False,
    training: dict | None = None,
    parallelism: dict | None = None,
) -> NeuronGraphTrainer.Config:
    """A SimpleFSDP recipe derived from a plain Neuron recipe (its layout,
    expert-kernel conversion and load-balancing hook): selective or full AC,
    torch.compile on ``neuron`` over the model, the loss and gradient clipping,
    ``neuron_simple_fsdp``, then the ``training`` and ``parallelism`` fields
    given (a None value leaves the field as it is). What the DeepSeek and
    GPT-OSS SimpleFSDP recipes share."""
    base = config_factory()
    base.activation_checkpoint = FullAC.Config() if full_ac else SelectiveAC.Config()
    base.compile = neuron_compile_config()
    config = neuron_simple_fsdp(base, model_registry, model_name=model_name)
    for section, changes in ((config.training, training), (config.parallelism, parallelism)):
        for field_name, value in (changes or {}).items():
            if value is not None:
                setattr(section, field_name, value)
    return config
