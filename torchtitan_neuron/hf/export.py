"""Exports ``from_pretrained`` opens: beside the safetensors, ``config.json``,
the tokenizer files and notes on what the architecture cannot express.

torchtitan's ``--checkpoint.last_save_in_hf`` writes safetensors and their
index through the recipe's state-dict adapter; ``export_hand_off`` gives the
trainer what ``NeuronCheckpointManager.hf_hand_off`` writes into the
checkpoint's ``.partial-N`` folder before it is renamed, so a complete
``step-N`` always has it.
``export_checkpoint`` exports a DCP checkpoint after the fact
(``python -m torchtitan_neuron.hf export``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from torchtitan_neuron.hf.config import (
    coverage_gaps,
    TOKENIZER_FILES,
    UNEXPRESSED,
    HFExportError,
    coverage,
    family,
    transformers_config,
)
from torchtitan_neuron.hf.load import folder_shapes
from torchtitan_neuron.hf.lora import LoRAMap, is_lora_key

def write_hand_off(folder: str | os.PathLike, hf_config: dict, hf_assets_path: str | None,
                   notes: list[str]) -> list[str]:
    """Write config.json (and the notes, when any) and copy the tokenizer
    files into ``folder``; returns the names written."""
    folder = Path(folder)
    written = ["config.json"]
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if notes:
        (folder / "EXPORT_NOTES.txt").write_text("\n".join(notes) + "\n")
        written.append("EXPORT_NOTES.txt")
    if hf_assets_path and Path(hf_assets_path).is_dir():
        for name in TOKENIZER_FILES:
            source = Path(hf_assets_path) / name
            if source.is_file():
                shutil.copyfile(source, folder / name)
                written.append(name)
    return written


def export_config(model_spec, dtype: torch.dtype) -> tuple[dict | None, str | None]:
    """(config.json's contents, None), or (None, why transformers cannot
    express the flavor)."""
    try:
        return transformers_config(model_spec, model_spec.model, dtype), None
    except HFExportError as exc:
        return None, str(exc)


def finish_export(folder, hf_config: dict | None, gap: str | None,
                  hf_assets_path: str | None, notes: list[str]) -> list[str]:
    """What goes beside the safetensors: config.json, tokenizer and notes;
    with a ``gap``, only the notes saying why there is no config.json.
    Returns the names written."""
    if gap:
        (Path(folder) / "EXPORT_NOTES.txt").write_text(
            "\n".join([*notes, f"no config.json: {gap}"]) + "\n")
        return ["EXPORT_NOTES.txt"]
    return write_hand_off(folder, hf_config, hf_assets_path, notes)


def bias_notes(model_spec, state: dict) -> list[str]:
    """A note per family gap whose tensors hold anything but zeros."""
    pattern, what = UNEXPRESSED.get(family(model_spec), (None, None))
    if not pattern:
        return []
    used = []
    for key, value in state.items():
        if re.search(pattern, key) and isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            if local.numel() and float(local.detach().abs().max()) > 0:
                used.append(key)
    if not used:
        return []
    return [f"transformers has no place for {what}: {len(used)} tensors "
            f"({used[0]}, ...) are not zero, so the exported model routes tokens by "
            "the unbiased scores and its outputs can differ from this model's; they are "
            "written to the safetensors all the same."]


def export_hand_off(trainer):
    """What a ``--checkpoint.last_save_in_hf`` export also gets (config.json,
    the tokenizer), as ``NeuronCheckpointManager.hf_hand_off`` takes it;
    None when the run exports nothing. Raises HFExportError at start-up
    when the adapter would drop model tensors."""
    checkpointer = trainer.checkpointer
    if not getattr(checkpointer, "enable", False) or not getattr(checkpointer, "last_save_in_hf", False):
        return None
    config = trainer.config
    spec = config.model_spec
    adapter = checkpointer.sd_adapter
    # What the checkpointer saves: the model wrapper's flattened state dict.
    model_state = checkpointer.states["model"]
    state = dict(model_state.state_dict())
    # A LoRA run exports its adapters merged into the base weights, and the
    # adapters alone in peft's format (hf/lora.py).
    lora = LoRAMap.for_model(spec, spec.model, adapter)
    if lora is not None:
        checkpointer.hf_merge = lora.merged
        state = {k: v for k, v in state.items() if not is_lora_key(k)}
    dropped, _, expected = coverage(spec, adapter, state)
    if dropped:
        raise HFExportError(
            f"--checkpoint.last_save_in_hf would leave out {len(dropped)} model tensors "
            f"the state-dict adapter does not map ({', '.join(dropped[:3])}, ...); "
            "the export would not be the trained model. Save without "
            "--checkpoint.last_save_in_hf and use python -m torchtitan_neuron.hf export once the "
            "adapter maps them.")
    hf_config, gap = export_config(spec, checkpointer.export_dtype)
    if gap:
        from torchtitan.tools.logging import logger

        logger.warning(f"The Hugging Face export will have no config.json: {gap}. "
                       "The weights are still written.")
    # Rank 0 alone writes the hand-off: it reads its own buffers, not the
    # state dict (a collective under FSDP).
    base = checkpointer.initial_load_path or config.hf_assets_path
    return lambda folder: _hand_off(
        folder, spec, hf_config, gap, config.hf_assets_path, trainer.model_parts, expected,
        lora, base and os.path.abspath(base), checkpointer.export_dtype)


def written_tensors(folder) -> set[str]:
    """The tensor names an HF folder holds: its index, else its headers."""
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    return set(folder_shapes(folder))


def _hand_off(folder, spec, hf_config, gap, hf_assets_path, model_parts, expected,
              lora=None, base=None, dtype=torch.float32) -> None:
    from torchtitan.tools.logging import logger

    missing = sorted(expected - written_tensors(folder))
    if missing:
        # Not renamed to step-N: an export without them is not the model.
        raise HFExportError(
            f"the Hugging Face export in {folder} lacks {len(missing)} of the "
            f"{len(expected)} tensors the adapter maps ({', '.join(missing[:3])}, ...); "
            "it is left under its .partial name.")

    local = {name: tensor for part in model_parts
             for name, tensor in [*part.named_buffers(), *part.named_parameters()]}
    notes = bias_notes(spec, local)
    written = finish_export(folder, hf_config, gap, hf_assets_path, notes)
    if gap:
        return
    for note in notes:
        logger.warning(f"Hugging Face export: {note}")
    logger.info(f"Hugging Face export: wrote {', '.join(written)} beside the safetensors")
    if lora is not None:
        out = lora.write_adapter(folder, base, dtype)
        step = re.sub(r"^\.partial-", "step-", os.path.basename(str(folder).rstrip("/")))
        logger.info(f"Hugging Face export: the LoRA adapters merged into the weights, and "
                    f"alone in peft's format in {step}/{out.name} "
                    f"(rank {lora.rank}, alpha {lora.alpha:g}, "
                    f"{', '.join(lora.target_modules())})")


EXPORT_DOC = """A DCP checkpoint (``.../checkpoint/step-N``, any layout) as a Hugging
Face folder: safetensors in ``--dtype`` (default ``--checkpoint.export_dtype``),
``config.json`` and the tokenizer files.

    python -m torchtitan_neuron.hf export --module M --config C
        --checkpoint STEP --out FOLDER [--dtype float32] [trainer flags]
"""


def export_main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan_neuron.hf export``: see ``EXPORT_DOC``."""
    from torchtitan_neuron.hf.model import build_model, load_weights, recipe_parser

    parser = recipe_parser(EXPORT_DOC)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 (default: --checkpoint.export_dtype)")
    opts, trainer_args = parser.parse_known_args(argv)

    from safetensors.torch import save_file
    from torchtitan.config import TORCH_DTYPE_MAP


    config, model, adapter = build_model(opts.module, opts.config, trainer_args)
    if adapter is None:
        raise SystemExit(f"{config.model_spec.name} has no Hugging Face state-dict adapter.")
    if (opts.checkpoint / "model.safetensors.index.json").exists():
        raise SystemExit(f"{opts.checkpoint} is already a Hugging Face export.")
    load_weights(model, opts.checkpoint, adapter)
    dtype = TORCH_DTYPE_MAP[opts.dtype or config.checkpoint.export_dtype]
    state = model.state_dict()
    dropped, _ = coverage_gaps(config.model_spec, adapter, state)
    if dropped:
        raise SystemExit(f"the state-dict adapter does not map {len(dropped)} model "
                         f"tensors ({', '.join(dropped[:3])}, ...): not exported.")
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
               for k, v in adapter.to_hf(state).items()}
    opts.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(opts.out / "model.safetensors"), metadata={"format": "pt"})
    notes = bias_notes(config.model_spec, state)
    hf_config, gap = export_config(config.model_spec, dtype)
    written = finish_export(opts.out, hf_config, gap, config.hf_assets_path, notes)
    if gap:
        print(f"wrote {len(tensors)} tensors to {opts.out}; no config.json: {gap}")
        return 0
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {len(tensors)} tensors ({dtype}) and {', '.join(written)} to {opts.out}")
    return 0
