"""Hand-off to the Hugging Face ecosystem: exports ``from_pretrained`` opens,
imports checked before a rank starts.

torchtitan's ``--checkpoint.last_save_in_hf`` writes safetensors and their
index through the recipe's state-dict adapter. This module adds what
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` and
``AutoTokenizer.from_pretrained(folder)`` need besides: a ``config.json``
for the transformers architecture that computes the same function, and the
tokenizer files from ``--hf_assets_path``. ``install_export`` (called by
``NeuronTrainer``) writes them into the checkpoint's ``.partial-N`` folder
before it is renamed, so a complete ``step-N`` always has them.

Family -> architecture (docs/hf.md): Llama 3 -> ``LlamaForCausalLM``;
Qwen3 -> ``Qwen3ForCausalLM``; DeepSeek-V3 as this project's flavors
configure it (softmax routing, no expert groups) -> ``DeepseekV2ForCausalLM``
(transformers' DeepSeek-V3 routes with sigmoid); GPT-OSS ->
``GptOssForCausalLM``. What an architecture cannot express (the aux-loss-free
expert-selection bias of the MoE families) is named at export; the weights
are still written.

``coverage_gaps`` proves, on meta tensors, that the adapter's ``to_hf`` and
``from_hf`` carry every model tensor; ``import_refusal`` compares an HF
folder's tensor names and shapes (read from the safetensors headers, no data)
with what the recipe's flavor expects.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

# Files AutoTokenizer reads, copied from --hf_assets_path when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
)

# Model tensors an architecture has no place for, per family: (state-dict
# key pattern, what transformers lacks). They are reported, not refused.
UNEXPRESSED = {
    "deepseek_v3": (r"\.moe\.expert_bias_E$",
                    "an expert-selection bias (DeepseekV2's router has none)"),
    "gpt_oss": (r"\.moe\.expert_bias_E$",
                "an expert-selection bias (GptOss's router has none)"),
}


class HFExportError(ValueError):
    """The recipe's model cannot be handed to transformers as asked."""


def family(model_spec) -> str:
    return model_spec.name.rsplit("/", 1)[-1]


def _layers(model_config) -> list:
    return list(getattr(model_config, "layers", []))


def _rope_parameters(rope) -> dict:
    if rope.scaling == "llama":
        return {"rope_type": "llama3", "rope_theta": float(rope.theta),
                "factor": float(rope.scaling_factor),
                "low_freq_factor": float(rope.low_freq_factor),
                "high_freq_factor": float(rope.high_freq_factor),
                "original_max_position_embeddings": int(rope.original_max_position_embeddings)}
    if rope.scaling == "yarn":
        return {"rope_type": "yarn", "rope_theta": float(rope.theta),
                "factor": float(rope.rope_factor),
                "original_max_position_embeddings": int(rope.original_seq_len),
                "beta_fast": float(rope.beta_fast), "beta_slow": float(rope.beta_slow),
                "truncate": bool(rope.truncate)}
    return {"rope_type": "default", "rope_theta": float(rope.theta)}


def _max_positions(rope) -> int:
    if rope.scaling == "llama":
        return int(rope.original_max_position_embeddings * rope.scaling_factor)
    if rope.scaling == "yarn":
        return int(rope.original_seq_len * rope.rope_factor)
    return int(rope.max_seq_len)


def _llama(mc) -> dict:
    attn = mc.layers[0].attention
    n_heads = attn.n_heads
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": mc.vocab_size, "hidden_size": mc.dim,
        "intermediate_size": mc.layers[0].feed_forward.w1.out_features,
        "num_hidden_layers": len(mc.layers), "num_attention_heads": n_heads,
        "num_key_value_heads": attn.n_kv_heads or n_heads,
        "head_dim": attn.head_dim or mc.dim // n_heads, "hidden_act": "silu",
        "rms_norm_eps": mc.norm.eps, "tie_word_embeddings": bool(mc.enable_weight_tying),
        "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": _max_positions(attn.rope),
        "rope_parameters": _rope_parameters(attn.rope),
    }


def _qwen3(mc) -> dict:
    attn = mc.layers[0].attention
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": mc.vocab_size, "hidden_size": mc.dim,
        "intermediate_size": mc.layers[0].feed_forward.w1.out_features,
        "num_hidden_layers": len(mc.layers), "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads or attn.n_heads, "head_dim": attn.head_dim,
        "hidden_act": "silu", "rms_norm_eps": mc.norm.eps,
        "tie_word_embeddings": bool(mc.enable_weight_tying), "attention_bias": False,
        "use_sliding_window": False, "max_position_embeddings": _max_positions(attn.rope),
        "rope_parameters": _rope_parameters(attn.rope),
    }


def _deepseek(mc) -> dict:
    moe_layers = [i for i, layer in enumerate(mc.layers) if layer.moe is not None]
    if not moe_layers:
        raise HFExportError("this DeepSeek flavor has no MoE layer; DeepseekV2 expects some")
    if moe_layers != list(range(moe_layers[0], len(mc.layers))):
        raise HFExportError(
            f"DeepseekV2 puts dense layers first, then MoE layers; this flavor's MoE "
            f"layers are {moe_layers}")
    attn, moe = mc.layers[0].attention, mc.layers[moe_layers[0]].moe
    router, inner = moe.router, moe.routed_experts.inner_experts
    if router.score_func != "softmax":
        raise HFExportError(
            f"the router scores with {router.score_func}; DeepseekV2ForCausalLM routes "
            "with softmax and DeepseekV3ForCausalLM with sigmoid plus a group-limited "
            "top-k over a correction bias, neither the same function")
    if router.route_norm:
        raise HFExportError("the router renormalises the top-k weights (route_norm); "
                            "DeepseekV2's greedy router does not")
    if (router.num_expert_groups or 1) > 1:
        raise HFExportError("the router limits experts by group; DeepseekV2 picks groups "
                            "by their top score where torchtitan sums the top two")
    rope = attn.rope
    shared = moe.shared_experts.w1.out_features if moe.shared_experts is not None else 0
    params = _rope_parameters(rope)
    params.update(mscale=float(attn.mscale), mscale_all_dim=float(attn.mscale))
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": mc.vocab_size, "hidden_size": mc.dim,
        "intermediate_size": mc.layers[0].feed_forward.w1.out_features
        if moe_layers[0] > 0 else inner.hidden_dim,
        "moe_intermediate_size": inner.hidden_dim, "num_hidden_layers": len(mc.layers),
        "num_attention_heads": attn.n_heads, "num_key_value_heads": attn.n_heads,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": router.top_k,
        "n_shared_experts": shared // inner.hidden_dim, "first_k_dense_replace": moe_layers[0],
        "topk_method": "greedy", "n_group": None, "topk_group": None,
        "routed_scaling_factor": float(router.route_scale), "norm_topk_prob": False,
        "q_lora_rank": attn.q_lora_rank or None, "kv_lora_rank": attn.kv_lora_rank,
        "qk_nope_head_dim": attn.qk_nope_head_dim, "qk_rope_head_dim": attn.qk_rope_head_dim,
        "v_head_dim": attn.v_head_dim, "hidden_act": "silu", "rms_norm_eps": mc.norm.eps,
        "tie_word_embeddings": False, "attention_bias": False,
        "max_position_embeddings": _max_positions(rope), "rope_parameters": params,
    }


def _gpt_oss(mc) -> dict:
    attn, moe = mc.layers[0].attention, mc.layers[0].moe
    inner = moe.routed_experts.inner_experts
    windows = {layer.attention.sliding_window_size for layer in mc.layers} - {None}
    if len(windows) > 1:
        raise HFExportError(f"layers use different sliding windows {sorted(windows)}; "
                            "GptOss has one")
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": mc.vocab_size, "hidden_size": mc.dim,
        "intermediate_size": inner.hidden_dim, "num_hidden_layers": len(mc.layers),
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.router.top_k,
        "num_attention_heads": attn.n_heads, "num_key_value_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim, "sliding_window": next(iter(windows), None),
        "layer_types": ["sliding_attention" if layer.attention.sliding_window_size
                        else "full_attention" for layer in mc.layers],
        "rms_norm_eps": mc.norm.eps, "attention_bias": True, "tie_word_embeddings": False,
        "swiglu_limit": float(inner.swiglu_limit), "swiglu_alpha": 1.702,
        "max_position_embeddings": _max_positions(attn.rope),
        "rope_parameters": _rope_parameters(attn.rope),
        # GptOss has no SDPA path in transformers (its sinks): eager.
        "attn_implementation": "eager",
    }


BUILDERS = {"llama3": _llama, "qwen3": _qwen3, "deepseek_v3": _deepseek, "gpt_oss": _gpt_oss}


def transformers_config(model_spec, model_config, dtype: torch.dtype) -> dict:
    """``config.json`` for the recipe's model; raises HFExportError naming
    what the family's transformers architecture cannot express."""
    name = family(model_spec)
    if name not in BUILDERS:
        raise HFExportError(f"no transformers architecture is mapped for model {name!r} "
                            f"(mapped: {', '.join(sorted(BUILDERS))})")
    config = BUILDERS[name](model_config)
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config


def _meta_state(model_spec, model_config) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = model_config.build()
    return dict(model.state_dict())


def _as_meta(state: dict) -> dict[str, torch.Tensor]:
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta")
            for k, v in state.items() if isinstance(v, torch.Tensor)}


def unexpressed_hf_keys(model_spec, adapter, state: dict) -> set[str]:
    """The HF names of the tensors transformers has no place for (the
    family's ``UNEXPRESSED``), as ``to_hf`` writes them."""
    pattern, _ = UNEXPRESSED.get(family(model_spec), (None, None))
    if pattern is None:
        return set()
    return set(adapter.to_hf({k: v for k, v in state.items() if re.search(pattern, k)}))


def _coverage(model_spec, adapter, state: dict) -> tuple[list[str], list[str], set[str]]:
    """``coverage_gaps``, and the HF names ``to_hf`` gives the state."""
    meta = _as_meta(state)
    mapped = adapter.to_hf(dict(meta))
    back = adapter.from_hf(dict(mapped))
    pattern, _ = UNEXPRESSED.get(family(model_spec), (None, None))
    lost = [k for k in meta if k not in back]
    unexpressed = [k for k in lost if pattern and re.search(pattern, k)]
    return [k for k in lost if k not in unexpressed], unexpressed, set(mapped)


def coverage_gaps(model_spec, adapter, state: dict) -> tuple[list[str], list[str]]:
    """(tensors the adapter drops, tensors the architecture has no place for),
    both as model state-dict keys. ``state`` may hold meta tensors."""
    dropped, unexpressed, _ = _coverage(model_spec, adapter, state)
    return dropped, unexpressed


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


def install_export(trainer) -> bool:
    """Arrange for ``--checkpoint.last_save_in_hf`` exports to carry
    config.json and the tokenizer. Raises HFExportError at start-up when the
    adapter would drop model tensors. Returns False when there is no HF
    export to arrange."""
    checkpointer = trainer.checkpointer
    if getattr(checkpointer, "enable", False):
        allow_unexpressed_on_import(checkpointer, trainer.config.model_spec)
    if not getattr(checkpointer, "enable", False) or not getattr(checkpointer, "last_save_in_hf", False):
        return False
    config = trainer.config
    spec = config.model_spec
    adapter = checkpointer.sd_adapter
    # What the checkpointer saves: the model wrapper's flattened state dict.
    model_state = checkpointer.states["model"]
    state = dict(model_state.state_dict())
    dropped, _, expected = _coverage(spec, adapter, state)
    if dropped:
        raise HFExportError(
            f"--checkpoint.last_save_in_hf would leave out {len(dropped)} model tensors "
            f"the state-dict adapter does not map ({', '.join(dropped[:3])}, ...); "
            "the export would not be the trained model. Save without "
            "--checkpoint.last_save_in_hf and use scripts/export_hf.py once the "
            "adapter maps them.")
    hf_config, gap = export_config(spec, checkpointer.export_dtype)
    if gap:
        from torchtitan.tools.logging import logger

        logger.warning(f"The Hugging Face export will have no config.json: {gap}. "
                       "The weights are still written.")
    # Rank 0 alone writes the hand-off: it reads its own buffers, not the
    # state dict (a collective under FSDP).
    checkpointer.hf_hand_off = lambda folder: _hand_off(
        folder, spec, hf_config, gap, config.hf_assets_path, trainer.model_parts, expected)
    return True


def written_tensors(folder) -> set[str]:
    """The tensor names an HF folder holds: its index, else its headers."""
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    return set(folder_shapes(folder))


def _hand_off(folder, spec, hf_config, gap, hf_assets_path, model_parts, expected) -> None:
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


# ---- import -----------------------------------------------------------------

def allow_unexpressed_on_import(checkpointer, spec) -> bool:
    """An HF folder transformers wrote has no expert-selection bias (its
    DeepSeek-V2 and GPT-OSS have none), and torchtitan's HF load asks DCP
    for every tensor ``to_hf`` names: "Missing key in checkpoint state_dict:
    model.layers.1.mlp.gate.e_score_correction_bias". Wrap ``dcp_load`` so
    that, for an HF load, those tensors are requested only when the folder
    has them; the model keeps its initial values (zeros) otherwise. Every
    other tensor is still required (``import_refusal`` names missing
    ones before a rank starts)."""
    pattern, what = UNEXPRESSED.get(family(spec), (None, None))
    if pattern is None or not hasattr(checkpointer, "dcp_load"):
        return False
    load = checkpointer.dcp_load
    adapter = checkpointer.sd_adapter

    def dcp_load(state_dict, checkpoint_id, from_hf, *args, **kwargs):
        if not from_hf or adapter is None:
            return load(state_dict, checkpoint_id, from_hf, *args, **kwargs)
        present = set(folder_shapes(checkpoint_id))
        skip = unexpressed_hf_keys(spec, adapter, state_dict) - present
        if not skip:
            return load(state_dict, checkpoint_id, from_hf, *args, **kwargs)
        from torchtitan.tools.logging import logger

        logger.info(f"{checkpoint_id} has no {what.split(' (')[0]} ({len(skip)} tensors, "
                    "as transformers writes it): it starts at zero")
        to_hf = adapter.to_hf
        adapter.to_hf = lambda sd: {k: v for k, v in to_hf(sd).items() if k not in skip}
        try:
            return load(state_dict, checkpoint_id, from_hf, *args, **kwargs)
        finally:
            adapter.to_hf = to_hf

    checkpointer.dcp_load = dcp_load
    return True


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
    return _hf_shapes(adapter, _meta_state(model_spec, model_config))


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
    meta = _meta_state(model_spec, model_config)
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
