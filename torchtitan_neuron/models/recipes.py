"""The shaping every plain (torchtitan Trainer) Neuron recipe shares."""

from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from torchtitan_neuron import devices
from torchtitan_neuron.components.rope import use_prefix_cache_positions
from torchtitan_neuron.config_utils import promote
from torchtitan_neuron.data import layout_invariant
from torchtitan_neuron.trainer import NeuronTrainer, neuron_compile_config, neuron_components


def neuron_trainer_config(
    base: Trainer.Config,
    model_spec: ModelSpec,
    *,
    tp: int | None = None,
    compiled: bool = False,
) -> NeuronTrainer.Config:
    """``base`` on ``model_spec`` with the layout-invariant text loader, the
    prefix-cache rotary path, an optional pinned TP degree, this project's
    metrics processor and checkpoint manager, and torch.compile on the
    ``neuron`` backend: over the model, the loss and gradient clipping if
    ``compiled``, else over whatever the base recipe already compiles."""
    base.model_spec = model_spec
    base.dataloader = layout_invariant(base.dataloader)
    use_prefix_cache_positions(model_spec.model)
    if tp is not None:
        base.parallelism.tensor_parallel_degree = tp
    if compiled:
        base.compile = neuron_compile_config()
    elif base.compile.enable:
        # Whatever upstream compiles (e.g. DeepSeek's loss), compile it for Neuron.
        base.compile.backend = devices.NEURON_COMPILE_BACKEND
    neuron_components(base)
    return promote(base, NeuronTrainer.Config)
