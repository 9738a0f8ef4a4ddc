"""The rotary embeddings: the prefix-cache path and the real-arithmetic RoPE.

Proves:

- with ``use_prefix_cache_for_positions`` the module ignores the dataloader's
  per-document positions and rotates by 0..S-1, exactly what the gather path
  gives for positions 0..S-1, for both cache formats; without the switch it
  equals torchtitan's own;
- ``PrefixCacheComplexRoPE`` equals torchtitan's ``ComplexRoPE`` within 1e-6
  in float32, outputs and gradients, with no scaling, the Llama debug model's
  llama scaling and DeepSeek-V3 16B's yarn scaling, positions sliced or
  gathered per row; with bfloat16 inputs within one bfloat16 rounding step;
- its forward and backward graphs hold no complex dtype and no
  ``view_as_complex``, ``view_as_real`` or ``polar`` (upstream's do);
- its cache is a non-persistent float32 buffer of (cos, sin), rebuilt by
  ``init_states`` after a meta build and under FakeTensorMode;
- the Llama debug model built by the recipes has the same parameters and,
  on the same weights, logits within 1e-6 relative of upstream's model.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_rope.py -q
"""

import importlib

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves

from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

from torchtitan_neuron.components.rope import PrefixCacheComplexRoPE, with_prefix_cache_rope
from torchtitan_neuron.config_utils import promote

B, S, H, D = 3, 16, 2, 8
# Measured: at most 2.4e-7 (outputs and gradients; the llama and yarn cases
# and the model's logits are bitwise equal).
FP32_ATOL = 1e-6
# One bfloat16 rounding step of the result (measured: bitwise equal).
BF16_RTOL = 2**-7


@pytest.mark.parametrize("upstream", [ComplexRoPE, CosSinRoPE])
def test_prefix_cache_equals_gather_of_arange(upstream):
    base = upstream.Config(dim=D, max_seq_len=64)
    ours = with_prefix_cache_rope(base)
    # The gather path of the same module: the switch is all that differs.
    gather = ours.build()
    ours.use_prefix_cache_for_positions = True
    prefix = ours.build()
    torch.manual_seed(0)
    q, k = torch.randn(B, S, H, D), torch.randn(B, S, H, D)

    arange = torch.arange(S).repeat(B, 1)
    per_document = torch.cat([torch.arange(5), torch.arange(S - 5)]).repeat(B, 1)

    expected = gather(q, k, arange)
    for positions in (None, per_document):
        got = prefix(q, k, positions)
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    # The gather path does honour per-document positions: the switch matters.
    assert not torch.equal(gather(q, k, per_document)[0], expected[0])


def test_switch_off_is_upstream_behaviour():
    base = ComplexRoPE.Config(dim=D, max_seq_len=64)
    ours = with_prefix_cache_rope(base)
    torch.manual_seed(0)
    q, k = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    positions = torch.randint(0, 64, (B, S))
    got, expected = ours.build()(q, k, positions), base.build()(q, k, positions)
    torch.testing.assert_close(got, expected, rtol=0, atol=FP32_ATOL)


def _upstream_config(config) -> ComplexRoPE.Config:
    return promote(config, ComplexRoPE.Config, drop=["use_prefix_cache_for_positions"])


def _recipe_rope(module: str, flavor: str) -> ComplexRoPE.Config:
    """The first layer's RoPE settings of a recipe module's model, as
    torchtitan's own config."""
    registry = importlib.import_module(module).model_registry
    layers = registry(flavor).model.layers
    assert {type(layer.attention.rope) for layer in layers} == {PrefixCacheComplexRoPE.Config}
    return _upstream_config(layers[0].attention.rope)


@pytest.fixture(scope="module")
def scalings():
    return {
        "none": ComplexRoPE.Config(dim=D, max_seq_len=64),
        "llama": _recipe_rope("torchtitan_neuron.experiments.graph_trainer.llama3", "debugmodel"),
        "yarn": _recipe_rope("torchtitan_neuron.models.deepseek_v3", "16B"),
    }


def _pair(base: ComplexRoPE.Config):
    """torchtitan's module and ours, for the same settings."""
    return base.build(), with_prefix_cache_rope(base).build()


def _inputs(base: ComplexRoPE.Config, dtype: torch.dtype, per_row: bool):
    """Query and key shaped as attention passes them (key with one head, as
    MLA's k_pe and grouped-query keys), and positions (None: sliced)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, base.dim, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, S, 1, base.dim, generator=g).to(dtype).requires_grad_()
    positions = torch.randint(0, base.max_seq_len, (B, S), generator=g) if per_row else None
    return q, k, positions


def _grads(outputs, q, k):
    # A loss whose gradient differs per element, so a wrong sign or pair shows.
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(1)) for o in outputs]
    loss = sum((o.float() * w).sum() for o, w in zip(outputs, weights))
    return torch.autograd.grad(loss, (q, k))


@pytest.mark.parametrize("per_row", [False, True], ids=["sliced", "per-row"])
@pytest.mark.parametrize("scaling", ["none", "llama", "yarn"])
def test_equals_upstream_in_float32(scalings, scaling, per_row):
    base = scalings[scaling]
    assert base.scaling == scaling
    upstream, ours = _pair(base)
    q, k, positions = _inputs(base, torch.float32, per_row)
    expected, got = upstream(q, k, positions), ours(q, k, positions)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=0, atol=FP32_ATOL)
    for g, e in zip(_grads(got, q, k), _grads(expected, q, k)):
        torch.testing.assert_close(g, e, rtol=0, atol=FP32_ATOL)


@pytest.mark.parametrize("per_row", [False, True], ids=["sliced", "per-row"])
@pytest.mark.parametrize("scaling", ["none", "llama", "yarn"])
def test_equals_upstream_in_bfloat16(scalings, scaling, per_row):
    base = scalings[scaling]
    upstream, ours = _pair(base)
    q, k, positions = _inputs(base, torch.bfloat16, per_row)
    for g, e in zip(ours(q, k, positions), upstream(q, k, positions)):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, e, rtol=BF16_RTOL, atol=0)


def _compiled_graphs(rope, q, k, positions) -> list[torch.fx.GraphModule]:
    """The forward and backward graphs AOTAutograd hands a backend."""
    graphs = []

    def capture(gm, _example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    outputs = torch.compile(rope, backend=backend, fullgraph=True)(q, k, positions)
    sum(o.sum() for o in outputs).backward()
    assert len(graphs) == 2, graphs
    return graphs


def _complex_nodes(graph: torch.fx.GraphModule) -> list[str]:
    """Nodes with a complex value or a complex-conversion op."""
    found = []
    for node in graph.graph.nodes:
        values = tree_leaves(node.meta.get("val"))
        complex_value = any(isinstance(v, torch.Tensor) and v.is_complex() for v in values)
        complex_op = any(n in str(node.target) for n in ("view_as_complex", "view_as_real", "polar"))
        if complex_value or complex_op:
            found.append(f"{node.op} {node.target}")
    return found


@pytest.mark.parametrize("per_row", [False, True], ids=["sliced", "per-row"])
def test_graphs_have_no_complex_dtype(per_row):
    base = ComplexRoPE.Config(dim=D, max_seq_len=64, scaling="llama")
    upstream, ours = _pair(base)
    q, k, positions = _inputs(base, torch.float32, per_row)
    for graph in _compiled_graphs(ours, q, k, positions):
        assert graph.graph.find_nodes(op="placeholder"), graph
        assert not _complex_nodes(graph), graph.code
    # The check sees upstream's complex ops, forward and backward.
    assert all(_complex_nodes(g) for g in _compiled_graphs(upstream, q, k, positions))


def test_cache_is_a_float_buffer_rebuilt_after_meta_and_fake_builds():
    config = with_prefix_cache_rope(ComplexRoPE.Config(dim=D, max_seq_len=64, scaling="llama"))
    expected = torch.view_as_real(_upstream_config(config).build().cache)
    built = config.build()
    assert built.cache.dtype == torch.float32 and built.cache.shape == (64, D // 2, 2)
    torch.testing.assert_close(built.cache, expected, rtol=0, atol=0)
    # Its own storage: no complex base for a trace to replay views from.
    assert built.cache._base is None
    assert "cache" not in built.state_dict()

    with torch.device("meta"):
        rope = config.build()
    assert rope.cache.is_meta and rope.cache.shape == expected.shape
    rope.to_empty(device="cpu")
    rope.init_states()
    torch.testing.assert_close(rope.cache, expected, rtol=0, atol=0)

    with FakeTensorMode():
        fake = config.build()
        fake.init_states(buffer_device=torch.device("cpu"))
    assert isinstance(fake.cache, FakeTensor)
    assert fake.cache.dtype == torch.float32 and fake.cache.shape == expected.shape



def _debug_llama(spec):
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    return model.eval()


def test_debug_llama_logits_equal_upstream():
    from torchtitan.experiments.graph_trainer.llama3 import (
        model_registry as upstream_registry,
    )

    from torchtitan_neuron.experiments.graph_trainer.llama3 import model_registry

    upstream = _debug_llama(upstream_registry("debugmodel", attn_backend="sdpa"))
    ours = _debug_llama(model_registry("debugmodel"))
    assert type(upstream.layers["0"].attention.rope) is ComplexRoPE
    assert type(ours.layers["0"].attention.rope) is PrefixCacheComplexRoPE
    shapes = {name: t.shape for name, t in upstream.state_dict().items()}
    assert {name: t.shape for name, t in ours.state_dict().items()} == shapes
    # The same weights whatever the initializers drew (a strict load).
    ours.load_state_dict(upstream.state_dict(), strict=True)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, upstream.tok_embeddings.num_embeddings, (2, 64), generator=g)
    per_document = torch.cat([torch.arange(24), torch.arange(40)]).expand(2, -1)
    with torch.no_grad():
        for positions in (None, per_document):
            expected, got = upstream(tokens, positions), ours(tokens, positions)
            relative = (got - expected).abs().max() / expected.abs().max()
            assert relative <= 1e-6, relative
