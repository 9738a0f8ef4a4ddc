"""Checkpoints are written under a temporary name and renamed when complete.

torchtitan 0.3.0 writes ``<folder>/step-N`` in place. A run stopped part-way
through a save (Ctrl-C, a crash, a lost node) leaves a ``step-N`` folder
with some shards and no ``.metadata``. torchtitan's own loader skips such a
folder, but a person, a copy script or an export reading ``step-N`` cannot
tell it from a good one, and its purge counts it as a checkpoint.

``make_saves_atomic(checkpointer)`` makes every save write to
``<folder>/.partial-N`` and rename it to ``step-N`` once every rank's
shards and the metadata are written: after the save returns (synchronous
saves, and the last-step and Hugging Face exports), or when the upload
future completes (``--checkpoint.async_mode async``). ``.partial-N`` never
matches torchtitan's ``step-(\\d+)`` pattern, so it is never loaded or
purged as a checkpoint; a leftover one is reported and replaced by the next
save of that step. Remote folders (``s3://``...) keep torchtitan's
behaviour: there, ``.metadata`` written last is the completion marker.

A Hugging Face export (``to_hf``) also gets, before the rename, what
``checkpointer.hf_hand_off`` writes (``torchtitan_neuron.hf.install_export``:
config.json and the tokenizer files).
"""

from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist

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


def make_saves_atomic(checkpointer) -> bool:
    """Wrap ``checkpointer.dcp_save``; returns False where it is left as is."""
    folder = getattr(checkpointer, "folder", "")
    if not getattr(checkpointer, "enable", False) or "://" in str(folder):
        return False
    save = checkpointer.dcp_save
    report_leftovers(folder)

    def dcp_save(state_dict, checkpoint_id, async_mode, *args, **kwargs):
        if not re.search(r"step-\d+$", str(checkpoint_id).rstrip("/")):
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
                hand_off = getattr(checkpointer, "hf_hand_off", None)
                if kwargs.get("to_hf") and hand_off is not None:
                    hand_off(partial)  # config.json, tokenizer (torchtitan_neuron.hf)
                _publish(partial, final)
        elif _is_rank0():
            # Rank 0's DCP future completes after the metadata, which is
            # written once every rank has reported its shards.
            future.add_done_callback(
                lambda f: f.exception() is None and _publish(partial, final))
        return result

    checkpointer.dcp_save = dcp_save
    return True
