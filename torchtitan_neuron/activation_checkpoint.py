"""Activation checkpointing and reshard-after-forward for SimpleFSDP in jit mode.

graph_trainer's ``parallelize_llama`` ignores ``ac_config`` in jit mode, so full
and selective AC silently do nothing there. This module applies them for real,
per transformer block, with torchtitan's own ``FullAC`` / ``SelectiveAC``.

SimpleFSDP gathers each parameter inside the traced graph (the parametrization
``ReplicateComputation``). Whether the gathered copy lives until backward is a
save/recompute decision of the compiler's partitioner, not a module property:
if it is saved, every rank holds the whole model and FSDP saves nothing. So
resharding after forward is expressed as recomputation:

- full AC recomputes the whole block, the gathers included;
- selective AC's save list (``_get_default_save_ops``) does not contain
  ``all_gather_into_tensor``, so gathers are recomputed;
- with no AC, each parameter's gather is wrapped in its own checkpoint
  region, so only the gather (and its dtype cast) is recomputed in backward.
"""

from __future__ import annotations

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from torchtitan.tools.logging import logger

_RESHARD_MARK = "_torchtitan_neuron_reshard"


def _recompute_in_backward(fget):
    def gathered_parameter(module):
        # Only the checkpointed function's output would be saved, and
        # non-reentrant checkpoint saves nothing but the sharded input: the
        # gathered parameter is rebuilt when backward needs it.
        return checkpoint(fget, module, use_reentrant=False, preserve_rng_state=False)

    setattr(gathered_parameter, _RESHARD_MARK, True)
    return gathered_parameter


def reshard_after_forward(model: nn.Module) -> int:
    """Make every SimpleFSDP parameter gather recomputed in backward.

    SimpleFSDP installs one property per parameter on a generated
    ``SimpleFSDP<Module>`` class. Each property getter is wrapped in a
    checkpoint, once (classes are shared between models, so this is
    idempotent). Returns the number of getters wrapped now.
    """
    wrapped = 0
    for cls in {type(m) for m in model.modules()}:
        if not cls.__name__.startswith("SimpleFSDP"):
            continue
        for name, attr in list(vars(cls).items()):
            if not isinstance(attr, property) or getattr(attr.fget, _RESHARD_MARK, False):
                continue
            setattr(cls, name, property(_recompute_in_backward(attr.fget)))
            wrapped += 1
    return wrapped


def apply_activation_checkpointing(model: nn.Module, ac_config, dump_folder: str) -> None:
    """Apply full or selective AC per transformer block (None: no block AC)."""
    if ac_config is None:
        logger.info("Activation checkpointing: none (parameter gathers still recomputed)")
        return
    ac_config.build(dump_folder=dump_folder).apply(model)
