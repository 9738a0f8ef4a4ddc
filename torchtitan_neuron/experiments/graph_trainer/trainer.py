"""GraphTrainer for SimpleFSDP recipes on the Neuron JIT path, and its
compile settings.

``NeuronGraphTrainer`` is graph_trainer's ``GraphTrainer`` with this
package's trainer additions (``torchtitan_neuron.trainer.NeuronTrainerMixin``);
its config accepts only ``--compile.mode jit`` and checks the memory policy and
the bucket bound when it is parsed, before a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig
from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

from torchtitan_neuron.components.documents import ModelOptions
from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import (
    check_memory_policy,
)
from torchtitan_neuron.experiments.graph_trainer.bucketing import (
    DEFAULT_BUCKET_MIB,
    require_positive_bound,
)
from torchtitan_neuron.trainer import NeuronTrainerMixin, cuda_graphs_apply


@dataclass(kw_only=True, slots=True)
class NeuronCompileConfig(GraphTrainerCompileConfig):
    """GraphTrainer's compile settings in jit mode, with bucketing."""

    mode: str = "jit"

    memory_policy: Literal["default", "full", "eager", "sac_and_offload"] = "eager"
    """What selective activation checkpointing saves, in jit mode
    (experiments/graph_trainer/activation_checkpoint.py). eager (the
    default): torchtitan's SelectiveAC as the recipes name it, every second
    matmul recomputed. default: every op of torchtitan's save list, every
    matmul included, as graph_trainer's aot_fx_trace default does (more
    activation memory, less recomputation). full and sac_and_offload are graph
    passes of aot_fx_trace mode and are refused here: a _fullac recipe
    recomputes fully."""

    bucketing: bool = True
    """One all-gather per transformer block (and FSDP mesh) for all of its
    sharded parameters, and one reduce-scatter for their gradients, in the
    graph every compile backend receives (torchtitan_neuron/bucketing.py).
    --compile.no-bucketing gathers each parameter on its own, as upstream's
    SimpleFSDP does."""

    overlap_collectives: bool = False
    """With the inductor backend, inductor's compute/communication reordering
    (``torch._inductor.config.reorder_for_compute_comm_overlap`` with its
    ``sink_waits``, ``raise_comms`` and ``reorder_compute_for_overlap``
    passes): gathers start earlier and waits move later, holding gathered
    buckets longer. Other backends (``neuron``, ``aot_eager``) schedule their
    own graphs and ignore it (docs/benchmarks.md)."""

    prefetch: bool = True
    """With the inductor backend, an FX pass over the compiled forward and
    backward graphs (torchtitan_neuron/prefetch.py): each block's gather is
    issued while the block before it computes, and each gradient
    reduce-scatter is waited on only when the next one is issued. It holds
    one more block's gathered parameters. --compile.no-prefetch leaves the
    collectives where the graph puts them; other backends (``neuron``,
    ``aot_eager``) ignore it."""

    bucket_mib: int = DEFAULT_BUCKET_MIB
    """The largest bucket, in MiB of the wider of param and reduce dtype; a
    block whose parameters need more is gathered in several. 512 is the
    Neuron runtime's default scratchpad page, above which paged scratchpad
    allocates a tensor on its own."""


def require_jit_mode(compile_config) -> None:
    """SimpleFSDP on this path runs only in jit mode: refuse anything else."""
    mode = getattr(compile_config, "mode", "jit")
    if compile_config.enable and mode != "jit":
        raise ValueError(
            f"--compile.mode {mode} is not supported: jit is the only supported "
            "compile mode for SimpleFSDP on Neuron in this release. Remove the "
            "--compile.mode override (the recipe already sets mode=jit)."
        )


class NeuronGraphTrainer(NeuronTrainerMixin, GraphTrainer):
    """GraphTrainer for SimpleFSDP recipes on the Neuron JIT path."""

    @dataclass(kw_only=True, slots=True)
    class Config(GraphTrainer.Config):
        model: ModelOptions = field(default_factory=ModelOptions)
        compile: NeuronCompileConfig = field(default_factory=NeuronCompileConfig)

        def __post_init__(self):
            # zero-argument super() does not work in slots dataclasses.
            GraphTrainer.Config.__post_init__(self)
            require_jit_mode(self.compile)
            check_memory_policy(self.activation_checkpoint, self.compile.memory_policy)
            require_positive_bound(getattr(self.compile, "bucket_mib", DEFAULT_BUCKET_MIB))

        def _validate_cuda_graphs(self) -> None:
            if cuda_graphs_apply():
                GraphTrainer.Config._validate_cuda_graphs(self)
