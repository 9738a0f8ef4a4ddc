"""SimpleFSDP parallelization for the Neuron JIT path (Llama, DeepSeek, GPT-OSS).

Upstream's graph_trainer ``parallelize_llama`` / ``parallelize_deepseekv3`` in
0.3.0 apply TP (and EP), SimpleFSDP and compile but ignore ``ac_config``. This
is the same sequence, built from upstream's pieces, with activation
checkpointing and reshard-after-forward applied between TP and SimpleFSDP.
"""

import sys
from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
from torchtitan.experiments.graph_trainer.common_utils import (
    annotate_module_fqns,
    annotate_moe_ep_regions,
    apply_simple_fsdp,
)
from torchtitan.experiments.graph_trainer.compile import apply_compile
from torchtitan.experiments.graph_trainer.deepseek_v3.parallelize import (
    annotate_deepseekv3,
)
from torchtitan.experiments.graph_trainer.llama3.parallelize import annotate_llama
from torchtitan.experiments.graph_trainer.simple_fsdp import (
    MixedPrecisionPolicy,
    ReplicateComputation,
    _distribute_dtensor,
    _register_parametrization,
    data_parallel,
)
from torchtitan.tools.logging import logger

from torchtitan_neuron.components.context_parallel import apply_gathered_cp
from torchtitan_neuron.experiments.graph_trainer import chunked_loss
from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import (
    apply_activation_checkpointing,
    reshard_after_forward,
)
from torchtitan_neuron.experiments.graph_trainer.bucketing import DEFAULT_BUCKET_MIB, bucket_blocks
from torchtitan_neuron.preflight.model_layout import divisors
from torchtitan_neuron.experiments.graph_trainer.prefetch import enable_prefetch


def parallelize_simple_fsdp(
    model,
    *,
    annotate: Callable,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder: str,
):
    """TP/EP, then activation checkpointing, then SimpleFSDP, then torch.compile."""
    if training.seq_len % parallel_dims.seq_len_divisor != 0:
        raise ValueError(
            f"--training.seq_len {training.seq_len} must be divisible by "
            f"{parallel_dims.seq_len_divisor} (TP degree {parallel_dims.tp} x "
            f"2 x CP degree {parallel_dims.cp}); change the sequence length or "
            "the parallel degrees"
        )
    if parallel_dims.cp_enabled:
        # Keys and values gathered over cp inside the graph, in place of
        # upstream's apply_cp_to_attention (CUDA ring kernels only).
        apply_gathered_cp(model, parallel_dims.get_mesh("cp"), training.seq_len,
                          parallelism.context_parallel_load_balancer)
    frozen = frozen_parameters(model)
    # Annotate before AC wraps the blocks, so FX nodes carry clean module FQNs.
    annotate(model)
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    shard_experts_over_efsdp(model, parallel_dims=parallel_dims, training=training)
    apply_activation_checkpointing(model, ac_config, dump_folder,
                                   getattr(compile_config, "memory_policy", "eager"))
    replicate_unevenly_sharded(model, parallel_dims=parallel_dims, training=training)
    model = apply_simple_fsdp(model, parallel_dims=parallel_dims, training=training)
    refreeze(frozen)
    # graph_trainer's own reading of the flag (memory_policy.py): "default"
    # reshards unless pipeline parallelism is on.
    reshard = get_fsdp_reshard_after_forward_policy(
        parallelism.fsdp_reshard_after_forward, pp_enabled=parallel_dims.pp_enabled)
    reshard_after_forward(model, reshard)
    bucketing = getattr(compile_config, "bucketing", True) and parallel_dims.fsdp_enabled
    param_dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]
    reduce_dtype = TORCH_DTYPE_MAP[training.mixed_precision_reduce]
    if bucketing or (not reshard and parallel_dims.fsdp_enabled):
        bucket_mib = getattr(compile_config, "bucket_mib", DEFAULT_BUCKET_MIB)
        blocks, params, buckets = bucket_blocks(
            model, param_dtype, reduce_dtype, bucket_mib if bucketing else None,
            reshard_after_forward=reshard)
        if bucketing:
            logger.info(f"SimpleFSDP bucketing: {params} parameters of {blocks} blocks in "
                        f"{buckets} gathers of at most {bucket_mib} MiB "
                        "(--compile.no-bucketing: per parameter)")
    if not reshard:
        logger.info("SimpleFSDP keeps the gathered parameters from forward to backward "
                    "(--parallelism.fsdp_reshard_after_forward "
                    f"{parallelism.fsdp_reshard_after_forward}): no gather in backward, "
                    "every rank holds the whole model's parameters during the step")
    # The chunked loss gathers lm_head once per microbatch, not once per chunk.
    if bucketing and chunked_loss.mark(getattr(model, "lm_head", None), param_dtype,
                                       reduce_dtype):
        logger.info("SimpleFSDP bucketing: lm_head gathered once per microbatch for the "
                    "chunked loss, its gradient reduce-scattered once")
    if getattr(compile_config, "overlap_collectives", False) and compile_config.enable:
        overlap_collectives(compile_config.backend)
    if getattr(compile_config, "prefetch", True) and compile_config.enable:
        enable_prefetch(compile_config.backend)
    return apply_compile(
        model,
        compile_config=compile_config,
        parallelism=parallelism,
        parallel_dims=parallel_dims,
        dump_folder=dump_folder,
    )


def frozen_parameters(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every parameter that does not train (a LoRA base)."""
    return [(module, name) for module in model.modules()
            for name, p in module.named_parameters(recurse=False) if not p.requires_grad]


def refreeze(frozen: list[tuple[nn.Module, str]]) -> None:
    """Freeze again what ``frozen_parameters`` found: TP's and SimpleFSDP's
    ``nn.Parameter(distribute_tensor(...))`` re-register each parameter with
    ``requires_grad=True`` (upstream's ``data_parallel``, torchtitan 0.3.0),
    which gave a LoRA base gradients and optimizer state."""
    for module, name in frozen:
        module._parameters[name].requires_grad_(False)


def shard_experts_over_efsdp(model: nn.Module, *, parallel_dims, training) -> int:
    """Under expert parallelism, shard each MoE layer's experts over the
    expert-FSDP mesh (``efsdp``), as upstream's ``apply_simple_fsdp`` does,
    before activation checkpointing wraps the blocks.

    ``apply_simple_fsdp`` finds the experts through ``TransformerBlock``
    instances; here AC has wrapped each block by then, so it would miss
    them, and its whole-model pass would then shard the EP-sharded experts
    again over ``fsdp``, which overlaps ``ep`` ("Cannot concatenate
    overlapping meshes"). Sharded here, the experts' class is a SimpleFSDP
    one, which every later pass skips. Returns the MoE layers sharded."""
    if not parallel_dims.ep_enabled:
        return 0
    names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
    edp_mesh = parallel_dims.get_optional_mesh(names)
    mode = "hybrid_shard" if parallel_dims.dp_replicate_enabled else "fully_shard"
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
    )
    sharded = 0
    for block in getattr(model, "layers", {}).values():
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        experts = moe.routed_experts.inner_experts
        # Upstream's rule: shard the experts' own dim when there are fewer
        # experts than expert-FSDP x EP ranks.
        dim = 1 if edp_mesh["efsdp"].size() * parallel_dims.ep > experts.num_experts else 0
        moe.routed_experts.inner_experts = data_parallel(
            experts, edp_mesh, mode, mp_policy=mp_policy, shard_dim=dim)
        sharded += 1
    return sharded


# The most elements per TP rank a module's own parameters may hold and still
# be kept replicated over FSDP: a replica costs its fp32 parameter, gradient
# and two Adam moments on every FSDP rank (16 bytes an element), so this is
# 1 MiB a module. GPT-OSS's sinks are 64 values a layer; its experts, the
# next module with a TP-local dim 0 FSDP may not divide, are hundreds of
# millions.
REPLICATE_LIMIT = 65536


def uneven_refusal(name: str, param, degree: int) -> str:
    """The message for a parameter too large to replicate: it names the
    parameter, its TP-local dim 0 and the FSDP degrees that divide it."""
    rows = param.to_local().shape[0] if param.to_local().ndim else 1
    fits = divisors(rows, start=2, up_to=degree)[-4:]
    return (
        f"SimpleFSDP cannot shard {name} (TP-local shape "
        f"{tuple(param.to_local().shape)}) over {degree} FSDP ranks: {degree} "
        f"does not divide its {rows} rows, and at "
        f"{param.to_local().numel():,} elements per TP rank it is too large to "
        f"keep replicated. Choose an FSDP degree (world size / "
        f"--parallelism.tensor_parallel_degree) that divides {rows}"
        + (f", e.g. {', '.join(map(str, fits))}" if fits else "")
        + ", or split it with --parallelism.expert_parallel_degree."
    )


# One subclass per module class whose parameters stay replicated over FSDP;
# see replicate_unevenly_sharded.
_REPLICATED_CLASSES: dict[type, type] = {}


def _replicated_class(cls: type) -> type:
    """A subclass of ``cls`` of its own, so SimpleFSDP's wrapper-class cache
    (keyed by class and parameter names, holding the first instance's
    parametrization) gives the replicated modules a ``SimpleFSDP`` class
    apart from the sharded modules of the same class in other models."""
    if cls not in _REPLICATED_CLASSES:
        sub = type(f"FsdpReplicated{cls.__name__}", (cls,), {"__module__": __name__})
        # Importable, as upstream does for its wrapper classes, so that
        # pickle/GraphPickler can resolve it.
        setattr(sys.modules[__name__], sub.__name__, sub)
        _REPLICATED_CLASSES[cls] = sub
    return _REPLICATED_CLASSES[cls]


def replicate_unevenly_sharded(model: nn.Module, *, parallel_dims, training) -> list[str]:
    """Keep TP DTensor parameters that FSDP cannot shard evenly replicated
    over the FSDP ranks instead. Returns the names of the parameters kept so.

    Why: for a parameter already a DTensor (TP), SimpleFSDP 0.3.0 shards the
    TP-local tensor over FSDP (``_StridedShard``), and its gather re-wraps
    each rank's FSDP shard with ``DTensor.from_local(shard, fsdp_mesh,
    (Shard(0),))``, which takes the global size to be the local shard's
    times the FSDP degree. When the TP-local dim 0 is not a multiple of the
    FSDP degree the shards are uneven (some ranks hold one row, some none)
    and the gathered tensor has the wrong size: GPT-OSS-120B's 64 attention
    sinks at TP4 x FSDP32 are 16 per TP rank, one row on 16 FSDP ranks and
    none on the other 16, and the gather returns 32. Plain (non-TP)
    parameters are unaffected: their gather keeps the true global shape.

    Replicating them is what upstream's ``data_parallel(mode="replicate")``
    does to a module's own parameters, on the FSDP mesh, done here to the
    modules that own such parameters before ``apply_simple_fsdp`` (which
    skips modules already wrapped, as it does for expert modules wrapped on
    their own mesh): no gather in the forward, an all-reduce of the gradient
    in the backward. ``data_parallel`` itself is not called on them: it
    would recurse into the children (GPT-OSS attention's wq/wk/wv/wo), which
    must stay sharded. A module is wrapped as a whole, so every parameter it
    owns itself is replicated; for GPT-OSS that is the attention's ``sinks``
    alone (64 values a layer).

    Only small modules are replicated: one whose own parameters hold more
    than ``REPLICATE_LIMIT`` elements per TP rank raises ``ValueError``
    (``uneven_refusal``) instead, since a replica of it would cost its full
    optimizer state on every FSDP rank. ``model_layout_refusal`` refuses
    the case users meet (experts under TP with an FSDP degree that does not
    divide their number) before any rank starts.

    Only with FSDP alone on its mesh (no HSDP): upstream's replicate mode
    takes a 1-D mesh. Expert modules wrapped by upstream on the EP mesh are
    left to it.
    """
    if not (parallel_dims.tp_enabled or parallel_dims.ep_enabled):
        return []
    if parallel_dims.dp_replicate_enabled:
        return []
    fsdp_mesh = parallel_dims.get_mesh(["fsdp"])
    degree = fsdp_mesh.size()
    if degree == 1:
        return []
    skip = set()
    if parallel_dims.ep_enabled:
        for module in model.modules():
            routed = getattr(getattr(module, "moe", None), "routed_experts", None)
            if routed is not None:
                skip.update(id(m) for m in routed.inner_experts.modules())
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
    )
    placements = (Replicate(),)
    kept = []
    for name, module in model.named_modules():
        if id(module) in skip:
            continue
        own = dict(module.named_parameters(recurse=False))
        uneven = [
            p_name for p_name, p in own.items()
            if isinstance(p, DTensor) and p.numel() > 0
            and (p.to_local().ndim == 0 or p.to_local().shape[0] % degree != 0)
        ]
        if not uneven:
            continue
        local = sum(p.to_local().numel() for p in own.values() if p is not None)
        if local > REPLICATE_LIMIT:
            raise ValueError(uneven_refusal(f"{name}.{uneven[0]}" if name else uneven[0],
                                            own[uneven[0]], degree))
        # The body of upstream's data_parallel loop for one module, mode
        # "replicate", without the recursion.
        for p_name, p in own.items():
            if p is None or p.numel() == 0:
                continue
            distribute = _distribute_dtensor if isinstance(p, DTensor) else distribute_tensor
            module.register_parameter(
                p_name, nn.Parameter(distribute(p, fsdp_mesh, placements))
            )
        module.__class__ = _replicated_class(type(module))
        _register_parametrization(
            module, list(own),
            ReplicateComputation(fsdp_mesh, placements, "replicate", mp_policy=mp_policy),
        )
        kept += [f"{name}.{p_name}" if name else p_name for p_name in own]
    if kept:
        logger.info(
            "SimpleFSDP: %d parameters kept replicated over the %d FSDP ranks "
            "(TP-local dim 0 not a multiple of it), e.g. %s",
            len(kept), degree, kept[0],
        )
    return kept


def parallelize_llama(model, **kwargs):
    return parallelize_simple_fsdp(model, annotate=annotate_llama, **kwargs)


def parallelize_deepseekv3(model, **kwargs):
    return parallelize_simple_fsdp(model, annotate=annotate_deepseekv3, **kwargs)


def annotate_gpt_oss(model) -> None:
    """graph_trainer has no GPT-OSS recipe; these are the annotations its
    ``annotate_deepseekv3`` attaches to an MoE decoder: the MoE dispatch,
    combine and compute regions, and every submodule's FQN."""
    annotate_moe_ep_regions()
    annotate_module_fqns(model)


def parallelize_gpt_oss(model, **kwargs):
    return parallelize_simple_fsdp(model, annotate=annotate_gpt_oss, **kwargs)


# torch._inductor.config's built-in reordering passes, in execution order.
OVERLAP_PASSES = ["sink_waits", "raise_comms", "reorder_compute_for_overlap"]


def overlap_collectives(backend: str) -> bool:
    """Turn on inductor's compute/communication reordering for ``backend``
    ``inductor`` (``--compile.overlap_collectives``); other backends never
    run inductor's scheduler. Returns whether it was applied."""
    if backend != "inductor":
        logger.info(f"--compile.overlap_collectives: compile backend {backend} is not "
                    "inductor, left as it is")
        return False
    import torch._inductor.config as inductor_config

    inductor_config.reorder_for_compute_comm_overlap = True
    inductor_config.reorder_for_compute_comm_overlap_passes = list(OVERLAP_PASSES)
    logger.info("--compile.overlap_collectives: inductor reorders collectives against "
                f"compute ({', '.join(OVERLAP_PASSES)})")
    return True
