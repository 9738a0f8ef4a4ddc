"""GPT-OSS attention on plain SDPA: learned sinks, sliding windows, documents.

Upstream's GPT-OSS attention runs on FlexAttention or CUDA varlen and applies
the learned per-head sink after the kernel, from its log-sum-exp:
``out * sigmoid(lse - sink_h)``. Neither kernel exists on Neuron, and Flex has
no CPU backward (torch 2.14), so this module computes the same function with
``F.scaled_dot_product_attention`` alone.

The sink is one extra key. A softmax over the S real keys plus one key whose
score is ``sink_h`` and whose value is zero gives
``sum_j e^(s_j) v_j / (Z + e^sink_h) = out * sigmoid(lse - sink_h)``, which
is upstream's rescale, exactly. With Dh the head dim, s the softmax scale and
P the next multiple of 8 above Dh (so P >= Dh + 1):

- q gets column Dh = sink_h / s, then zeros up to P (the sink belongs to the
  query head: under GQA the keys are shared by several heads);
- the real keys get zeros in columns Dh..P-1, so their scores are unchanged;
- one extra key (slot S, per kv head) is 1 in column Dh and 0 elsewhere, so
  its score is (sink_h / s) * 1 * s = sink_h; its value is zero;
- v gets zero columns up to P, dropped from the output: SDPA's fused CPU
  kernel wants one head dim for q, k and v (it takes the math kernel, which
  materialises the scores, otherwise).

P is 8-aligned rather than Dh + 1 because the fused CUDA kernels want aligned
head dims, and on CPU 72 ran faster than 65 (docs/gpt_oss_attention.md).

The mask is one boolean ``(1 or B, 1, S, S + 1)`` tensor shared by all heads
(True: may attend): causal, the window on window layers (key j > i - window:
the token and the window - 1 before it), the document mask under
block_causal, and the sink column always True (no row is empty). GQA goes to
SDPA's ``enable_gqa``. Shapes are static; nothing is gathered by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.models.gpt_oss.model import Attention
from torchtitan.protocols.module import Module

from torchtitan_neuron.config_utils import promote

HEAD_DIM_MULTIPLE = 8


def padded_head_dim(head_dim: int) -> int:
    """Head dim of the padded q, k, v: room for the sink column, 8-aligned."""
    return (head_dim // HEAD_DIM_MULTIPLE + 1) * HEAD_DIM_MULTIPLE


def attention_mask(
    seq_len: int,
    window: int | None,
    device: torch.device | str,
    document_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean ``(1 or B, 1, S, S + 1)`` mask, True where query i may attend.

    Keys 0..S-1 are the real ones: causal, within ``window`` if given, within
    the document if ``document_mask`` (block_causal_mask's (B, 1, S, S)) is
    given. Key S is the sink, always allowed.
    """
    i = torch.arange(seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len + 1, device=device).unsqueeze(0)
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    allowed = (allowed | (j == seq_len)).view(1, 1, seq_len, seq_len + 1)
    if document_mask is not None:
        # The sink column stays open whatever the documents are.
        allowed = allowed & F.pad(document_mask, (0, 1), value=True)
    return allowed


def sink_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """Attention with per-head sinks in one SDPA call.

    q ``(B, S, Hq, Dh)``, k and v ``(B, S, Hkv, Dh)``, sinks ``(Hq,)``, mask
    from ``attention_mask``; returns ``(B, S, Hq, Dh)``, the layout upstream's
    inner attentions return.
    """
    batch, seq, n_heads, head_dim = q.shape
    n_kv, width = k.shape[2], padded_head_dim(head_dim)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    # Divided in the sinks' dtype (float32 parameters), then cast to q's.
    column = (sinks / scale).to(q.dtype).view(1, n_heads, 1, 1)
    zeros = q.new_zeros(batch, n_heads, seq, width - head_dim - 1)
    q = torch.cat([q, column.expand(batch, n_heads, seq, 1), zeros], dim=-1)
    unit = torch.arange(width, device=k.device) == head_dim
    sink_key = unit.to(k.dtype).expand(batch, n_kv, 1, width)
    k = torch.cat([F.pad(k, (0, width - head_dim)), sink_key], dim=2)
    # Zero value columns, and a zero value for the sink key (last slot).
    v = F.pad(v, (0, width - head_dim, 0, 1))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out[..., :head_dim].transpose(1, 2)


class SinkSDPA(Module):
    """``SdpaSinkAttention``'s inner attention: the mask, then ``sink_sdpa``.

    A module rather than a call in the outer forward because upstream's TP
    sharding wraps whatever ``inner_attention`` is in a ``local_map``
    (``set_gqa_inner_attention_local_map``): q, k and v arrive here as
    rank-local tensors, which the padding and concatenation need.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        sinks: torch.Tensor,
        scale: float,
        attention_masks: torch.Tensor | None = None,
        enable_gqa: bool = False,
        window: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        documents = attention_masks
        if documents is not None and not (
            isinstance(documents, torch.Tensor) and documents.dtype == torch.bool
        ):
            raise TypeError(
                "SDPA sink attention takes attention_masks None (causal) or "
                "block_causal_mask's boolean (B, 1, S, S) tensor, got "
                f"{type(documents).__name__}"
            )
        mask = attention_mask(q_BLNH.shape[1], window, q_BLNH.device, documents)
        return sink_sdpa(q_BLNH, k_BLNH, v_BLNH, sinks, mask, scale, enable_gqa)


class SdpaSinkAttention(Attention):
    """Upstream's GPT-OSS ``Attention`` with sinks and window computed by
    ``SinkSDPA``. Same parameters (``qkv_linear.wqkv``, ``wo``, ``sinks``),
    so state dicts load either way."""

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        inner_attention: Module.Config = field(default_factory=SinkSDPA.Config)

    def __init__(self, config: Config) -> None:
        if not isinstance(config.inner_attention, SinkSDPA.Config):
            raise TypeError(
                "SdpaSinkAttention needs inner_attention SinkSDPA.Config, got "
                f"{type(config.inner_attention).__qualname__}"
            )
        super().__init__(config)
        window = self.sliding_window_size = config.sliding_window_size
        # VarlenAttention's (left, right): upstream's parallelize_gptoss reads
        # it to raise dynamo's recompile limit for window models.
        self.window_size = (-1, 0) if window is None else (window - 1, 0)

    def forward(
        self,
        x: torch.Tensor,
        attention_masks: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        q, k, v = self.qkv_linear(x)
        q, k = self.rope(q, k, positions)
        sinks = self.sinks
        if isinstance(sinks, DTensor):
            # TP shards the sinks with the heads: this rank's heads' sinks.
            sinks = sinks.to_local(grad_placements=sinks.placements)
        output = self.inner_attention(
            q, k, v, sinks=sinks, scale=self.softmax_scale,
            attention_masks=attention_masks, enable_gqa=self.enable_gqa,
            window=self.sliding_window_size,
        )
        output = output.reshape(bsz, seqlen, -1).contiguous()
        return self.wo(output)


def use_sdpa_sink_attention(model_config) -> None:
    """Give every layer of a GPT-OSS model config ``SdpaSinkAttention``.

    Every field is kept but ``inner_attention`` (Flex or varlen), which
    becomes ``SinkSDPA.Config``. torchtitan's trainer and validator call
    ``GptOssModel.get_attention_masks`` only for Flex and varlen configs, so
    they no longer do: the layers get ``attention_masks`` None, or the
    block_causal mask this project's trainer puts there.
    """
    for layer in model_config.layers:
        attention = layer.attention
        if isinstance(attention, SdpaSinkAttention.Config):
            continue
        if not isinstance(attention, Attention.Config):
            raise TypeError(
                "use_sdpa_sink_attention takes a GPT-OSS model config; a layer "
                f"has attention {type(attention).__qualname__}"
            )
        layer.attention = promote(
            attention, SdpaSinkAttention.Config, inner_attention=SinkSDPA.Config()
        )
