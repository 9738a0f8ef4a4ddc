"""Auxiliary-loss-free load balancing that counts each token once.

torchtitan 0.3.0's MoE adds the per-expert token counts in forward; with
activation checkpointing the eager recompute in backward adds them again, and
its optimizer hook halves the counts of any checkpointed block to compensate
(its own TODO). Under torch.compile the buffer update is applied once by the
compiled forward, so that halving undercounts. Here the count is skipped
during an eager recompute instead, and the hook uses the counts as they are.

The hook also records each MoE layer's load imbalance, max/mean tokens per
expert over the step, which the trainer prints every logged step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan.models.common.moe import MoE

from torchtitan_neuron.config_utils import promote


def _in_eager_recompute() -> bool:
    # Non-reentrant checkpointing recomputes inside the backward graph task;
    # a compiled forward applies the buffer update once and never reaches here.
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class CountOnceMoE(MoE):
    """torchtitan's MoE whose token counts ignore activation-checkpoint recompute."""

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        # Where a recompute's counts go. Swapping buffers is plain Python, so
        # selective AC's recompute sees exactly the ops of the forward. Under
        # TP it is laid out like the counts it stands in for.
        shardings = getattr(config.sharding_config, "state_shardings", None)
        if shardings is not None and "tokens_per_expert_E" in shardings:
            shardings["_recompute_counts_E"] = shardings["tokens_per_expert_E"]
        self.register_buffer(
            "_recompute_counts_E", torch.zeros_like(self.tokens_per_expert_E), persistent=False
        )

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        if not (self.training and _in_eager_recompute()):
            return super().forward(x_BLD)
        counts, scratch = self.tokens_per_expert_E, self._recompute_counts_E
        self.tokens_per_expert_E = scratch
        try:
            return super().forward(x_BLD)
        finally:
            self.tokens_per_expert_E = counts

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        super()._init_self_buffers(buffer_device=buffer_device)
        self._recompute_counts_E = torch.zeros_like(self.tokens_per_expert_E)


def convert_moe_layers(model_config) -> None:
    """Make every MoE layer of a decoder config a ``CountOnceMoE``."""
    for layer in model_config.layers:
        moe = getattr(layer, "moe", None)
        if moe is not None and not isinstance(moe, CountOnceMoE.Config):
            layer.moe = promote(moe, CountOnceMoE.Config)


def moe_layers(model_parts: list[nn.Module]) -> list[MoE]:
    return [
        block.moe
        for part in model_parts
        for block in part.get_submodule("layers").values()
        if getattr(block, "moe_enabled", False)
    ]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # Under TP the counts and biases are replicated DTensors.
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def load_imbalance(tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """max/mean tokens per expert: 1.0 is perfectly balanced."""
    counts = tokens_per_expert_E.float()
    return counts.max() / counts.mean().clamp_min(1e-12)


@torch.no_grad()
def update_expert_bias(model_parts: list[nn.Module], parallel_dims) -> None:
    """Sign update of each layer's expert bias from this step's token counts.

    Counts are summed over the data-parallel ranks (and over TP when experts
    are sharded by EP inside TP), the update is mean-centred so the biases
    keep a zero mean, and the counts are reset for the next step.
    """
    layers = moe_layers(model_parts)
    if not layers:
        return
    counts_by_layer = torch.vstack([_local(moe.tokens_per_expert_E) for moe in layers])
    if parallel_dims.ep_enabled and parallel_dims.tp > 1:
        torch.distributed.all_reduce(
            counts_by_layer, group=parallel_dims.get_mesh("tp").get_group()
        )
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    if loss_mesh is not None:
        torch.distributed.all_reduce(counts_by_layer, group=loss_mesh.get_group())
    for moe, layer_counts in zip(layers, counts_by_layer):
        moe.load_imbalance = load_imbalance(layer_counts)
        delta = moe.load_balance_coeff * torch.sign(layer_counts.mean() - layer_counts)
        delta = delta - delta.mean()
        _local(moe.expert_bias_E).add_(delta)
        moe.tokens_per_expert_E.zero_()


def register_load_balancing_hook(optimizers, model_parts, parallel_dims) -> None:
    """``post_optimizer_build_fn``: update expert biases before every optimizer step."""
    layers = moe_layers(model_parts)
    enabled = {moe.load_balance_coeff is not None for moe in layers}
    if len(enabled) > 1:
        raise ValueError(
            "MoE load_balance_coeff must be set on every MoE layer or on none"
        )
    if enabled == {True}:
        optimizers.register_step_pre_hook(
            lambda *args, **kwargs: update_expert_bias(model_parts, parallel_dims)
        )


def expert_balance_stats(model_parts: list[nn.Module]) -> tuple[float, float] | None:
    """Last step's load imbalance (max/mean tokens per expert) and expert-bias
    spread (max - min), each averaged over MoE layers; None without MoE."""
    layers = [m for m in moe_layers(model_parts) if hasattr(m, "load_imbalance")]
    if not layers:
        return None
    imbalance = sum(float(m.load_imbalance) for m in layers) / len(layers)
    biases = [_local(m.expert_bias_E) for m in layers]
    spread = sum(float(b.max() - b.min()) for b in biases) / len(biases)
    return imbalance, spread
