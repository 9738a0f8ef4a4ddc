"""The chunked loss with the output projection gathered once per microbatch.

torchtitan's chunked loss (``ChunkedLossWrapper``, 8 chunks in every recipe)
applies ``lm_head`` to each chunk of the sequence outside the compiled model,
and runs each chunk's backward before the next. Under FSDP2 it unshards
``lm_head`` once for the loop and reduce-scatters its gradient once, at the
last chunk. Under SimpleFSDP every use of the weight goes through its
parametrization: each chunk all-gathers the weight and reduce-scatters its
gradient, 8 gathers and 8 reduce-scatters a microbatch, all eager.

``SimpleFSDPChunkedLoss`` does what FSDP2 does. Before the loop it gathers each
FSDP-sharded ``lm_head`` parameter once in ``param_dtype`` (as the getter
would) into a leaf tensor the getter returns for every chunk; each chunk's
gradient is added to an accumulator in ``reduce_dtype`` (fp32, as the
reduce-scatter of each chunk's gradient would have it); after the loop one
reduce-scatter per parameter gives the sharded gradient. What each chunk
computes is unchanged. ``parallelize_simple_fsdp`` marks ``lm_head`` for this
when bucketing is on (``mark``); ``--compile.no-bucketing`` keeps upstream's
per-chunk gathers, and so do layouts bucketing leaves per parameter (HSDP,
DDP, shards on another dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.experiments.graph_trainer import simple_fsdp
from torchtitan.experiments.graph_trainer.chunked_loss import (
    ChunkedLossWrapperWithParamGrads,
    _ChunkedLossWrapperWithParamGrads,
)

from torchtitan_neuron.experiments.graph_trainer.bucketing import GATHERED_ATTR, fsdp_groups, gather_shards, override_getters

_ONCE = "_torchtitan_neuron_gather_once"


def mark(lm_head: nn.Module | None, param_dtype, reduce_dtype) -> int:
    """Have the chunked loss gather ``lm_head``'s FSDP-sharded parameters once
    per call. Returns how many parameters that covers (0: none, the loss
    then gathers per chunk as upstream does)."""
    if lm_head is None:
        return 0
    entries = [(g, e) for g, es in fsdp_groups(lm_head).items() for e in es]
    if not entries:
        return 0
    lm_head.__dict__[_ONCE] = (entries, param_dtype, reduce_dtype)
    override_getters(type(lm_head))
    return len(entries)


class _Once:
    """One call's gathered ``lm_head`` parameters and their accumulated
    gradients."""

    def __init__(self, lm_head: nn.Module) -> None:
        self.entries, self.param_dtype, self.reduce_dtype = lm_head.__dict__[_ONCE]
        self.leaves: list[torch.Tensor] = []
        self.sums: list[torch.Tensor | None] = []
        self.hooks: list = []

    def __enter__(self) -> _Once:
        for i, (group_name, e) in enumerate(self.entries):
            shard = e.module._parameters[e.name].to_local()
            with torch.no_grad():
                (full,) = gather_shards(group_name, self.param_dtype, None,
                                  ((e.rows, e.pad_rows, e.shape),), shard)
            # A frozen lm_head (a LoRA base) gets no gradient to reduce.
            trains = e.module._parameters[e.name].requires_grad
            leaf = full.detach().requires_grad_(trains)
            self.leaves.append(leaf)
            self.sums.append(None)
            if trains:
                self.hooks.append(leaf.register_post_accumulate_grad_hook(
                    lambda t, i=i: self._add(i, t)))
            view = leaf if e.tp is None else DTensor.from_local(leaf, e.tp[0], e.tp[1])
            e.module.__dict__.setdefault(GATHERED_ATTR, {})[e.name] = view
        return self

    def _add(self, i: int, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        dtype = self.reduce_dtype or grad.dtype
        if self.sums[i] is None:
            self.sums[i] = grad.to(dtype, copy=True)
        else:
            self.sums[i].add_(grad)

    def reduce(self) -> None:
        """One reduce-scatter (sum) per parameter of the accumulated
        gradient; the shard is added to the parameter's ``.grad``."""
        for i, (group_name, e) in enumerate(self.entries):
            total, self.sums[i] = self.sums[i], None
            if total is None:
                continue
            param = e.module._parameters[e.name]
            # Rows of the padded gathered parameter: pad_rows from every FSDP rank.
            short = e.numel // math.prod(e.shape[1:]) - total.shape[0]
            padded = total
            if short:
                padded = torch.cat([total, total.new_zeros((short, *total.shape[1:]))])
            shard = funcol.wait_tensor(
                funcol.reduce_scatter_single(padded.contiguous(), "sum", 0, group_name))
            local = param.to_local()
            shard = shard[: local.shape[0]].to(local.dtype)
            grad = DTensor.from_local(shard, param.device_mesh, param.placements,
                                      run_check=False, shape=param.shape,
                                      stride=param.stride())
            param.grad = grad if param.grad is None else param.grad + grad

    def __exit__(self, *exc) -> None:
        # The hooks refer back to this object: drop them, the leaves and the
        # sums now, not when the garbage collector finds the cycle.
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.leaves, self.sums = [], [], []
        for _, e in self.entries:
            e.module.__dict__.get(GATHERED_ATTR, {}).pop(e.name, None)


class SimpleFSDPChunkedLoss(ChunkedLossWrapperWithParamGrads):
    """``ChunkedLossWrapperWithParamGrads`` with ``lm_head`` gathered once
    per call when ``parallelize_simple_fsdp`` marked it (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapperWithParamGrads.Config):
        pass

    _once: _Once | None = None

    def __call__(self, pred, labels, global_valid_tokens=None, **loss_inputs):
        lm_head = self.lm_head
        if (lm_head is None or _ONCE not in lm_head.__dict__ or not pred.requires_grad
                or not simple_fsdp._active_parametrization):
            return super().__call__(pred, labels, global_valid_tokens, **loss_inputs)
        with _Once(lm_head) as once:
            self._once = once
            try:
                return super().__call__(pred, labels, global_valid_tokens, **loss_inputs)
            finally:
                self._once = None

    def _gradient_backprop(self, hidden_states, accumulated_grad, total_loss, lm_head,
                           fsdp_enabled):
        # Upstream calls this after the chunk loop, and it reads the sharded
        # gradients from each parameter's .grad.
        if self._once is not None:
            self._once.reduce()
        # Upstream's, for the parameters that train: it reads every lm_head
        # parameter's .grad, which a frozen one (a LoRA base) does not get.
        return _ChunkedLossWrapperWithParamGrads.apply(
            hidden_states, accumulated_grad, total_loss, lm_head, fsdp_enabled,
            *[p for p in lm_head.parameters() if p.requires_grad])
