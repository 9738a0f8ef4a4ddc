"""Packed-document isolation: block-causal attention and per-document positions.

A packed sequence holds several documents back to back. Plain causal attention
lets every token attend to all earlier tokens of its row, including those of
earlier, unrelated documents. With ``--model.attn_mask_type block_causal`` a
token attends only to the earlier tokens of its own document.

Document boundaries are read from the packed token stream, once per batch in
the data path (``post_dataloading_process``): a document starts at the
tokenizer's BOS token, right after its EOS token, and at the start of every row
(a document cut by the previous row continues as a new one). From them come

- the attention mask, a boolean ``(batch, 1, seq, seq)`` tensor (``True``:
  may attend) that is causal within a document and closed across documents.
  It is a plain input of the compiled step, shared by every layer and head,
  and goes to ``F.scaled_dot_product_attention`` as ``attn_mask``;
- with ``--model.reset_positions_per_document``, rotary positions that restart
  at 0 at every document, so a packed row computes what each of its documents
  would compute alone.

Attention kernels, by platform:

- CPU: SDPA's flash kernel for CPU, which takes a mask (forward and backward).
- CUDA: SDPA with the cuDNN or memory-efficient kernel (both take a mask;
  the flash kernel does not), falling back to the math kernel.
- Neuron: the mask reaches TorchNeuron's SDPA
  (``_scaled_dot_product_fused_attention_overrideable``) as ``attn_mask``;
  the rotary gather of per-document positions is not supported on Neuron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan.models.common.attention import ScaledDotProductAttention

AttnMaskType = Literal["causal", "block_causal"]


@dataclass(kw_only=True, slots=True)
class ModelOptions:
    """Attention masking and positions for packed documents."""

    attn_mask_type: AttnMaskType = "causal"
    """causal: every token attends to all earlier tokens of its row, across
    packed-document boundaries (the tutorial's behaviour). block_causal:
    causal within each document, closed across documents."""

    reset_positions_per_document: bool = False
    """Restart rotary positions at 0 at each packed document (with
    block_causal, a packed row then equals its documents run one by one).
    Not supported on Neuron, which cannot gather rotary positions."""


class BlockCausalAttention(ScaledDotProductAttention):
    """SDPA that takes the block-causal mask built in the data path."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        # Kernels that accept an arbitrary mask, best first. On CPU SDPA picks
        # its flash kernel for CPU (which takes a mask) whatever this says.
        self.sdpa_backends = [
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.MATH,
        ]

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, torch.Tensor):
            raise ValueError(
                "block_causal attention needs the document mask that the "
                "trainer builds from each batch (attention_masks); got "
                f"{type(attention_masks).__name__}. Run it through a "
                "torchtitan_neuron trainer, or pass block_causal_mask(tokens, ...)."
            )
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa
            )
        return out.transpose(1, 2)


def document_starts(
    tokens: torch.Tensor, bos_id: int | None, eos_id: int | None
) -> torch.Tensor:
    """Boolean ``(batch, seq)``: where a document starts in each packed row."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    if bos_id is not None:
        starts |= tokens == bos_id
    if eos_id is not None:
        starts[:, 1:] |= tokens[:, :-1] == eos_id
    starts[:, 0] = True
    return starts


def document_ids(starts: torch.Tensor) -> torch.Tensor:
    """``(batch, seq)`` index of each token's document within its row."""
    return starts.long().cumsum(dim=1)


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """``(batch, seq)`` position of each token within its document."""
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start


def block_causal_mask(starts: torch.Tensor) -> torch.Tensor:
    """``(batch, 1, seq, seq)`` boolean mask: query i may attend to key j when
    j <= i and both are in the same document."""
    docs = document_ids(starts)
    seq = docs.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
    same = docs.unsqueeze(2) == docs.unsqueeze(1)
    return (same & causal).unsqueeze(1)


def cross_document_share(starts: torch.Tensor) -> float:
    """Share of the causal attention pairs (query i, key j <= i) of a batch
    whose query and key are in different documents."""
    docs = document_ids(starts)
    batch, seq = docs.shape
    total = batch * seq * (seq + 1) // 2
    same = 0
    for row in docs:
        lengths = torch.bincount(row)
        same += int((lengths * (lengths + 1) // 2).sum())
    return 1.0 - same / total


def apply_model_options(model_config, options: ModelOptions) -> None:
    """Set the attention and rotary configs of every layer from ``options``."""
    if options.attn_mask_type not in ("causal", "block_causal"):
        raise ValueError(
            f"--model.attn_mask_type {options.attn_mask_type!r} is not one of "
            "causal, block_causal."
        )
    block = options.attn_mask_type == "block_causal"
    for layer in model_config.layers:
        attention = getattr(layer, "attention", None)
        if attention is None:
            continue
        inner = attention.inner_attention
        # SDPA's config, or a subclass of it that adds no field (LoRA's
        # converter wraps every non-target config in a frozen subclass).
        if (block and isinstance(inner, ScaledDotProductAttention.Config)
                and not isinstance(inner, BlockCausalAttention.Config)
                and type(inner).__dataclass_fields__.keys()
                == ScaledDotProductAttention.Config.__dataclass_fields__.keys()):
            # (FlexAttention and VarlenAttention mask documents already.)
            attention.inner_attention = BlockCausalAttention.Config()
        rope = getattr(attention, "rope", None)
        if options.reset_positions_per_document and rope is not None:
            if hasattr(rope, "use_prefix_cache_for_positions"):
                rope.use_prefix_cache_for_positions = False
