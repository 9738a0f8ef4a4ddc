"""Context parallelism by gathering keys and values, for SDPA attention.

With ``--parallelism.context_parallel_degree N`` each of the N ranks of the
``cp`` mesh holds ``seq / N`` of every sequence's tokens (torchtitan's
``prepare_context_parallel_input`` shards inputs, labels and positions, with
its head-tail load balancer by default). Attention is the one place a token
needs the others: here every layer gathers the keys and values of the whole
sequence from the ``cp`` ranks (``all_gather_tensor_autograd``, whose backward
is a reduce-scatter of their gradients), and each rank's queries attend to
them under a mask that says which key each query may see.

The gather is a functional collective, so under ``torch.compile`` it is a node
of the step's graph, where bucketing and the compiler's scheduler see it, like
SimpleFSDP's own gathers.

Why not torchtitan's own: ``apply_cp_to_forward`` wraps SDPA inputs as
``Shard(1)`` DTensors and relies on torch's ring-attention handlers, which
exist only for the CUDA kernels (flash, memory-efficient, cuDNN). On CPU,
SDPA is ``_scaled_dot_product_flash_attention_for_cpu``, which has no handler,
and Dynamo fails on the DTensor inputs (row ``cp-allgather-sdpa`` of
docs/upstream-workarounds.md).

The mask is built once per batch in the data path, as the block-causal mask
is (:mod:`torchtitan_neuron.components.documents`): a boolean
``(batch, 1, seq / N, seq)`` tensor whose rows are this rank's queries and
whose columns are the gathered keys, in the order the gather returns them.
Causal and block-causal attention are both this one mask, so packed documents
stay closed under CP too.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan.models.common.attention import ScaledDotProductAttention

SDPA_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.MATH,
]


def token_order(seq_len: int, cp_degree: int, load_balancer: str | None) -> torch.Tensor:
    """The sequence positions the ``cp`` ranks hold, rank 0's first: rank r
    holds ``order[r * seq / N : (r + 1) * seq / N]``, and a gather along the
    sequence returns the keys in this order.

    ``load_balancer`` is ``--parallelism.context_parallel_load_balancer``:
    ``headtail`` (torchtitan's default) or None (contiguous chunks)."""
    if load_balancer is None:
        return torch.arange(seq_len)
    if load_balancer != "headtail":
        raise ValueError(
            f"--parallelism.context_parallel_load_balancer {load_balancer!r}: "
            "context parallelism with SDPA attention takes headtail or none; "
            "ptrr balances FlexAttention block masks, which these recipes do not use."
        )
    order = _HeadTailLoadBalancer(seq_len, cp_degree, "cpu")._generate_indices(restore=False)
    return order.reshape(-1).long().cpu()


def rank_positions(order: torch.Tensor, cp_degree: int, cp_rank: int) -> torch.Tensor:
    """The positions ``cp_rank`` holds, from ``token_order``'s ``order``."""
    local = order.numel() // cp_degree
    return order[cp_rank * local:(cp_rank + 1) * local]


def local_attention_mask(
    batch: int,
    seq_len: int,
    cp_degree: int,
    cp_rank: int,
    load_balancer: str | None,
    documents: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean ``(batch, 1, seq / N, seq)``: may this rank's query i attend to
    gathered key j. Causal by global position; with ``documents`` (the
    ``(batch, seq)`` document ids of the whole rows, see ``document_ids``)
    also closed across documents."""
    order = token_order(seq_len, cp_degree, load_balancer).to(device)
    queries = rank_positions(order, cp_degree, cp_rank)
    mask = (order.unsqueeze(0) <= queries.unsqueeze(1)).unsqueeze(0)
    if documents is not None:
        documents = documents.to(device)
        same = documents[:, queries].unsqueeze(2) == documents[:, order].unsqueeze(1)
        mask = mask & same
    else:
        mask = mask.expand(batch, -1, -1)
    return mask.unsqueeze(1).contiguous()


def gathered_attention(q_BLNH, k_BLNH, v_BLNH, mask, group, *, scale=None, enable_gqa=False):
    """This rank's queries against the whole sequence's keys and values,
    gathered over ``group`` along the sequence (dim 1 of ``(B, L, N, H)``)."""
    k_BLNH = funcol.all_gather_tensor_autograd(k_BLNH.contiguous(), 1, group)
    v_BLNH = funcol.all_gather_tensor_autograd(v_BLNH.contiguous(), 1, group)
    q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
    with sdpa_kernel(SDPA_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    return out.transpose(1, 2)


def position_runs(positions: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """``positions`` (1-D, increasing within runs) as ``(start, stop)`` runs."""
    runs: list[list[int]] = []
    for p in positions.tolist():
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return tuple((a, b) for a, b in runs)


def apply_gathered_cp(model: torch.nn.Module, cp_mesh, seq_len: int,
                      load_balancer: str | None) -> int:
    """Make every layer's SDPA inner attention (causal or block-causal) attend
    over the keys gathered from the ``cp`` ranks, and its prefix-cache RoPE
    take this rank's positions. Returns the layers changed.

    Raises ``ValueError`` naming the attention that is not SDPA."""
    group = cp_mesh.get_group()
    cp_degree, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    runs = position_runs(
        rank_positions(token_order(seq_len, cp_degree, load_balancer), cp_degree, cp_rank))
    changed = 0
    for name, block in model.layers.items():
        rope = getattr(block.attention, "rope", None)
        if rope is not None and hasattr(rope.config, "use_prefix_cache_for_positions"):
            rope.cp_ranges = runs
        inner = block.attention.inner_attention
        if not isinstance(inner, ScaledDotProductAttention):
            raise ValueError(
                f"--parallelism.context_parallel_degree: layer {name}'s attention is "
                f"{type(inner).__name__}; context parallelism here takes SDPA "
                "attention (causal or block_causal). Use context_parallel_degree 1."
            )

        def cp_forward(q, k, v, *, attention_masks=None, scale=None, enable_gqa=False,
                       is_causal=True, **kwargs):
            if not isinstance(attention_masks, torch.Tensor):
                raise ValueError(
                    "context parallelism needs the attention mask that the "
                    "torchtitan_neuron trainer builds for each batch "
                    "(local_attention_mask); got "
                    f"{type(attention_masks).__name__}"
                )
            return gathered_attention(q, k, v, attention_masks, group,
                                      scale=scale, enable_gqa=enable_gqa)

        inner.forward = cp_forward
        changed += 1
    return changed
