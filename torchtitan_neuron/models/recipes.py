"""The shaping every plain (torchtitan Trainer) Neuron recipe shares."""

from dataclasses import fields

from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from torchtitan_neuron import platform
from torchtitan_neuron.data import layout_invariant
from torchtitan_neuron.trainer import NeuronTrainer, neuron_compile_config


def neuron_trainer_config(
    base: Trainer.Config,
    model_spec: ModelSpec,
    *,
    tp: int | None = None,
    compiled: bool = False,
) -> NeuronTrainer.Config:
    """``base`` on ``model_spec`` with the layout-invariant text loader, the
    prefix-cache rotary path, an optional
    pinned TP degree, and torch.compile on the ``neuron`` backend: over the
    model, the loss and gradient clipping if ``compiled``, else over whatever
    the base recipe already compiles."""
    base.model_spec = model_spec
    base.dataloader = layout_invariant(base.dataloader)
    # Neuron does not support the RoPE gather; use the prefix-cache positions path.
    for layer in model_spec.model.layers:
        layer.attention.rope.use_prefix_cache_for_positions = True
    if tp is not None:
        base.parallelism.tensor_parallel_degree = tp
    if compiled:
        base.compile = neuron_compile_config()
    elif base.compile.enable:
        # Whatever upstream compiles (e.g. DeepSeek's loss), compile it for Neuron.
        base.compile.backend = platform.NEURON_COMPILE_BACKEND
    return NeuronTrainer.Config(**{f.name: getattr(base, f.name) for f in fields(base)})
