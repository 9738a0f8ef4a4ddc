"""The prefix-cache rotary path.

Proves: with ``use_prefix_cache_for_positions`` the module ignores the
dataloader's per-document positions and rotates by 0..S-1, exactly what
torchtitan's gather path gives for positions 0..S-1, for both cache formats;
without the switch the module is torchtitan's own.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_rope.py -q
"""

import pytest
import torch

from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

from torchtitan_neuron.components.rope import with_prefix_cache_rope

B, S, H, D = 3, 16, 2, 8


@pytest.mark.parametrize("upstream", [ComplexRoPE, CosSinRoPE])
def test_prefix_cache_equals_gather_of_arange(upstream):
    base = upstream.Config(dim=D, max_seq_len=64)
    ours = with_prefix_cache_rope(base)
    ours.use_prefix_cache_for_positions = True
    reference, prefix = base.build(), ours.build()
    torch.manual_seed(0)
    q, k = torch.randn(B, S, H, D), torch.randn(B, S, H, D)

    arange = torch.arange(S).repeat(B, 1)
    per_document = torch.cat([torch.arange(5), torch.arange(S - 5)]).repeat(B, 1)

    expected = reference(q, k, arange)
    for positions in (None, per_document):
        got = prefix(q, k, positions)
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    # The gather path does honour per-document positions: the switch matters.
    assert not torch.equal(reference(q, k, per_document)[0], expected[0])


def test_switch_off_is_upstream_behaviour():
    base = ComplexRoPE.Config(dim=D, max_seq_len=64)
    ours = with_prefix_cache_rope(base)
    torch.manual_seed(0)
    q, k = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    positions = torch.randint(0, 64, (B, S))
    torch.testing.assert_close(ours.build()(q, k, positions), base.build()(q, k, positions))
