"""Checkpoints are written under a temporary name and renamed when complete.

torchtitan 0.3.0 writes ``<folder>/step-N`` in place. A run stopped part-way
through a save (Ctrl-C, a crash, a lost node) leaves a ``step-N`` folder
with some shards and no ``.metadata``. torchtitan's own loader skips such a
folder, but a person, a copy script or an export reading ``step-N`` cannot
tell it from a good one, and its purge counts it as a checkpoint.

``NeuronCheckpointManager``, torchtitan's ``CheckpointManager`` that every
recipe's config names (``config.checkpoint``), makes every save write to
``<folder>/.partial-N`` and rename it to ``step-N`` once every rank's
shards and the metadata are written: after the save returns (synchronous
saves, and the last-step and Hugging Face exports), or when the upload
future completes (``--checkpoint.async_mode async``). ``.partial-N`` never
matches torchtitan's ``step-(\\d+)`` pattern, so it is never loaded or
purged as a checkpoint; a leftover one is reported and replaced by the next
save of that step. Remote folders (``s3://``...) keep torchtitan's
behaviour: there, ``.metadata`` written last is the completion marker.

It has two doors for the Hugging Face hand-off, which the trainer opens
(``NeuronTrainerMixin._open_hf_doors``, with ``torchtitan_neuron.hf``'s
``export_hand_off`` and ``unexpressed_import_skip``):

- ``hf_hand_off(folder)``: what a Hugging Face export (``to_hf``) also gets
  before the rename (config.json and the tokenizer files), on rank 0;
- ``hf_import_skip(state_dict, folder)``: the Hugging Face names an import
  may find absent from ``folder`` (tensors transformers has no place for,
  which the model then keeps at their initial values).

and two for LoRA runs (``torchtitan_neuron.hf.lora``):

- ``hf_merge(state_dict)``: the state a Hugging Face export writes, each
  LoRA adapter folded into its base weight (every rank);
- ``adapter_load()``: after an initial Hugging Face load, the peft adapter
  of ``--checkpoint.initial_load_adapter`` copied into the LoRA adapters.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.tools.logging import logger

PARTIAL_PREFIX = ".partial-"


def partial_name(checkpoint_id: str) -> str:
    head, tail = os.path.split(checkpoint_id.rstrip("/"))
    return os.path.join(head, PARTIAL_PREFIX + tail.removeprefix("step-"))


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _publish(partial: str, final: str) -> None:
    """Rename the complete ``partial`` to ``final`` (rank 0 only)."""
    replaced = None
    if os.path.exists(final):
        replaced = partial + ".replaced"
        os.replace(final, replaced)
    os.replace(partial, final)
    if replaced:
        shutil.rmtree(replaced, ignore_errors=True)


def report_leftovers(folder: str) -> list[str]:
    """Names of incomplete saves left in ``folder`` by an interrupted run."""
    if not os.path.isdir(folder):
        return []
    left = sorted(n for n in os.listdir(folder) if n.startswith(PARTIAL_PREFIX))
    if left and _is_rank0():
        logger.warning(
            f"{folder} holds {', '.join(left)}: saves that an interrupted run did "
            "not finish. They are not checkpoints and are never loaded; the next "
            "save of the same step replaces each, or delete them."
        )
    return left


def _is_step_folder(checkpoint_id) -> bool:
    return re.search(r"step-\d+$", str(checkpoint_id).rstrip("/")) is not None


class NeuronCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpoint manager with saves renamed when complete
    and the Hugging Face hand-off (the module docstring says how)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        initial_load_adapter: str | None = None
        """A peft LoRA adapter folder (adapter_config.json,
        adapter_model.safetensors) whose tensors start the LoRA adapters of a
        LoRA recipe, after the base weights' Hugging Face load
        (--checkpoint.initial_load_in_hf): continued fine-tuning. Ignored,
        like every initial load, when the checkpoint folder holds a step to
        resume."""

    hf_hand_off: Callable[[str], None] | None = None
    hf_import_skip: Callable[[dict, str], set[str]] | None = None
    hf_merge: Callable[[dict], dict] | None = None
    adapter_load: Callable[[], None] | None = None

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.initial_load_adapter = config.initial_load_adapter
        # Remote folders (s3://...) keep torchtitan's in-place writes.
        self.atomic = self.enable and "://" not in str(self.folder)
        if self.atomic:
            report_leftovers(self.folder)

    @torch.no_grad()
    def dcp_save(self, state_dict, checkpoint_id, async_mode, *args, **kwargs):
        save = super().dcp_save
        if kwargs.get("to_hf") and self.hf_merge is not None:
            state_dict = self.hf_merge(state_dict)
        if not getattr(self, "atomic", False) or not _is_step_folder(checkpoint_id):
            return save(state_dict, checkpoint_id, async_mode, *args, **kwargs)
        final, partial = checkpoint_id, partial_name(checkpoint_id)
        if _is_rank0() and os.path.exists(partial):
            shutil.rmtree(partial)
        _barrier()  # no rank writes into the folder rank 0 is clearing
        result = save(state_dict, partial, async_mode, *args, **kwargs)
        future = getattr(result, "upload_completion", result)
        if not hasattr(future, "add_done_callback"):  # a synchronous save returned
            _barrier()  # every rank's files (and consolidated exports) are in
            if _is_rank0():
                if kwargs.get("to_hf") and self.hf_hand_off is not None:
                    self.hf_hand_off(partial)  # config.json, tokenizer
                _publish(partial, final)
        elif _is_rank0():
            # Rank 0's DCP future completes after the metadata, which is
            # written once every rank has reported its shards.
            future.add_done_callback(
                lambda f: f.exception() is None and _publish(partial, final))
        return result

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        self._dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        if from_hf and self.adapter_load is not None:
            self.adapter_load()

    def _dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        skip = set()
        if from_hf and self.sd_adapter is not None and self.hf_import_skip is not None:
            skip = self.hf_import_skip(state_dict, checkpoint_id)
        if not skip:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        # Upstream's HF branch, asking DCP only for the tensors the folder has.
        adapter = self.sd_adapter
        hf_state_dict = {k: v for k, v in adapter.to_hf(state_dict).items() if k not in skip}
        reader = adapter.get_hf_storage_reader(checkpoint_id, from_quantized)
        dcp.load(hf_state_dict, storage_reader=reader)
        self.states[MODEL].load_state_dict(adapter.from_hf(hf_state_dict))
