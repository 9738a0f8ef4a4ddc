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

The mask is one ``(1 or B, 1, S, S + 1)`` tensor shared by all heads: causal,
the window on window layers (key j > i - window: the token and the window - 1
before it), the document mask under block_causal, and the sink column always
open (no row is empty). GQA goes to SDPA's ``enable_gqa``. Shapes are static;
nothing is gathered by position.

Where the masks are built. SDPA turns a boolean mask into an additive float
mask in q's dtype inside every call (CPU, and the composite path on Neuron)
and keeps that copy for the backward, so a boolean mask per layer costs one
float ``S x (S + 1)`` tensor per layer. ``SdpaSinkGptOssModel`` (built from a
config by ``use_sdpa_sink_model``) therefore builds the additive masks once
per forward, in the dtype the layers' q will have, and hands every layer the
dict ``{"basic_mask", "sliding_window_mask"}`` from which upstream's
``GptOssTransformerBlock`` picks its own; ``SinkSDPA`` passes a float mask to
SDPA as it is. Given ``None`` or a boolean document mask instead (a plain
``GptOssModel`` whose layers were converted by ``use_sdpa_sink_attention``),
``SinkSDPA`` builds the boolean mask itself, as before, and pays SDPA's
per-call copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.models.common.linear import ScaledBiasRowwiseLinear
from torchtitan.models.gpt_oss.model import Attention, GptOssModel
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


# The keys of the masks dict: upstream's GptOssTransformerBlock picks
# ``attention_masks[self.attn_mask_key]``, the window one on window layers.
BASIC_MASK, WINDOW_MASK = "basic_mask", "sliding_window_mask"


def additive_attention_mask(
    seq_len: int,
    window: int | None,
    device: torch.device | str,
    dtype: torch.dtype,
    document_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``attention_mask`` as an additive float mask in ``dtype``: 0 where
    query i may attend key j, -inf elsewhere; the sink column is 0.

    SDPA adds it to the scores as it is (no conversion, no copy). -inf is
    safe: every row has the sink's 0, so no softmax row is all -inf.
    """
    allowed = attention_mask(seq_len, window, device, document_mask)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.full((), -math.inf, dtype=dtype, device=device))


def shared_attention_masks(
    seq_len: int,
    window: int | None,
    device: torch.device | str,
    dtype: torch.dtype,
    document_mask: torch.Tensor | None = None,
    *,
    full: bool = True,
) -> dict[str, torch.Tensor]:
    """The masks all layers of one forward share, as upstream's block picks
    them: ``"basic_mask"`` (causal, documents; unless ``full`` is False: no
    layer without a window) and, if ``window``, ``"sliding_window_mask"``
    (the same and the window). Additive, in ``dtype``, ``(1, 1, S, S + 1)``
    or with documents ``(B, 1, S, S + 1)``."""
    masks = {}
    if full:
        masks[BASIC_MASK] = additive_attention_mask(seq_len, None, device, dtype, document_mask)
    if window is not None:
        masks[WINDOW_MASK] = additive_attention_mask(seq_len, window, device, dtype, document_mask)
    return masks


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the layers' q will have, given the embedding output ``h``:
    autocast's dtype when autocast is on (the projections then return it
    whatever ``h`` is), else ``h``'s, which is the parameters' compute dtype
    (bf16 under FSDP2's or SimpleFSDP's param_dtype bf16, fp32 in the fp32
    runs)."""
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return h.dtype


def _check_document_mask(documents, seq_len: int) -> None:
    if documents is None:
        return
    if not (isinstance(documents, torch.Tensor) and documents.dtype == torch.bool
            and documents.dim() == 4 and documents.shape[1:] == (1, seq_len, seq_len)):
        raise TypeError(
            "SDPA sink attention takes attention_masks None (causal), "
            "block_causal_mask's boolean (B, 1, S, S) tensor, or an additive "
            f"float (1 or B, 1, S, S + 1) mask; got {_describe(documents)}"
        )


def _describe(masks) -> str:
    if isinstance(masks, torch.Tensor):
        return f"a {masks.dtype} tensor of shape {tuple(masks.shape)}"
    return type(masks).__name__


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
    from ``attention_mask`` (boolean: SDPA converts it in every call) or
    ``additive_attention_mask`` (in q's dtype: used as it is); returns
    ``(B, S, Hq, Dh)``, the layout upstream's inner attentions return.
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

    ``attention_masks`` is either the additive float mask the model built for
    this layer (``SdpaSinkGptOssModel``: passed to SDPA as it is, ``window``
    unused since the mask has it), or ``None`` / block_causal's boolean
    ``(B, 1, S, S)`` document mask, from which the boolean mask is built here
    (SDPA then converts it to float in every call).

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
        seq_len = q_BLNH.shape[1]
        masks = attention_masks
        if isinstance(masks, torch.Tensor) and masks.is_floating_point():
            if masks.dim() != 4 or masks.shape[1:] != (1, seq_len, seq_len + 1):
                raise TypeError(
                    "SDPA sink attention takes an additive mask of shape "
                    f"(1 or B, 1, {seq_len}, {seq_len + 1}); got {_describe(masks)}"
                )
            if masks.dtype != q_BLNH.dtype:
                # SDPA would cast it, a float S x S copy per layer.
                raise TypeError(
                    f"the additive attention mask is {masks.dtype} but q is "
                    f"{q_BLNH.dtype}: build it in q's dtype (compute_dtype)"
                )
            mask = masks
        else:
            _check_document_mask(masks, seq_len)
            mask = attention_mask(seq_len, window, q_BLNH.device, masks)
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

    The model class stays upstream's, so each layer builds its own boolean
    mask and SDPA converts it to a float ``S x (S + 1)`` copy per layer; use
    ``use_sdpa_sink_model`` for a model that builds the masks once.
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


class SdpaSinkGptOssModel(GptOssModel):
    """Upstream's ``GptOssModel`` whose forward builds the attention masks
    once and shares them across layers.

    Every layer has ``SdpaSinkAttention``. The forward is upstream's
    ``Decoder.forward`` with one step added after the embedding: the dict of
    ``shared_attention_masks`` (additive, in ``compute_dtype`` of the
    embedding output, combined once with the trainer's boolean document mask
    if one is passed), which every layer receives and from which upstream's
    ``GptOssTransformerBlock`` picks its own. Two float ``S x (S + 1)``
    tensors per forward (one if all layers have a window or none has),
    whatever the number of layers. A dict passed as ``attention_masks`` is
    used as it is.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GptOssModel.Config):
        pass

    def __init__(self, config: Config) -> None:
        attentions = [layer.attention for layer in config.layers]
        wrong = [type(a).__qualname__ for a in attentions
                 if not isinstance(a, SdpaSinkAttention.Config)]
        if wrong:
            raise TypeError(
                "SdpaSinkGptOssModel needs SdpaSinkAttention on every layer "
                f"(use_sdpa_sink_model); got {sorted(set(wrong))}"
            )
        windows = sorted({a.sliding_window_size for a in attentions} - {None})
        if len(windows) > 1:
            # Upstream's block has one key for all window layers.
            raise ValueError(
                f"GPT-OSS window layers share one mask; got windows {windows}"
            )
        super().__init__(config)
        self.sliding_window_size = windows[0] if windows else None
        # Only the masks some layer picks.
        self.has_full_layers = any(a.sliding_window_size is None for a in attentions)

    def shared_attention_masks(
        self, tokens: torch.Tensor, h: torch.Tensor, document_mask: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The masks of one forward. The sequence comes from ``tokens`` (under
        sequence parallelism ``h`` may be a sequence shard)."""
        seq_len = tokens.shape[1]
        _check_document_mask(document_mask, seq_len)
        return shared_attention_masks(
            seq_len, self.sliding_window_size, h.device, compute_dtype(h), document_mask,
            full=self.has_full_layers,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: torch.Tensor | dict | None = None,
    ):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if not isinstance(attention_masks, dict):
            attention_masks = self.shared_attention_masks(tokens, h, attention_masks)

        for layer in self.layers.values():
            h = layer(h, attention_masks, positions)

        h = self.norm(h) if self.norm is not None else h
        if self._skip_lm_head:
            return h
        return self.lm_head(h) if self.lm_head is not None else h


def use_sdpa_sink_model(model_config) -> SdpaSinkGptOssModel.Config:
    """A GPT-OSS model config as ``SdpaSinkGptOssModel.Config``: every layer
    converted by ``use_sdpa_sink_attention`` (in place), then the model config
    promoted (every field carried over), so ``build()`` makes the model that
    shares its masks. Returns the new config; a config already of that class
    (or a subclass) is returned as it is."""
    if isinstance(model_config, SdpaSinkGptOssModel.Config):
        use_sdpa_sink_attention(model_config)
        return model_config
    if type(model_config) is not GptOssModel.Config:
        # A subclass's model would lose its own class (and methods) here.
        raise TypeError(
            "use_sdpa_sink_model takes upstream's GptOssModel.Config, got "
            f"{type(model_config).__qualname__}; a model class of its own "
            "shares the masks by deriving from SdpaSinkGptOssModel"
        )
    use_sdpa_sink_attention(model_config)
    return promote(model_config, SdpaSinkGptOssModel.Config)


class RowwiseBiasLinear(ScaledBiasRowwiseLinear):
    """Upstream's ``ScaledBiasRowwiseLinear`` with the bias gradient of one rank.

    Each TP rank adds ``bias / tp_degree`` to its partial output, so the sum
    over the TP ranks holds one bias. Upstream divides with an ordinary
    differentiable division, so autograd divides each rank's bias gradient by
    ``tp_degree`` too, and ``to_local()`` keeps the replicated placement:
    nothing sums it over TP, and every rank's bias gradient is ``1 / tp_degree``
    of the one-device gradient (measured: exactly half at TP2). Here the scaled
    value is ``bias + (bias / tp - bias).detach()``: the same forward, with
    derivative 1 (the fix of pytorch/torchtitan PR #4332). Row
    ``gpt-oss-rowwise-bias-grad`` of docs/upstream-workarounds.md."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledBiasRowwiseLinear.Config):
        pass

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        bias = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
        if bias is not None and self.tp_degree > 1:
            bias = bias + (bias / self.tp_degree - bias).detach()
        return F.linear(input, weight, bias)


def use_rowwise_bias_linear(model_config) -> None:
    """Every layer's ``attention.wo`` as ``RowwiseBiasLinear`` (in place)."""
    for layer in model_config.layers:
        wo = layer.attention.wo
        if type(wo) is ScaledBiasRowwiseLinear.Config:
            layer.attention.wo = promote(wo, RowwiseBiasLinear.Config)
