"""Imports checked before a rank starts: an HF folder's tensor names and
shapes (read from the safetensors headers, no data) against what the
recipe's flavor expects, and the tolerant load of tensors transformers has
no place for.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from torchtitan_neuron.hf.config import (
    UNEXPRESSED,
    meta_state,
    family,
    unexpressed_hf_keys,
)

def unexpressed_import_skip(spec, adapter):
    """For an HF import, the tensors the folder may lack, as
    ``NeuronCheckpointManager.hf_import_skip`` takes them; None for a family
    with none.

    An HF folder transformers wrote has no expert-selection bias (its
    DeepSeek-V2 and GPT-OSS have none), and torchtitan's HF load asks DCP
    for every tensor ``to_hf`` names: "Missing key in checkpoint state_dict:
    model.layers.1.mlp.gate.e_score_correction_bias". Those tensors are
    asked for only when the folder has them; the model keeps its initial
    values (zeros) otherwise. Every other tensor is still required
    (``import_refusal`` names missing ones before a rank starts)."""
    pattern, what = UNEXPRESSED.get(family(spec), (None, None))
    if pattern is None or adapter is None:
        return None

    def skip(state_dict: dict, folder: str) -> set[str]:
        absent = unexpressed_hf_keys(spec, adapter, state_dict) - set(folder_shapes(folder))
        if absent:
            from torchtitan.tools.logging import logger

            logger.info(f"{folder} has no {what.split(' (')[0]} ({len(absent)} tensors, "
                        "as transformers writes it): it starts at zero")
        return absent

    return skip


def folder_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of an HF folder's safetensors, from the
    headers alone."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def expected_shapes(model_spec, model_config) -> dict[str, tuple[int, ...]]:
    adapter = model_spec.state_dict_adapter(model_config, None)
    return _hf_shapes(adapter, meta_state(model_spec, model_config))


def _hf_shapes(adapter, meta: dict) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in adapter.to_hf(dict(meta)).items()}


# Tensors HF folders carry that no model here needs.
IGNORED_IN_FOLDER = (r"rotary_emb\.inv_freq$",)


def import_refusal(model_spec, model_config, folder, flavors=None) -> str | None:
    """Why ``folder`` cannot initialise the recipe's model, or None.
    ``flavors`` maps flavor names to model configs to suggest one from."""
    found = {k: v for k, v in folder_shapes(folder).items()
             if not any(re.search(p, k) for p in IGNORED_IN_FOLDER)}
    if not found:
        return f"{folder} holds no *.safetensors files"
    adapter = model_spec.state_dict_adapter(model_config, None)
    meta = meta_state(model_spec, model_config)
    want = _hf_shapes(adapter, meta)
    # What the architecture has no place for may be absent (a folder
    # transformers wrote); the model keeps its initial values there.
    optional = unexpressed_hf_keys(model_spec, adapter, meta)
    flavor = model_spec.flavor
    for name, shape in want.items():
        if name in found and found[name] != shape:
            return (f"{folder} does not match flavor {flavor!r}: tensor {name} is "
                    f"{list(found[name])} there, {list(shape)} expected."
                    f"{_flavor_hint(model_spec, found, flavors)}")
    missing = sorted(set(want) - set(found) - optional)
    unexpected = sorted(set(found) - set(want))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors ({', '.join(missing[:3])}"
                         + (", ..." if len(missing) > 3 else "") + ")")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])}"
                         + (", ..." if len(unexpected) > 3 else "") + ")")
        return (f"{folder} does not match flavor {flavor!r}: {'; '.join(parts)}."
                f"{_flavor_hint(model_spec, found, flavors)}")
    return None


# Each family's flavors, to name the one a folder matches.
FLAVOR_TABLES = {
    "llama3": ("torchtitan.models.llama3", "llama3_configs"),
    "qwen3": ("torchtitan.models.qwen3", "qwen3_configs"),
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "deepseekv3_configs"),
    "gpt_oss": ("torchtitan_neuron.models.gpt_oss", "GPT_OSS_FLAVORS"),
}


def family_flavors(model_spec) -> dict:
    import importlib

    where = FLAVOR_TABLES.get(family(model_spec))
    if where is None:
        return {}
    return dict(getattr(importlib.import_module(where[0]), where[1]))


def _call_flavor(make):
    """A flavor factory's config; upstream's take the attention and MoE
    communication backends, which change no shape."""
    import inspect

    wanted = {"attn_backend": "flex", "moe_comm_backend": "standard"}
    names = inspect.signature(make).parameters
    return make(**{k: v for k, v in wanted.items() if k in names})


def _flavor_hint(model_spec, found, flavors) -> str:
    if not flavors:
        return ""
    # Smallest first: the embedding's shape rules most flavors out unbuilt.
    embed = next((v for k, v in found.items() if k.endswith("embed_tokens.weight")), None)
    for name, make in flavors.items():
        if name == model_spec.flavor:
            continue
        try:
            config = _call_flavor(make) if callable(make) else make
            if embed and (config.vocab_size, config.dim) != embed:
                continue
            want = expected_shapes(model_spec, config)
        except Exception:  # a flavor that cannot build on meta is no suggestion
            continue
        if set(want) <= set(found) and all(found[k] == v for k, v in want.items()):
            return f" The folder matches flavor {name!r}."
    return " No flavor of this model matches it."
