"""One all-gather per transformer block for SimpleFSDP (experimental).

SimpleFSDP gathers each parameter through its own property getter, one
collective per parameter per use. ``bucket_blocks`` gives every transformer
block one gather for all of its FSDP-sharded parameters: the local shards
are concatenated, cast to ``param_dtype`` and all-gathered once; the full
parameters are views into the result. The backward of that gather is one
reduce-scatter in ``reduce_dtype``. It is expressed in the model's code, so
every compile backend receives it.

Scope of this version: FSDP only (parameters sharded on dim 0 of a 1-D FSDP
mesh, even shards); other layouts keep the per-parameter gathers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

_BUCKET = "_torchtitan_neuron_bucket"


class _GatherBucket(torch.autograd.Function):
    """all-gather of one flat shard in param_dtype; backward: reduce-scatter
    of the flat gradient in reduce_dtype."""

    @staticmethod
    def forward(ctx, flat, group_name: str, world: int, param_dtype, reduce_dtype):
        ctx.group_name, ctx.world = group_name, world
        ctx.reduce_dtype, ctx.dtype = reduce_dtype, flat.dtype
        gathered = funcol.all_gather_tensor(flat.to(param_dtype), 0, group_name)
        return funcol.wait_tensor(gathered)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.to(ctx.reduce_dtype) if ctx.reduce_dtype is not None else grad
        out = funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 0, ctx.group_name)
        return funcol.wait_tensor(out).to(ctx.dtype), None, None, None, None


def _entries(block: nn.Module) -> list[tuple[nn.Module, str]]:
    found = []
    for module in block.modules():
        if not type(module).__name__.startswith("SimpleFSDP"):
            continue
        for name, param in module._parameters.items():
            if isinstance(param, DTensor) and param._spec.mesh.ndim == 1 \
                    and param.placements == (Shard(0),):
                found.append((module, name))
    return found


def _gather(group_name, world, param_dtype, reduce_dtype, shapes, *locals_):
    flat = torch.cat([t.reshape(-1) for t in locals_])
    full = _GatherBucket.apply(flat, group_name, world, param_dtype, reduce_dtype)
    full = full.view(world, -1)
    out, start = [], 0
    for t, shape in zip(locals_, shapes):
        n = t.numel()
        out.append(full[:, start:start + n].reshape(shape))
        start += n
    return tuple(out)


def bucket_blocks(model: nn.Module, fsdp_mesh, param_dtype, reduce_dtype) -> int:
    """Give each block of ``model.layers`` one gather; returns the number of
    parameters bucketed."""
    group_name = fsdp_mesh.get_group().group_name
    world = fsdp_mesh.size()
    total = 0
    for block in model.layers.values():
        entries = _entries(block)
        if len(entries) < 2:
            continue
        if any(m._parameters[n].to_local().shape[0] * world != m._parameters[n].shape[0]
               for m, n in entries):
            continue  # uneven shards: left per parameter
        # Inside the block's AC region, so the gathered parameters are
        # recomputed with the block. The hand-off to the getters is a module
        # attribute set and cleared within the forward, a side effect Dynamo
        # refuses inside a checkpoint unless told not to replay it in the
        # backward's recompute (nothing to replay: it routes tensors only).
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        _install(inner, entries, group_name, world, param_dtype, reduce_dtype)
        total += len(entries)
    return total


def _install(block, entries, group_name, world, param_dtype, reduce_dtype):
    shapes = [tuple(m._parameters[n].shape) for m, n in entries]
    forward = block.forward

    def bucketed_forward(*args, **kwargs):
        locals_ = [m._parameters[n].to_local() for m, n in entries]
        full = checkpoint(_gather, group_name, world, param_dtype, reduce_dtype, shapes,
                          *locals_, use_reentrant=False, preserve_rng_state=False)
        for (m, n), t in zip(entries, full):
            m.__dict__.setdefault(_BUCKET, {})[n] = t
        try:
            return forward(*args, **kwargs)
        finally:
            for m, n in entries:
                m.__dict__[_BUCKET].pop(n, None)

    block.forward = bucketed_forward
    for cls in {type(m) for m, _ in entries}:
        for name, attr in list(vars(cls).items()):
            if isinstance(attr, property) and not getattr(attr.fget, _BUCKET, False):
                setattr(cls, name, property(_bucket_first(name, attr.fget)))


def _bucket_first(name, fget):
    def getter(module):
        bucket = module.__dict__.get(_BUCKET)
        if bucket and name in bucket:
            return bucket[name]
        return fget(module)

    setattr(getter, _BUCKET, True)
    return getter
