"""GPT-OSS attention on plain SDPA: sinks, sliding windows and documents.

Proves:

- ``sink_sdpa`` equals upstream's Flex path (FlexAttention's forward with the
  log-sum-exp, ``apply_attention_sink_rescale``, upstream's causal,
  sliding-window and packed-document mask mods) within 1e-5 relative in
  float32, for every window (none, 4, 128) x sinks (zero, random) x
  documents (off, on);
- its gradients with respect to q, k, v and the sinks equal a naive
  reference (explicit scores, -inf masking, softmax over the keys and a sink
  logit, matmul) within 1e-9 relative in float64, and within 1e-5 relative of
  the float64 reference in float32;
- ``SdpaSinkAttention`` loads upstream ``Attention``'s state dict strictly and
  on the same weights gives upstream's Flex output within 1e-5 (a window
  layer and a full layer of the debug model, YaRN scale included, with and
  without documents); the converted config is not Flex or varlen, so the
  trainer never calls ``get_attention_masks``;
- heads split in two halves as TP splits them (q, k, v heads and sinks),
  concatenated, give the full result; and on 2 gloo ranks the module
  parallelized by upstream's GPT-OSS sharding (TP2) gives the unsharded
  output and sinks gradient (e2e);
- one forward and backward at S=8192 with 64 heads (FakeTensorMode) creates
  no float tensor of S*S or more elements but SDPA's own additive copy of the
  boolean mask, head-free (1, 1, S, S+1), one per call;
- under ``torch.compile(backend="aot_eager", fullgraph=True)`` the module
  traces in one graph whose inputs hold no mask: it is built in the graph
  from static shapes, and the CPU fused SDPA kernel is the one called.

Tier: fast (the TP2 gloo test is e2e).
Run: PYTHONPATH=. .venv/bin/python -m pytest tests/test_sink_attention.py -q
"""

import dataclasses
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.models.common.attention import (
    FlexAttention,
    VarlenAttention,
    get_causal_mask_mod,
    get_efficient_causal_mask_mod_for_packed_document,
    get_sliding_window_mask_mod,
)
from torchtitan.models.gpt_oss import model_registry
from torchtitan.models.gpt_oss.model import apply_attention_sink_rescale

from torchtitan_neuron.components.documents import block_causal_mask, document_positions
from torchtitan_neuron.components.sink_attention import (
    SdpaSinkAttention,
    SinkSDPA,
    attention_mask,
    padded_head_dim,
    sink_sdpa,
    use_sdpa_sink_attention,
)

B, HQ, HKV, DH = 2, 4, 2, 16
SCALE = 0.3
HQ_DEBUG = 64  # heads of the debug model
# Measured 2026-12-01 (x86_64, 2 cores): forward vs Flex at most 4.4e-7
# relative; gradients 1.3e-15 in float64, 4.9e-7 in float32; the module
# 2.5e-7; TP halves bitwise equal; TP2 on gloo 2.6e-7 (sinks' gradient
# bitwise equal); aot_eager vs eager bitwise equal.
FP32_RTOL = 1e-5
FP64_RTOL = 1e-9
# (window, seq_len): a small window at a short sequence, GPT-OSS's 128 where
# it bites (S > 128), and full causal attention.
WINDOWS = [(None, 64), (4, 64), (128, 256)]


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to the largest expected magnitude."""
    diff = (actual - expected).detach()
    return float(diff.abs().max() / expected.detach().abs().max())


def starts_for(seq_len: int) -> torch.Tensor:
    """Document starts of two packed rows: three documents, then two."""
    starts = torch.zeros(B, seq_len, dtype=torch.bool)
    starts[0, [0, seq_len // 6, seq_len // 2 + 3]] = True
    starts[1, [0, seq_len * 3 // 4]] = True
    return starts


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def qkv(seq_len: int, dtype=torch.float32, seed: int = 0):
    gen = seeded(seed)
    q = torch.randn(B, seq_len, HQ, DH, generator=gen, dtype=dtype)
    k = torch.randn(B, seq_len, HKV, DH, generator=gen, dtype=dtype)
    v = torch.randn(B, seq_len, HKV, DH, generator=gen, dtype=dtype)
    return q, k, v


@pytest.fixture
def eager_flex(monkeypatch):
    """Upstream's FlexAttention with eager flex_attention: its compiled one
    runs inductor with max-autotune; eager flex runs forward on CPU (it has
    no CPU backward in torch 2.14)."""
    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", flex_attention)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def flex_block_mask(seq_len, window, starts):
    """The BlockMask upstream's get_attention_masks builds, on CPU."""
    mods = [get_causal_mask_mod()]
    if starts is not None:
        mods.append(get_efficient_causal_mask_mod_for_packed_document(document_positions(starts)))
    if window is not None:
        mods.append(get_sliding_window_mask_mod(window))
    return create_block_mask(and_masks(*mods), B if starts is not None else None, None,
                             seq_len, seq_len, device="cpu")


def flex_reference(q, k, v, sinks, window, starts):
    block_mask = flex_block_mask(q.shape[1], window, starts)
    return FlexAttention(FlexAttention.Config())(
        q, k, v, attention_masks=block_mask, scale=SCALE, enable_gqa=True,
        out_transform=lambda out, lse: apply_attention_sink_rescale(out, lse, sinks))


def naive(q, k, v, sinks, window, starts):
    """Explicit scores, -inf where masked, softmax over the keys and a sink
    logit, matmul: the definition, in the inputs' dtype."""
    seq = q.shape[1]
    rep = HQ // HKV
    keys, values = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bihd,bjhd->bhij", q, keys) * SCALE
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    allowed = (j <= i).expand(B, 1, seq, seq)
    if window is not None:
        allowed = allowed & (i - j < window)
    if starts is not None:
        docs = starts.long().cumsum(1)
        allowed = allowed & (docs.unsqueeze(2) == docs.unsqueeze(1)).unsqueeze(1)
    scores = scores.masked_fill(~allowed, -math.inf)
    sink = sinks.view(1, HQ, 1, 1).expand(B, HQ, seq, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :seq]
    return torch.einsum("bhij,bjhd->bihd", probs, values)


def ours(q, k, v, sinks, window, starts):
    documents = None if starts is None else block_causal_mask(starts)
    mask = attention_mask(q.shape[1], window, q.device, documents)
    return sink_sdpa(q, k, v, sinks, mask, SCALE, enable_gqa=True)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("random_sinks", [False, True], ids=["zero_sinks", "sinks"])
@pytest.mark.parametrize("window,seq_len", WINDOWS, ids=["full", "window4", "window128"])
def test_forward_equals_upstream_flex(eager_flex, window, seq_len, random_sinks, documents):
    q, k, v = qkv(seq_len)
    sinks = torch.randn(HQ, generator=seeded(4)) * 2 if random_sinks else torch.zeros(HQ)
    starts = starts_for(seq_len) if documents else None
    expected = flex_reference(q, k, v, sinks, window, starts)
    actual = ours(q, k, v, sinks, window, starts)
    assert actual.shape == (B, seq_len, HQ, DH)
    assert rel(actual, expected) < FP32_RTOL
    # The naive reference agrees too (a check on the reference itself).
    assert rel(naive(q, k, v, sinks, window, starts), expected) < FP32_RTOL


def _grads(fn, q, k, v, sinks, window, starts, weight):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    (fn(*leaves, window, starts) * weight).sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("window,seq_len", WINDOWS[:2], ids=["full", "window4"])
def test_gradients_equal_naive_reference(window, seq_len):
    q, k, v = qkv(seq_len, torch.float64, seed=1)
    sinks = torch.randn(HQ, dtype=torch.float64, generator=seeded(2))
    weight = torch.randn(B, seq_len, HQ, DH, dtype=torch.float64, generator=seeded(3))
    starts = starts_for(seq_len)
    expected = _grads(naive, q, k, v, sinks, window, starts, weight)
    for got, want in zip(_grads(ours, q, k, v, sinks, window, starts, weight), expected):
        assert rel(got, want) < FP64_RTOL
    low = [t.float() for t in (q, k, v, sinks, weight)]
    for got, want in zip(_grads(ours, *low[:4], window, starts, low[4]), expected):
        assert rel(got.double(), want) < FP32_RTOL


def _debug_attention_configs():
    """Layer 0 (window 128) and layer 1 (full) of upstream's debug model with
    Flex, and the same layers converted."""
    flex = model_registry("debugmodel", attn_backend="flex").model
    converted = model_registry("debugmodel", attn_backend="flex").model
    use_sdpa_sink_attention(converted)
    return flex, converted


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("layer", [0, 1], ids=["window_layer", "full_layer"])
def test_module_equals_upstream_attention(eager_flex, layer, documents):
    flex, converted = _debug_attention_configs()
    torch.manual_seed(0)
    upstream = flex.layers[layer].attention.build()
    upstream.init_states()
    with torch.no_grad():
        upstream.sinks.normal_()  # init gives ~0.02: make the sinks matter
    module = converted.layers[layer].attention.build()
    assert type(module) is SdpaSinkAttention
    assert module.sliding_window_size == (128 if layer == 0 else None)
    module.init_states()  # for the RoPE cache, a non-persistent buffer
    module.load_state_dict(upstream.state_dict(), strict=True)
    seq = 256
    x = torch.randn(B, seq, flex.dim)
    starts = starts_for(seq) if documents else None
    window = flex.layers[layer].attention.sliding_window_size
    with torch.no_grad():
        expected = upstream(x, flex_block_mask(seq, window, starts))
        actual = module(x, None if starts is None else block_causal_mask(starts))
    assert rel(actual, expected) < FP32_RTOL


def test_converted_config_keeps_fields_and_skips_get_attention_masks():
    config = model_registry("debugmodel", attn_backend="flex").model
    before = [layer.attention for layer in config.layers]
    use_sdpa_sink_attention(config)
    for old, layer in zip(before, config.layers):
        new = layer.attention
        assert type(new) is SdpaSinkAttention.Config
        assert type(new.inner_attention) is SinkSDPA.Config
        # Every other field carried over: the same objects.
        for f in dataclasses.fields(old):
            if f.name != "inner_attention":
                assert getattr(new, f.name) is getattr(old, f.name), f.name
    # What torchtitan's trainer and validator test before get_attention_masks.
    assert not isinstance(config.first_attention.inner_attention,
                          (FlexAttention.Config, VarlenAttention.Config))
    with pytest.raises(TypeError, match="inner_attention"):
        SdpaSinkAttention(before[0])


def test_head_halves_as_tp_splits_them():
    q, k, v = qkv(64)
    sinks = torch.randn(HQ, generator=seeded(5))
    mask = attention_mask(64, 4, "cpu", block_causal_mask(starts_for(64)))
    full = sink_sdpa(q, k, v, sinks, mask, SCALE, enable_gqa=True)
    # TP rank r holds q heads [r*HQ/2, (r+1)*HQ/2), the kv heads they group
    # onto, and the same slice of the sinks (sharded on dim 0).
    hq, hkv = HQ // 2, HKV // 2
    halves = [
        sink_sdpa(q[:, :, r * hq:(r + 1) * hq], k[:, :, r * hkv:(r + 1) * hkv],
                  v[:, :, r * hkv:(r + 1) * hkv], sinks[r * hq:(r + 1) * hq], mask,
                  SCALE, enable_gqa=True)
        for r in range(2)
    ]
    assert torch.equal(torch.cat(halves, dim=2), full)


class LargeFloats(TorchDispatchMode):
    """Records (op, shape) of every floating output with >= ``limit`` elements."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.seen, self.ops = limit, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func.overloadpacket))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= self.limit:
                self.seen.append((str(func.overloadpacket), tuple(t.shape)))
        return out


@pytest.mark.parametrize("window", [None, 128], ids=["full", "window128"])
def test_no_float_seq_by_seq_tensor_at_8192(window):
    seq, heads, kv_heads, head_dim = 8192, 64, 8, 64
    with FakeTensorMode():
        q = torch.randn(1, seq, heads, head_dim, requires_grad=True)
        k = torch.randn(1, seq, kv_heads, head_dim, requires_grad=True)
        v = torch.randn(1, seq, kv_heads, head_dim, requires_grad=True)
        sinks = torch.randn(heads, requires_grad=True)
        with LargeFloats(seq * seq) as seen:
            mask = attention_mask(seq, window, "cpu")
            out = sink_sdpa(q, k, v, sinks, mask, 0.125, enable_gqa=True)
            out.sum().backward()
    assert mask.dtype == torch.bool and mask.shape == (1, 1, seq, seq + 1)
    # The one float S x S tensor: SDPA's additive copy of the boolean mask
    # (aten.where, head-free), which its CPU flash kernel takes instead of a
    # boolean one. No score matrix, no per-head mask.
    assert seen.seen == [("aten.where", (1, 1, seq, seq + 1))]
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in seen.ops
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in seen.ops


def test_cpu_picks_the_flash_kernel():
    seq = 64
    q = torch.randn(B, HQ, seq, padded_head_dim(DH))
    k = torch.randn(B, HKV, seq + 1, padded_head_dim(DH))
    mask = attention_mask(seq, 4, "cpu")
    for v_dim, kernel in ((padded_head_dim(DH), "FLASH_ATTENTION"), (DH, "MATH")):
        v = torch.randn(B, HKV, seq + 1, v_dim)
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=SCALE, enable_gqa=True)
        assert torch.nn.attention.SDPBackend(choice).name == kernel
    assert padded_head_dim(64) == 72 and padded_head_dim(16) == 24


def _capture_graphs():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return graphs, aot_autograd(fw_compiler=capture, bw_compiler=capture)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_compiles_in_one_graph_with_the_mask_inside(documents):
    _, converted = _debug_attention_configs()
    torch.manual_seed(0)
    module = converted.layers[0].attention.build()
    module.init_states()
    seq = 64
    x = torch.randn(B, seq, converted.dim, requires_grad=True)
    masks = block_causal_mask(starts_for(seq)) if documents else None
    eager = module(x, masks)
    graphs, backend = _capture_graphs()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(x, masks)
    compiled.sum().backward()
    assert len(graphs) == 2, graphs  # forward and backward: no graph break
    assert rel(compiled, eager) < FP32_RTOL
    forward = graphs[0].graph
    inputs = [n.meta["val"] for n in forward.nodes if n.op == "placeholder"]
    # Static shapes; the only boolean input is the document mask, if any.
    assert all(isinstance(d, int) for t in inputs for d in t.shape)
    bool_inputs = [tuple(t.shape) for t in inputs if t.dtype == torch.bool]
    assert bool_inputs == ([(B, 1, seq, seq)] if documents else [])
    targets = {str(n.target) for n in forward.nodes if n.op == "call_function"}
    assert "aten.arange.start" in targets or "aten.arange.default" in targets
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets


def _tp2_worker(rank: int, world: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.tensor import DTensor

        from torchtitan.distributed.parallel_dims import ParallelDims
        from torchtitan.models.gpt_oss.sharding import set_gpt_oss_sharding_config

        from torchtitan_neuron import platform

        platform.install()  # a CPU device mesh
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1,
                            world_size=world, spmd_backend="partial_dtensor")
        dims.build_mesh()
        config = model_registry("debugmodel", attn_backend="flex").model
        use_sdpa_sink_attention(config)
        set_gpt_oss_sharding_config(config, enable_sp=False, enable_ep=False)
        torch.manual_seed(0)
        full = config.layers[0].attention.build()  # the window layer
        full.init_states()
        with torch.no_grad():
            full.sinks.normal_()
        sharded = config.layers[0].attention.build()
        sharded.init_states()
        sharded.load_state_dict(full.state_dict())
        sharded.parallelize(dims)
        assert isinstance(sharded.sinks, DTensor)
        seq = 64
        x, weight = torch.randn(B, seq, config.dim), torch.randn(B, seq, config.dim)
        masks = block_causal_mask(starts_for(seq))
        expected = full(x, masks, None)
        (expected * weight).sum().backward()
        out = sharded(x, masks, None).full_tensor()
        (out * weight).sum().backward()
        local = sharded.sinks.grad.to_local()
        n = local.shape[0]
        results[rank] = (rel(out, expected),
                         rel(local, full.sinks.grad[rank * n:(rank + 1) * n]), n)
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
def test_tp2_gloo_matches_unsharded():
    from runlog import free_port

    world = 2
    results = mp.Manager().dict()
    mp.spawn(_tp2_worker, args=(world, free_port(), results), nprocs=world)
    assert len(results) == world
    for out_rel, sinks_rel, local_heads in results.values():
        assert local_heads == HQ_DEBUG // world
        assert out_rel < FP32_RTOL and sinks_rel < FP32_RTOL
