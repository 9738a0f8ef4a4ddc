"""The layout a run asks for fits its ranks: NGPU against the devices
present, torchtitan's ``ParallelDims`` refusals translated into the flags to
change, the model's own constraints (``model_layout``), the sequence length
and the batch arithmetic.
"""

from __future__ import annotations

import os

from torchtitan_neuron.preflight.errors import PreflightError
from torchtitan_neuron.preflight.model_layout import model_layout_refusal


def check_ngpu(ngpu: int, platform_name: str, devices: int | None,
               cpu_cores: int | None = None) -> str | None:
    """Refuse more ranks than devices; on CPU return a note when ranks
    outnumber cores."""
    if ngpu < 1:
        raise PreflightError(f"NGPU={ngpu}: the number of ranks must be at least 1.")
    if platform_name == "cpu":
        cores = cpu_cores or os.cpu_count() or 1
        if ngpu > cores:
            return (f"NGPU={ngpu} CPU ranks on {cores} cores: ranks share cores "
                    "(oversubscribed), so steps are slower; results are the same.")
        return None
    if devices is not None and ngpu > devices:
        kind = "NeuronCores" if platform_name == "neuron" else "GPUs"
        tool = "neuron-ls" if platform_name == "neuron" else "nvidia-smi"
        raise PreflightError(
            f"NGPU={ngpu} but this host has {devices} {kind} (see {tool}): the "
            f"missing ranks would wait forever. Set NGPU={devices} or fewer."
        )
    return None


# torchtitan's ParallelDims names each degree by its field; these are the
# flags that set them.
_DEGREE_FLAGS = {
    "dp_replicate": "--parallelism.data_parallel_replicate_degree",
    "cp": "--parallelism.context_parallel_degree",
    "tp": "--parallelism.tensor_parallel_degree",
    "pp": "--parallelism.pipeline_parallel_degree",
    "ep": "--parallelism.expert_parallel_degree",
}
# The degrees whose product, with dp_shard, must be the number of ranks.
_MESH_DEGREES = ("dp_replicate", "cp", "tp", "pp")


def _translate_parallel_dims(p, world: int, who: str, exc: AssertionError) -> PreflightError:
    """torchtitan's ParallelDims refused the degrees (an assert with its own
    field names): say which flag is wrong and what to set instead."""
    degrees = {
        "dp_replicate": p.data_parallel_replicate_degree,
        "cp": p.context_parallel_degree,
        "tp": p.tensor_parallel_degree,
        "pp": p.pipeline_parallel_degree,
        "ep": p.expert_parallel_degree,
    }
    for name, degree in degrees.items():
        if degree < 1:
            return PreflightError(
                f"{_DEGREE_FLAGS[name]} {degree}: a parallel degree is at least 1."
            )
    dp_shard = p.data_parallel_shard_degree
    if dp_shard != -1 and dp_shard < 1:
        return PreflightError(
            f"--parallelism.data_parallel_shard_degree {dp_shard}: use -1 (every "
            "rank the other degrees leave) or a degree of at least 1."
        )
    product = 1
    for name in _MESH_DEGREES:
        product *= degrees[name]
    named = " x ".join(f"{_DEGREE_FLAGS[n]} {degrees[n]}" for n in _MESH_DEGREES
                       if degrees[n] > 1) or "1"
    if dp_shard == -1:
        return PreflightError(
            f"{who} is not divisible by {named} = {product}: the "
            "data-parallel shard degree (-1, the rest) would not be whole. "
            f"Use NGPU a multiple of {product}, or degrees whose product "
            f"divides {world}."
        )
    if product * dp_shard != world:
        return PreflightError(
            f"{named} x --parallelism.data_parallel_shard_degree {dp_shard} = "
            f"{product * dp_shard} ranks, but {who}. Set "
            "--parallelism.data_parallel_shard_degree=-1 to shard over the rest, "
            f"or NGPU={product * dp_shard}."
        )
    # A refusal this translation does not know: upstream's own words.
    return PreflightError(f"torchtitan's ParallelDims refused the layout for {who}: {exc}")


def pipeline_refusal(config, pp: int) -> str | None:
    """Why ``pp`` pipeline stages cannot run on this recipe, or None.

    A SimpleFSDP recipe's spec pipelines with graph_trainer's GraphPP
    (``graph_pipeline_llm``), which torchtitan 0.3.0 runs only in
    ``aot_fx_trace`` mode (graph_pp/pipeline.py, ``_validate_graph_pp_config``);
    these recipes run in jit mode, so every rank would stop there after
    building its mesh."""
    if pp <= 1:
        return None
    pipelining = getattr(config.model_spec, "pipelining_fn", None)
    mode = getattr(config.compile, "mode", None)
    if getattr(pipelining, "__name__", "") == "graph_pipeline_llm" and mode == "jit":
        return (
            f"--parallelism.pipeline_parallel_degree {pp}: this SimpleFSDP recipe "
            "pipelines with graph_trainer's GraphPP, which torchtitan 0.3.0 runs only "
            "in aot_fx_trace mode, and SimpleFSDP recipes run in jit mode. Drop the "
            "flag and shard over more ranks (--parallelism.data_parallel_shard_degree "
            "-1), or plan the layout with python -m torchtitan_neuron.plan --sweep."
        )
    return None


def pipeline_stages_refusal(config, dims) -> str | None:
    """Why torchtitan's ``pipeline_llm`` would refuse these stages on every
    rank, or None: its own stage arithmetic, run here before any rank starts.
    (The microbatch size against the local batch is checked at parse time.)"""
    if dims.pp <= 1:
        return None
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _get_pipeline_metadata,
    )

    p = config.parallelism
    flag = f"--parallelism.pipeline_parallel_degree {dims.pp}"
    try:
        stages, layers, first, last = _get_pipeline_metadata(dims, p, config.model_spec.model)
        _generate_llm_fqn_per_model_part(stages, layers, first, last)
    except ValueError as exc:
        return (f"{flag}: torchtitan cannot split the model into pipeline stages: {exc} "
                "(--parallelism.pipeline_parallel_schedule, "
                "--parallelism.pipeline_parallel_layers_per_stage)")
    return microbatch_refusal(config, dims.pp, stages)


def microbatch_refusal(config, pp: int, stages: int) -> str | None:
    """Why torch's schedule would refuse this many microbatches when it is
    built, on every rank, or None: its constructors' own conditions (torch
    2.14.1 ``schedules.py``), checked before any rank starts."""
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        get_schedule_class,
    )

    p, t = config.parallelism, config.training
    name = p.pipeline_parallel_schedule
    if p.pipeline_parallel_schedule_csv:
        return None
    schedule = get_schedule_class(name)
    micro = p.pipeline_parallel_microbatch_size
    n = t.local_batch_size // micro
    counts = (f"--training.local_batch_size {t.local_batch_size} in microbatches of "
              f"--parallelism.pipeline_parallel_microbatch_size {micro} gives {n}")
    if issubclass(schedule, (Schedule1F1B, ScheduleDualPipeV)) and n < stages:
        return (f"--parallelism.pipeline_parallel_schedule {name}: {counts} microbatches, "
                f"and {name} needs at least one per stage ({stages}). Raise the local batch "
                f"to {stages * micro} or more, or pick GPipe")
    if issubclass(schedule, (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)):
        rounds = max(1, n // pp)
        if n % rounds:
            return (f"--parallelism.pipeline_parallel_schedule {name}: {counts} microbatches, "
                    f"and {name} needs a multiple of its {rounds} rounds (microbatches // "
                    f"{pp} pipeline ranks). Use a local batch of {rounds * micro * (n // rounds)} "
                    f"or {rounds * micro * (n // rounds + 1)}")
    return None


def context_parallel_refusal(config, cp: int) -> str | None:
    """Why ``cp`` context-parallel ranks cannot run on this recipe, or None.

    Context parallelism here gathers the keys and values over ``cp`` and
    attends under a mask of global positions
    (``components/context_parallel.py``); it takes SDPA attention, causal or
    block-causal. GPT-OSS's sink attention builds its sliding-window mask and
    its sink column from the rank's own rows, which that mask does not carry."""
    if cp <= 1:
        return None
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for index, layer in enumerate(getattr(config.model_spec.model, "layers", [])):
        attention = getattr(layer, "attention", None)
        inner = getattr(attention, "inner_attention", None)
        if inner is None or isinstance(inner, ScaledDotProductAttention.Config):
            continue
        name = type(inner).__qualname__.removesuffix(".Config")
        why = ("its sliding-window mask and sink logits are built from the rank's "
               "own rows, not from the whole sequence's positions"
               if name == "SinkSDPA" else "it is not SDPA attention")
        return (
            f"--parallelism.context_parallel_degree {cp}: layer {index}'s attention is "
            f"{name}; context parallelism here gathers keys and values for SDPA "
            f"attention (causal or block_causal) only, and {why}. Use "
            "--parallelism.context_parallel_degree 1, and shard a long sequence's "
            "memory with more FSDP ranks or full activation checkpointing."
        )
    return None


def check_layout(config, ngpu: int, nnodes: int = 1) -> dict:
    """The parallel degrees, sequence length and batch sizes fit NGPU ranks.
    Returns the resolved layout. ``ngpu`` is ranks per node; the layout
    spans ``ngpu x nnodes``.

    The degrees are validated by torchtitan's own ``ParallelDims`` (what
    every rank builds), whose refusals are asserts in its field names; they
    are translated here into the flags to change.
    """
    from torchtitan.distributed.parallel_dims import ParallelDims

    world = ngpu * nnodes
    who = f"NGPU={ngpu}" if nnodes == 1 else f"NGPU={ngpu} x NNODES={nnodes} = {world} ranks"
    p, t = config.parallelism, config.training
    try:
        dims = ParallelDims.from_config(p, world)
    except AssertionError as exc:
        raise _translate_parallel_dims(p, world, who, exc) from None
    refusal = (pipeline_refusal(config, dims.pp)
               or pipeline_stages_refusal(config, dims)
               or context_parallel_refusal(config, dims.cp)
               or model_layout_refusal(config, dims.tp, dims.ep, dims.dp_shard))
    if refusal:
        raise PreflightError(refusal)
    divisor = dims.seq_len_divisor
    # Only tensor or context parallelism split a sequence (divisor 2 alone is
    # the CP load-balancing factor with no CP).
    if divisor > 2 and t.seq_len % divisor:
        fix = -(-t.seq_len // divisor) * divisor
        raise PreflightError(
            f"--training.seq_len {t.seq_len} is not divisible by {divisor} "
            f"(2 x tensor-parallel degree {dims.tp} x context-parallel degree {dims.cp}: "
            "sequence parallelism splits each sequence across the TP ranks). "
            f"Use --training.seq_len {fix}, or another multiple of {divisor}."
        )
    if t.local_batch_size < 1:
        raise PreflightError(f"--training.local_batch_size {t.local_batch_size}: at least 1.")
    # torchtitan's Trainer asserts this after building the mesh, on every rank.
    dp = dims.dp_replicate * dims.dp_shard
    per_step = t.local_batch_size * dp
    if t.global_batch_size > 0 and t.global_batch_size % per_step:
        lower = max(per_step, t.global_batch_size // per_step * per_step)
        raise PreflightError(
            f"--training.global_batch_size {t.global_batch_size} is not a multiple "
            f"of --training.local_batch_size {t.local_batch_size} x data-parallel "
            f"degree {dp} = {per_step} sequences per accumulation step. Use "
            f"--training.global_batch_size {lower} or {lower + per_step}, or "
            "another multiple."
        )
    return {"tp": dims.tp, "dp_shard": dims.dp_shard, "dp": dp}
