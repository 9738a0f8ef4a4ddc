"""Activation checkpointing and reshard-after-forward for SimpleFSDP in jit mode.

graph_trainer's ``parallelize_llama`` ignores ``ac_config`` in jit mode, so full
and selective AC silently do nothing there. This module applies them for real,
per transformer block, with torchtitan's own ``FullAC`` / ``SelectiveAC``. What
selective AC saves follows graph_trainer's ``--compile.memory_policy`` (which
upstream reads in aot_fx_trace mode only): ``eager``, this project's default,
recomputes every second matmul, as torchtitan's ``SelectiveAC`` does wherever
a recipe names it; ``default`` saves every matmul, as aot_fx_trace's default
graph pass does.
Under both, attention is saved on CPU as it is on CUDA and Neuron
(``AttentionSavingSAC``).

SimpleFSDP gathers each parameter inside the traced graph (the parametrization
``ReplicateComputation``). Whether the gathered copy lives until backward is a
save/recompute decision of the compiler's partitioner, not a module property:
if it is saved, every rank holds the whole model and FSDP saves nothing. So
resharding after forward is expressed as recomputation:

- full AC recomputes the whole block, the gathers included;
- selective AC's save list (``_get_default_save_ops``) does not contain
  ``all_gather_into_tensor``, so gathers are recomputed;
- with no AC, each parameter's gather is wrapped in its own checkpoint
  region, so only the gather (and its dtype cast) is recomputed in backward.

``--parallelism.fsdp_reshard_after_forward never`` keeps the gathered
parameters for backward instead, as it does for FSDP2 and upstream's
aot_fx_trace mode: the getters run without the checkpoint, and a block with
AC gathers its parameters before its AC region (``bucketing.bucket_blocks``),
so AC cannot recompute them either.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torchtitan.distributed.activation_checkpoint import SelectiveAC

from torchtitan.tools.logging import logger

from torchtitan_neuron.config_utils import promote

_RESHARD_MARK = "_torchtitan_neuron_reshard"
# Set on a module instance whose gathered parameters are kept for backward.
_KEEP_GATHERED = "_torchtitan_neuron_keep_gathered"


def _recompute_in_backward(fget):
    def gathered_parameter(module):
        if module.__dict__.get(_KEEP_GATHERED):
            return fget(module)
        # Only the checkpointed function's output would be saved, and
        # non-reentrant checkpoint saves nothing but the sharded input: the
        # gathered parameter is rebuilt when backward needs it.
        return checkpoint(fget, module, use_reentrant=False, preserve_rng_state=False)

    setattr(gathered_parameter, _RESHARD_MARK, True)
    return gathered_parameter


def is_simple_fsdp_module(module: nn.Module) -> bool:
    """Whether ``module`` is one of SimpleFSDP's generated ``SimpleFSDP<Module>``
    classes, whose parameters are gathered by property getters (upstream
    tells them apart by the same name)."""
    return type(module).__name__.startswith("SimpleFSDP")


def reshard_after_forward(model: nn.Module, reshard: bool = True) -> int:
    """Make every SimpleFSDP parameter gather recomputed in backward, or,
    with ``reshard=False``, kept from forward to backward.

    SimpleFSDP installs one property per parameter on a generated
    ``SimpleFSDP<Module>`` class. Each property getter is wrapped in a
    checkpoint, once (classes are shared between models, so this is
    idempotent); whether it checkpoints is a mark on each module of this
    model. Returns the number of getters wrapped now.
    """
    wrapped = 0
    for module in model.modules():
        if not is_simple_fsdp_module(module):
            continue
        cls = type(module)
        if reshard:
            module.__dict__.pop(_KEEP_GATHERED, None)
        else:
            module.__dict__[_KEEP_GATHERED] = True
        for name, attr in list(vars(cls).items()):
            if not isinstance(attr, property) or getattr(attr.fget, _RESHARD_MARK, False):
                continue
            setattr(cls, name, property(_recompute_in_backward(attr.fget)))
            wrapped += 1
    return wrapped


class AttentionSavingSAC(SelectiveAC):
    """torchtitan's selective AC, with attention saved on CPU as on CUDA and Neuron.

    torchtitan's save list (``_get_default_save_ops``) holds CUDA's flash and
    efficient SDPA kernels and Neuron's
    ``_scaled_dot_product_fused_attention_overrideable``, but not CPU's
    ``_scaled_dot_product_flash_attention_for_cpu``, so on CPU ranks
    attention ran twice per layer: in forward, and again in backward. Saving
    it (its output and log-sum-exp, as on the devices) makes a CPU rehearsal
    recompute what a device run recomputes. Overriding ``get_save_ops`` is
    upstream's documented way to tune the list.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return SelectiveAC.get_save_ops(self) | {
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


class SaveEveryMatmulSAC(AttentionSavingSAC):
    """Selective AC under jit mode's ``--compile.memory_policy default``:
    every op of the save list is saved, every matmul included, as
    graph_trainer's ``_make_default_memory_policy`` does in its aot_fx_trace
    mode; torchtitan's eager ``SelectiveAC`` recomputes every second matmul.
    Its block wrapper is ``save_every_matmul``."""

    @dataclass(kw_only=True, slots=True)
    class Config(AttentionSavingSAC.Config):
        pass

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        return save_every_matmul(self, module, base_fqn=base_fqn)


def save_attention(ac_config, memory_policy: str = "eager"):
    """``ac_config`` with torchtitan's ``SelectiveAC`` promoted to
    ``AttentionSavingSAC`` (``memory_policy`` ``eager``) or
    ``SaveEveryMatmulSAC`` (``default``); any other policy (full, none, a
    subclass a user chose, whose own ``_wrap_block`` then applies) as it is."""
    if type(ac_config) in (SelectiveAC.Config, AttentionSavingSAC.Config):
        chosen = SaveEveryMatmulSAC if memory_policy == "default" else AttentionSavingSAC
        return promote(ac_config, chosen.Config)
    return ac_config


# graph_trainer's ``--compile.memory_policy`` choices (GraphTrainerCompileConfig)
# and what each means for the recipe's AC in jit mode.
JIT_MEMORY_POLICIES = ("default", "eager")


def apply_activation_checkpointing(
    model: nn.Module, ac_config, dump_folder: str, memory_policy: str = "eager"
) -> None:
    """Apply full or selective AC per transformer block (None: no block AC).

    Selective AC follows graph_trainer's ``--compile.memory_policy``, as
    upstream's ``aot_fx_trace`` mode does: ``eager`` (the default here)
    recomputes every second matmul, as torchtitan's ``SelectiveAC`` does;
    ``default`` saves every op of the save list, every matmul included
    (graph_trainer's ``_make_default_memory_policy``).
    """
    check_memory_policy(ac_config, memory_policy)
    ac_config = save_attention(ac_config, memory_policy)
    if ac_config is None:
        logger.info("Activation checkpointing: none (parameter gathers still recomputed)")
        return
    policy = ac_config.build(dump_folder=dump_folder)
    policy.apply(model)
    hash_selective_policies(model, ac_config)
    if isinstance(policy, SelectiveAC):
        what = {SaveEveryMatmulSAC: "every matmul saved",
                AttentionSavingSAC: "every second matmul recomputed"}.get(
                    type(policy), f"{type(policy).__qualname__}'s own policy")
        logger.info(f"Selective AC under --compile.memory_policy {memory_policy}: {what}")


def check_memory_policy(ac_config, memory_policy: str) -> None:
    """Refuse a ``--compile.memory_policy`` that jit mode cannot honour."""
    if memory_policy not in JIT_MEMORY_POLICIES:
        raise ValueError(
            f"--compile.memory_policy {memory_policy} is applied by graph_trainer's "
            "aot_fx_trace mode only; SimpleFSDP recipes run in jit mode, where the "
            "recipe's activation checkpointing decides: use a _fullac recipe for full "
            f"recomputation, or --compile.memory_policy {' / '.join(JIT_MEMORY_POLICIES)} "
            "with a selective one")
    # eager is the default and leaves full or no AC as it is; default names
    # what selective AC saves, so it needs a selective recipe.
    if memory_policy == "default" and not isinstance(ac_config, SelectiveAC.Config):
        raise ValueError(
            f"--compile.memory_policy {memory_policy} chooses what selective activation "
            f"checkpointing saves, but this recipe's is {ac_name(ac_config)}: drop the "
            "flag, or use a selective recipe")


def ac_name(ac_config) -> str:
    """``none``, ``selective`` or ``full``, as the CLI subcommand spells it."""
    qualname = type(ac_config).__qualname__.lower()
    for name in ("selective", "full"):
        if name in qualname:
            return name
    return "none"


def save_every_matmul(policy: SelectiveAC, module: nn.Module, *,
                      base_fqn: str | None = None) -> nn.Module:
    """``SelectiveAC._wrap_block`` without the alternation: every op of
    ``policy.get_save_ops()`` is saved, matmuls included, and everything else
    recomputed. What torchtitan's policy keeps: the matmuls of
    ``force_recompute_mm_shapes_by_fqns`` (the MoE router) are recomputed, and
    device-to-host copies are saved.
    """
    config = policy.config
    save_ops = policy.get_save_ops()
    recompute_shapes = set()
    for module_fqn, submod in module.named_modules():
        fqn = f"{base_fqn}.{module_fqn}" if base_fqn else module_fqn
        if any(f in fqn for f in config.force_recompute_mm_shapes_by_fqns):
            if not isinstance(submod, nn.Linear):
                raise ValueError("force_recompute_mm_shapes_by_fqns expected to match an "
                                 f"nn.Linear, but {fqn} is {type(submod).__name__}")
            out_f, in_f = submod.weight.shape
            recompute_shapes.add((in_f, out_f))

    def context_fn():
        return _save_every_matmul_contexts(save_ops, recompute_shapes)

    return ptd_checkpoint_wrapper(
        module,
        context_fn=context_fn,
        preserve_rng_state=config.preserve_rng_state,
        determinism_check=config.determinism_check,
        early_stop=False,
        debug=config.debug,
    )


_MM_OPS = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


def _save_every_matmul_contexts(save_ops, recompute_shapes):
    def policy_fn(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if (func == torch.ops.aten._to_copy.default and args[0].device.type != "cpu"
                and str(kwargs.get("device")) == "cpu"):
            return CheckpointPolicy.MUST_SAVE
        if func in _MM_OPS:
            shape = args[1].shape
            if func == torch.ops.aten.linear.default:
                shape = torch.Size((shape[1], shape[0]))
            if shape in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in save_ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy_fn)


def _closure_values(fn) -> dict:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code else {}


def _describe(value) -> str:
    """A stable text for what a selective policy closes over (op sets, shapes)."""
    if isinstance(value, (set, frozenset, list, tuple)):
        return "[" + ",".join(sorted(_describe(v) for v in value)) + "]"
    if callable(value) and hasattr(value, "__code__"):
        inner = _closure_values(value)
        return value.__qualname__ + "{" + ",".join(
            f"{k}={_describe(v)}" for k, v in sorted(inner.items())) + "}"
    return str(value)


def named_context_fn(fn, cache_hash: str):
    """A module-level function calling ``fn``, with ``cache_hash`` set.

    torch's cache-key pickler stores functions by qualified name, and
    torchtitan's ``context_fn`` is a local lambda, which cannot be pickled;
    Dynamo only accepts a plain function here. So each distinct policy gets
    a function registered in this module under a name made from its hash.
    Policies with equal hashes are the same policy, and share it.
    """
    name = f"_selective_ac_context_{cache_hash[:20]}"
    existing = globals().get(name)
    if existing is not None:
        return existing

    def context_fn():
        return fn()

    context_fn.__name__ = context_fn.__qualname__ = name
    context_fn.cache_hash = cache_hash
    globals()[name] = context_fn
    return context_fn


def policy_sources() -> list[str]:
    """The code that decides what a selective-AC policy saves: torchtitan's
    AC module, and this module (the jit memory policies, what they save by
    default). An edit to either gives every policy a new cache hash, so a
    cached graph compiled under the old policy is never served."""
    from torchtitan.distributed import activation_checkpoint as upstream

    return [inspect.getsource(upstream), inspect.getsource(sys.modules[__name__])]


def hash_selective_policies(model: nn.Module, ac_config) -> int:
    """Give each selective-AC ``context_fn`` the ``cache_hash`` torch's
    AOTAutograd cache asks for (``named_context_fn``).

    Without it, torch 2.14 bypasses the AOTAutograd cache for any graph with
    a selective-checkpoint region ("SAC context_fn does not have a
    cache_hash attribute"), so a second identical run compiled the model
    graph again from scratch. The hash covers what decides the policy: the
    code of the policies (``policy_sources``), the AC config, and the op set
    and matmul shapes each policy closes over. Returns the number hashed.
    """
    base = hashlib.sha256()
    for source in policy_sources():
        base.update(source.encode())
    base.update(repr(ac_config).encode())
    base.update(torch.__version__.encode())
    hashed = 0
    for module in model.modules():
        checkpoint_fn = getattr(module, "checkpoint_fn", None)
        context_fn = getattr(checkpoint_fn, "keywords", {}).get("context_fn")
        if context_fn is None or hasattr(context_fn, "cache_hash"):
            continue
        digest = base.copy()
        digest.update(_describe(context_fn).encode())
        checkpoint_fn.keywords["context_fn"] = named_context_fn(context_fn, digest.hexdigest())
        hashed += 1
    return hashed
