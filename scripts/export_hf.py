#!/usr/bin/env python3
"""Export a DCP checkpoint as a Hugging Face folder ``from_pretrained`` opens.

    python scripts/export_hf.py --module torchtitan_neuron.experiments.graph_trainer.llama3 \\
        --config simple_fsdp_llama3_debugmodel --checkpoint outputs/checkpoint/step-10 \\
        --out outputs/hf/step-10 [--dtype bfloat16] [trainer flags...]

Loads the checkpoint (full or model-only, any layout it was saved from) into
the recipe's model in one process on the CPU, maps it through the recipe's
state-dict adapter, checks that every model tensor is carried, and writes
``model.safetensors``, ``config.json`` (torchtitan_neuron.hf) and the
tokenizer files from ``--hf_assets_path``. The host needs the model's size in
fp32 in memory (an 8B model: 32 GB). What the transformers architecture
cannot express is printed and written to ``EXPORT_NOTES.txt``; the weights
are still written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoint_loss import build_model, load_weights, recipe_parser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = recipe_parser(__doc__)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 (default: --checkpoint.export_dtype)")
    opts, trainer_args = parser.parse_known_args(argv)

    from safetensors.torch import save_file
    from torchtitan.config import TORCH_DTYPE_MAP

    from torchtitan_neuron import hf

    config, model, adapter = build_model(opts.module, opts.config, trainer_args)
    if adapter is None:
        raise SystemExit(f"{config.model_spec.name} has no Hugging Face state-dict adapter.")
    if (opts.checkpoint / "model.safetensors.index.json").exists():
        raise SystemExit(f"{opts.checkpoint} is already a Hugging Face export.")
    load_weights(model, opts.checkpoint, adapter)
    dtype = TORCH_DTYPE_MAP[opts.dtype or config.checkpoint.export_dtype]
    state = model.state_dict()
    dropped, _ = hf.coverage_gaps(config.model_spec, adapter, state)
    if dropped:
        raise SystemExit(f"the state-dict adapter does not map {len(dropped)} model "
                         f"tensors ({', '.join(dropped[:3])}, ...): not exported.")
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
               for k, v in adapter.to_hf(state).items()}
    opts.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(opts.out / "model.safetensors"), metadata={"format": "pt"})
    notes = hf.bias_notes(config.model_spec, state)
    hf_config, gap = hf.export_config(config.model_spec, dtype)
    written = hf.finish_export(opts.out, hf_config, gap, config.hf_assets_path, notes)
    if gap:
        print(f"wrote {len(tensors)} tensors to {opts.out}; no config.json: {gap}")
        return 0
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {len(tensors)} tensors ({dtype}) and {', '.join(written)} to {opts.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
