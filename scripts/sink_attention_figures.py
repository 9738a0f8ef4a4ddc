"""The figures of docs/gpt_oss_attention.md, measured on this machine.

    PYTHONPATH=. .venv/bin/python scripts/sink_attention_figures.py
    PYTHONPATH=. .venv/bin/python scripts/sink_attention_figures.py --neuron
    PYTHONPATH=. .venv/bin/python scripts/sink_attention_figures.py --model

Prints, for models/gpt_oss/attention.py:

- the SDPA kernel CPU picks for the padded shapes (and for an unpadded v);
- enable_gqa against repeated kv heads: equality and time;
- forward and backward time at padded head dims 64 (no sink), 65 and 72;
- the traced (FakeTensorMode) storages of one attention's forward and
  backward at seq 8192 with GPT-OSS 20B's heads (64 q, 8 kv, dim 64):
  peak and its largest parts, in float32 and bfloat16;
- the mask's bytes at seq 8192, and a per-head float mask's;
- the additive mask's bytes at seq 8192 in bfloat16 and float32;
- with ``--neuron`` (its own process: the stand-in renames PrivateUse1), the
  inputs of the fused SDPA op TorchNeuron receives, forward and backward, at
  seq 8192 in bfloat16, on the rehearsal's neuron stand-in
  (``rehearse/device.py``), given the boolean mask and given the model's
  additive one;
- the largest differences the tests bound (tests/test_sink_attention.py):
  against upstream's Flex path, the naive reference's gradients, and
  upstream's Attention module;
- the whole model (``SdpaSinkGptOssModel``, the tests' small GPT-OSS; with
  ``--model`` only these):
  its logits against upstream's model with Flex, the bfloat16 runs (cast,
  autocast, SimpleFSDP and FSDP2 param_dtype bf16) against float32, and
  upstream's Flex model cast to bfloat16 for comparison; the float tensors
  of S*S elements or more one forward and backward makes at S=1024, 2 vs 4
  layers, shared masks vs upstream's model class; and, traced at seq 8192
  with GPT-OSS 20B's heads (FakeTensorMode), the float masks the forward
  leaves for the backward and their bytes, what the forward leaves in all
  and the peak, 1 vs 24 layers, shared vs per layer.
"""

import itertools
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.common.rope import RoPE

from torchtitan_neuron.models.gpt_oss.attention import (
    additive_attention_mask,
    attention_mask,
    padded_head_dim,
    sink_sdpa,
    use_sdpa_sink_attention,
    use_sdpa_sink_model,
)
from torchtitan_neuron.memory_accounting.storage_tracker import StorageTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_sink_attention as t  # noqa: E402  (the tests' references)

MIB = 2**20


def _time(fn, repeats=3):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def kernels():
    seq, width = 64, padded_head_dim(16)
    q = torch.randn(2, 4, seq, width)
    k = torch.randn(2, 2, seq + 1, width)
    for v_dim in (width, 16):
        v = torch.randn(2, 2, seq + 1, v_dim)
        for dtype in (torch.float32, torch.bfloat16):
            for kind, mask in (("bool", attention_mask(seq, 4, "cpu")),
                               ("additive", additive_attention_mask(seq, 4, "cpu", dtype))):
                choice = torch._fused_sdp_choice(q.to(dtype), k.to(dtype), v.to(dtype), mask,
                                                 0.0, False, scale=0.3, enable_gqa=True)
                print(f"kernel: q,k dim {width}, v dim {v_dim}, {dtype}, GQA, {kind} mask: "
                      f"{SDPBackend(choice).name}")


def gqa_and_padding():
    torch.manual_seed(0)
    seq, heads, kv = 1024, 64, 8
    for window in (None, 128):
        mask = attention_mask(seq, window, "cpu")
        q, k, v = (torch.randn(1, h, n, 72) for h, n in ((heads, seq), (kv, seq + 1), (kv, seq + 1)))
        gqa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
        rep = lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1),
            attn_mask=mask, scale=0.2)
        print(f"GQA window {window}: enable_gqa == repeat_interleave: {torch.equal(gqa(), rep())}; "
              f"forward {_time(gqa):.0f} ms vs {_time(rep):.0f} ms (S={seq}, 64/8 heads)")
    mask = attention_mask(seq, None, "cpu")
    for width in (64, 65, 72):
        q = torch.randn(1, heads, seq, width, requires_grad=True)
        k = torch.randn(1, kv, seq + 1, width, requires_grad=True)
        v = torch.randn(1, kv, seq + 1, width, requires_grad=True)
        step = lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True).sum().backward()
        print(f"head dim {width}: forward+backward {_time(step):.0f} ms (S={seq}, 64/8 heads)")


def memory_at_8192():
    seq, heads, kv, dim = 8192, 64, 8, 64
    print(f"bool mask at seq {seq}: {seq * (seq + 1)} bytes = {seq * (seq + 1) / MIB:.1f} MiB; "
          f"a per-head float32 mask: {heads * seq * seq * 4 / 2**30:.0f} GiB")
    with FakeTensorMode():
        for dtype in (torch.bfloat16, torch.float32):
            mask = additive_attention_mask(seq, 128, "cpu", dtype)
            size = mask.numel() * mask.element_size()
            print(f"additive mask at seq {seq}, {dtype}: {tuple(mask.shape)}, {size} bytes = "
                  f"{size / MIB:.2f} MiB; the model's two (full, window): {2 * size} bytes")
    for dtype in (torch.float32, torch.bfloat16):
        with FakeTensorMode():
            q = torch.randn(1, seq, heads, dim, dtype=dtype, requires_grad=True)
            k = torch.randn(1, seq, kv, dim, dtype=dtype, requires_grad=True)
            v = torch.randn(1, seq, kv, dim, dtype=dtype, requires_grad=True)
            sinks = torch.randn(heads, requires_grad=True)
            tracker = StorageTracker(record_peak=True)
            with tracker:
                out = sink_sdpa(q, k, v, sinks, attention_mask(seq, 128, "cpu"), 0.125, True)
                out.sum().backward()
        print(f"traced attention forward+backward, {dtype}, seq {seq}: peak "
              f"{tracker.peak / MIB:.0f} MiB")
        for size, count, _, op, shape, dt in tracker.largest_at_peak(6):
            print(f"    {size / MIB:7.1f} MiB  {op} {shape} {dt}")


def differences():
    FlexAttention._compiled_flex_attn = flex_attention
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    worst = 0.0
    for (window, seq), random_sinks, docs in itertools.product(t.WINDOWS, [False, True], [False, True]):
        q, k, v = t.qkv(seq)
        sinks = torch.randn(t.HQ, generator=t.seeded(4)) * 2 if random_sinks else torch.zeros(t.HQ)
        starts = t.starts_for(seq) if docs else None
        worst = max(worst, t.rel(t.ours(q, k, v, sinks, window, starts),
                                 t.flex_reference(q, k, v, sinks, window, starts)))
    print(f"forward vs upstream Flex, float32, 12 cases: max relative {worst:.1e}")
    for window, seq in t.WINDOWS[:2]:
        q, k, v = t.qkv(seq, torch.float64, seed=1)
        sinks = torch.randn(t.HQ, dtype=torch.float64, generator=t.seeded(2))
        weight = torch.randn(t.B, seq, t.HQ, t.DH, dtype=torch.float64, generator=t.seeded(3))
        starts = t.starts_for(seq)
        want = t.reference_grads(t.naive, q, k, v, sinks, window, starts, weight)
        g64 = [t.rel(a, b) for a, b in zip(t.reference_grads(t.ours, q, k, v, sinks, window, starts, weight), want)]
        low = [x.float() for x in (q, k, v, sinks, weight)]
        g32 = [t.rel(a.double(), b)
               for a, b in zip(t.reference_grads(t.ours, *low[:4], window, starts, low[4]), want)]
        print(f"gradients q, k, v, sinks, window {window}: float64 max {max(g64):.1e}, "
              f"float32 max {max(g32):.1e} (relative to the float64 reference)")
    worst = 0.0
    for layer, docs in itertools.product((0, 1), (False, True)):
        flex, converted = t.debug_attention_configs()
        torch.manual_seed(0)
        upstream = flex.layers[layer].attention.build()
        upstream.init_states()
        with torch.no_grad():
            upstream.sinks.normal_()
        module = converted.layers[layer].attention.build()
        module.init_states()
        module.load_state_dict(upstream.state_dict(), strict=True)
        x, starts = torch.randn(t.B, 256, flex.dim), t.starts_for(256) if docs else None
        window = flex.layers[layer].attention.sliding_window_size
        with torch.no_grad():
            worst = max(worst, t.rel(module(x, None if starts is None else t.block_causal_mask(starts)),
                                     upstream(x, t.flex_block_mask(256, window, starts))))
    print(f"SdpaSinkAttention vs upstream Attention (Flex), debug model layers 0 and 1: "
          f"max relative {worst:.1e}")


def model_figures():
    FlexAttention._compiled_flex_attn = flex_attention
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
    seq = 64
    tokens = t.token_batch(t.B, seq)
    worst = 0.0
    for docs in (False, True):
        flex = t.build_model(t.small_gpt_oss(2))
        model = t.build_model(use_sdpa_sink_model(t.small_gpt_oss(2)), state=flex.state_dict())
        starts = t.starts_for(seq) if docs else None
        flex_masks = {"basic_mask": t.flex_block_mask(seq, None, starts),
                      "sliding_window_mask": t.flex_block_mask(seq, t.SMALL_WINDOW, starts)}
        with torch.no_grad():
            worst = max(worst, t.rel(
                model(tokens, attention_masks=None if starts is None else t.block_causal_mask(starts)),
                flex(tokens, attention_masks=flex_masks)))
    print(f"model (2 layers, window {t.SMALL_WINDOW} and full, S {seq}) vs upstream's with Flex, "
          f"float32, causal and documents: max relative {worst:.1e}")

    config = use_sdpa_sink_model(t.small_gpt_oss(2))
    reference = t.build_model(config)
    state = reference.state_dict()
    masks = t.block_causal_mask(t.starts_for(seq))
    with torch.no_grad():
        expected = reference(tokens, attention_masks=masks)
    for kind in ("cast", "autocast", "simple_fsdp", "fsdp2"):
        actual, _ = t.bf16_logits(kind, config, state, tokens, masks)
        print(f"model in bfloat16 ({kind}) vs float32, documents: relative {t.rel(actual, expected):.1e}")
    flex = t.build_model(t.small_gpt_oss(2), state=state)
    flex_masks = {"basic_mask": t.flex_block_mask(seq, None, t.starts_for(seq)),
                  "sliding_window_mask": t.flex_block_mask(seq, t.SMALL_WINDOW, t.starts_for(seq))}
    with torch.no_grad():
        flex32 = flex(tokens, attention_masks=flex_masks)
        flex16 = flex.to(torch.bfloat16)(tokens, attention_masks=flex_masks).float()
    print(f"upstream's model with Flex in bfloat16 (cast) vs its float32: relative "
          f"{t.rel(flex16, flex32):.1e}")

    seq = 1024
    for docs in (False, True):
        for n_layers in (2, 4):
            shared = t.large_floats(t.build_model(use_sdpa_sink_model(t.small_gpt_oss(n_layers))),
                                     seq, docs)
            upstream_config = t.small_gpt_oss(n_layers)
            use_sdpa_sink_attention(upstream_config)
            per_layer = t.large_floats(t.build_model(upstream_config), seq, docs)
            print(f"float tensors >= S*S made by forward+backward, S {seq}, {n_layers} layers, "
                  f"documents {docs}: shared {len(shared)}, upstream's model class {len(per_layer)} "
                  f"({sorted(set(shared + per_layer))})")


def model_memory_at_8192():
    seq = 8192
    for dtype in (torch.bfloat16, torch.float32):
        for n_layers in (1, 24):
            for shared in (True, False):
                config = t.small_gpt_oss(n_layers, window=128, heads=(64, 8, 64))
                if shared:
                    config = use_sdpa_sink_model(config)
                else:
                    use_sdpa_sink_attention(config)
                default = torch.get_default_dtype()
                torch.set_default_dtype(dtype)  # parameters made in dtype
                try:
                    with FakeTensorMode():
                        model = config.build()
                        # No values to draw on FakeTensors: only the RoPE caches.
                        for module in model.modules():
                            if isinstance(module, RoPE):
                                module._init_self_buffers(buffer_device=None)
                        tokens = torch.randint(0, 256, (1, seq))
                        tracker = StorageTracker(record_peak=True)
                        with tracker:
                            loss = model(tokens).float().square().mean()
                            # What the forward leaves for the backward.
                            held = [tracker.live[key][0] for key, (_, shape, dt)
                                    in tracker._made_by.items()
                                    if shape == (1, 1, seq, seq + 1) and "bool" not in dt]
                            after_forward = tracker.current
                            loss.backward()
                finally:
                    torch.set_default_dtype(default)
                print(f"seq {seq}, {dtype}, {n_layers} layer(s), "
                      f"{'shared masks' if shared else 'upstream model class'}: {len(held)} float "
                      f"masks held for the backward, {sum(held)} bytes ({sum(held) / MIB:.0f} MiB); "
                      f"held after forward {after_forward / MIB:.0f} MiB, peak "
                      f"{tracker.peak / MIB:.0f} MiB")


class _FusedInputs(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "fused_attention_overrideable" in str(func):
            shapes = [f"{tuple(a.shape)} {a.dtype}" for a in args if isinstance(a, torch.Tensor)]
            print(f"{func}: {', '.join(shapes)}")
        return func(*args, **(kwargs or {}))


def neuron_rehearsal():
    from torchtitan_neuron.tracing import neuron_device as device

    device.setup("trn2")
    seq, heads, kv, dim = 8192, 64, 8, 64
    with FakeTensorMode():
        q = torch.randn(1, seq, heads, dim, device="neuron", dtype=torch.bfloat16,
                        requires_grad=True)
        k, v = (torch.randn(1, seq, kv, dim, device="neuron", dtype=torch.bfloat16)
                for _ in range(2))
        sinks = torch.randn(heads, device="neuron")
        for name, mask in (("boolean mask", attention_mask(seq, 128, "neuron")),
                           ("the model's additive mask",
                            additive_attention_mask(seq, 128, "neuron", torch.bfloat16))):
            print(f"{name}:")
            with _FusedInputs():
                sink_sdpa(q, k, v, sinks, mask, 0.125, True).sum().backward()


if __name__ == "__main__":
    if "--neuron" in sys.argv:
        neuron_rehearsal()
        sys.exit()
    if "--model" in sys.argv:
        model_figures()
        model_memory_at_8192()
        sys.exit()

    kernels()
    gqa_and_padding()
    memory_at_8192()
    differences()
    model_figures()
    model_memory_at_8192()
