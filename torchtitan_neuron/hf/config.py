"""The transformers ``config.json`` for each family, and what its
architecture can express.

Family -> architecture (docs/hf.md): Llama 3 -> ``LlamaForCausalLM``;
Qwen3 -> ``Qwen3ForCausalLM``; DeepSeek-V3 as this project's flavors
configure it (softmax routing, no expert groups) -> ``DeepseekV2ForCausalLM``
(transformers' DeepSeek-V3 routes with sigmoid); GPT-OSS ->
``GptOssForCausalLM``. What an architecture cannot express (the aux-loss-free
expert-selection bias of the MoE families) is named at export; the weights
are still written. ``coverage_gaps`` proves, on meta tensors, that the
adapter's ``to_hf`` and ``from_hf`` carry every model tensor.
"""

from __future__ import annotations

import re

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


def meta_state(model_spec, model_config) -> dict[str, torch.Tensor]:
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


def coverage(model_spec, adapter, state: dict) -> tuple[list[str], list[str], set[str]]:
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
    dropped, unexpressed, _ = coverage(model_spec, adapter, state)
    return dropped, unexpressed
