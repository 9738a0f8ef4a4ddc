"""A Hugging Face folder a run starts from holds what the recipe's flavor
expects, read from the safetensors headers before any rank starts."""

from __future__ import annotations

import re
from pathlib import Path

from torchtitan_neuron.preflight.errors import PreflightError


def check_hf_import(config) -> None:
    """An HF folder the run starts from (``--checkpoint.initial_load_in_hf``)
    holds the tensors, with the shapes, the recipe's flavor expects: read
    from the safetensors headers, before any rank starts (inside DCP a
    mismatch is a traceback on every rank, and a missing tensor is silently
    left at its random initial value)."""
    ckpt = config.checkpoint
    adapter = getattr(ckpt, "initial_load_adapter", None)
    if adapter and not (ckpt.enable and ckpt.initial_load_in_hf):
        raise PreflightError(
            f"--checkpoint.initial_load_adapter {adapter}: the adapter starts on base weights "
            "read from a Hugging Face folder; pass --checkpoint.enable and "
            "--checkpoint.initial_load_in_hf with it.")
    if not (ckpt.enable and ckpt.initial_load_in_hf):
        return
    folder = Path(config.dump_folder) / ckpt.folder
    if folder.is_dir() and any(re.fullmatch(r"step-\d+", p.name) for p in folder.iterdir()):
        return  # resuming: torchtitan ignores the initial load
    source = ckpt.initial_load_path or config.hf_assets_path
    flag = ("--checkpoint.initial_load_path" if ckpt.initial_load_path
            else "--hf_assets_path")
    if not source or not Path(source).is_dir():
        raise PreflightError(
            f"--checkpoint.initial_load_in_hf: {flag} {source!r} is not a folder. "
            "Pass the Hugging Face folder with --checkpoint.initial_load_path "
            "(an absolute path).")
    from torchtitan_neuron import hf

    spec = config.model_spec
    if ckpt.initial_load_in_hf_quantized and hf.family(spec) == "gpt_oss":
        raise PreflightError(
            "--checkpoint.initial_load_in_hf_quantized: importing GPT-OSS's MXFP4 "
            "weights is not supported. Dequantize them to bf16 first (docs/hf.md: "
            "transformers' Mxfp4Config(dequantize=True), then save_pretrained) and "
            "import that folder without the flag.")
    if ckpt.initial_load_in_hf_quantized:
        return  # quantized folders name their tensors differently
    if spec.state_dict_adapter is None:
        raise PreflightError(
            f"--checkpoint.initial_load_in_hf: model {spec.name!r} has no Hugging "
            "Face state-dict adapter; start it from a DCP checkpoint instead.")
    spec.model.update_from_config(config=config)
    refusal = hf.import_refusal(spec, spec.model, source, hf.family_flavors(spec))
    if refusal:
        raise PreflightError(f"{flag} {refusal}")
    if adapter:
        check_adapter(spec, adapter)


def check_adapter(spec, folder) -> None:
    """A peft adapter folder (``--checkpoint.initial_load_adapter``) fits the
    recipe's LoRA: rank, alpha, target modules and every tensor's shape
    (the base model's dimensions), and a fused q/k/v takes its lora_A."""
    from torchtitan_neuron.hf.lora import LoRAMap

    lora = LoRAMap.for_model(spec, spec.model, spec.state_dict_adapter(spec.model, None))
    if lora is None:
        raise PreflightError(
            f"--checkpoint.initial_load_adapter {folder}: the recipe's model has no LoRA "
            "adapters to load it into; use a LoRA recipe (docs/fine_tuning.md).")
    refusal = lora.refusal(folder)
    if refusal:
        raise PreflightError(f"--checkpoint.initial_load_adapter {refusal}")
