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


def divisors(n: int, *, start: int = 1, up_to: int | None = None) -> list[int]:
    """The divisors of ``n`` from ``start`` to ``up_to`` (default ``n``)."""
    return [d for d in range(start, min(n, up_to or n) + 1) if n % d == 0]


def _or_list(values) -> str:
    """'1, 2, 4 or 8'."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _divisors(n: int) -> str:
    """'1, 2, 4 or 8': every degree that divides ``n``."""
    return _or_list(divisors(n))


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
    # SimpleFSDP shards a TP parameter's TP-local dim 0 over the FSDP ranks,
    # whose degree must divide it (a 1 MiB module may be replicated instead,
    # these may not: parallelize.replicate_unevenly_sharded). Under TP that
    # is the embedding's and output's vocabulary rows per TP rank, and without
    # EP the experts' count.
    if spec.name.startswith("simple_fsdp/") and tp > 1 and fsdp > 1:
        rows = []
        if ep == 1:
            rows += [(count, f"{count} experts", f", or split the experts with {EP_FLAG}")
                     for count in sorted(_counts(spec.model, "experts"))]
        vocab = getattr(spec.model, "vocab_size", 0)
        if isinstance(vocab, int) and vocab > 0 and vocab % tp == 0:
            rows.append((vocab // tp,
                         f"embedding and output ({vocab // tp} vocabulary rows per TP "
                         f"rank: {vocab} / {TP_FLAG} {tp})",
                         f", or {TP_FLAG} 1 (FSDP alone shards any size), or "
                         "--parallelism.data_parallel_replicate_degree for the ranks "
                         "beyond it"))
        for count, what, other in rows:
            if count % fsdp:
                return (
                    f"SimpleFSDP cannot shard {model}'s {what} over {fsdp} FSDP "
                    f"ranks (world size / {TP_FLAG} {tp}): it shards each TP "
                    f"rank's part again over the FSDP ranks, so their number must "
                    f"divide {count}. Choose a layout whose FSDP degree is "
                    f"{_divisors_up_to(count, fsdp)}{other}."
                )
    return None


def _divisors_up_to(n: int, near: int) -> str:
    """The divisors of ``n`` closest below ``near`` (at most four), as '2, 4,
    8 or 16'."""
    return _or_list(divisors(n, up_to=near)[-4:])
