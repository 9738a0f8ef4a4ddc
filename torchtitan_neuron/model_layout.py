"""Layout checks that depend on the model: what the parallel degrees split.

``preflight.check_layout`` calls ``model_layout_refusal`` once the degrees
have passed torchtitan's own ``ParallelDims``. TP splits every layer's query
and KV heads, expert parallelism splits the experts; a degree that does not
divide them fails inside every rank (a shape error while sharding, or a
hang), so it is refused here with the degrees that would work. SimpleFSDP
under TP also splits the experts over the FSDP ranks, whose degree must
then divide them.
"""

from __future__ import annotations

# model_spec.name (after any "simple_fsdp/" prefix) -> the name users know.
FAMILY_NAMES = {
    "gpt_oss": "GPT-OSS",
    "llama3": "Llama 3",
    "deepseek_v3": "DeepSeek-V3",
    "qwen3": "Qwen3",
}

TP_FLAG = "--parallelism.tensor_parallel_degree"
EP_FLAG = "--parallelism.expert_parallel_degree"


def family_name(model_spec) -> str:
    name = model_spec.name.rsplit("/", 1)[-1]
    return FAMILY_NAMES.get(name, name)


def _divisors(n: int) -> str:
    """'1, 2, 4 or 8': every degree that divides ``n``."""
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return found[0] if len(found) == 1 else ", ".join(found[:-1]) + " or " + found[-1]


def _counts(model_config, what: str) -> set[int]:
    """Every layer's value of ``what`` (attention heads or experts)."""
    values = set()
    for layer in getattr(model_config, "layers", []):
        if what == "experts":
            moe = getattr(layer, "moe", None)
            value = getattr(moe, "num_experts", None) if moe is not None else None
        else:
            attention = getattr(layer, "attention", None)
            value = getattr(attention, what, None)
        if isinstance(value, int) and value > 0:
            values.add(value)
    return values


def _refusal(flag: str, degree: int, count: int, model: str, what: str) -> str:
    return (
        f"{flag} {degree} does not divide {model}'s {count} {what}; "
        f"use {_divisors(count)}."
    )


def model_layout_refusal(config, tp: int, ep: int, fsdp: int = 1) -> str | None:
    """The first degree the model cannot take, as a message, or None.
    ``fsdp`` is the data-parallel shard degree."""
    spec = config.model_spec
    model = family_name(spec)
    # KV heads first: they are the fewer, so their divisors are the answer.
    for what, label in (("n_kv_heads", "KV heads"), ("n_heads", "query heads")):
        for count in sorted(_counts(spec.model, what)):
            if count % tp:
                return _refusal(TP_FLAG, tp, count, model, label)
    for count in sorted(_counts(spec.model, "experts")):
        if count % ep:
            return _refusal(EP_FLAG, ep, count, model, "experts")
    # SimpleFSDP shards a TP parameter's TP-local dim 0 over the FSDP ranks;
    # under TP without EP that is the experts' count, which the FSDP degree
    # must divide (a 1 MiB module may be replicated instead, experts may not:
    # parallelize.replicate_unevenly_sharded).
    if spec.name.startswith("simple_fsdp/") and tp > 1 and ep == 1 and fsdp > 1:
        for count in sorted(_counts(spec.model, "experts")):
            if count % fsdp:
                return (
                    f"SimpleFSDP cannot shard {model}'s {count} experts over "
                    f"{fsdp} FSDP ranks (world size / {TP_FLAG} {tp}): under "
                    f"tensor parallelism FSDP splits the experts themselves, "
                    f"so its degree must divide {count}. Choose {TP_FLAG} and "
                    f"a world size whose quotient is {_divisors(count)}, or "
                    f"split the experts with {EP_FLAG}."
                )
    return None
