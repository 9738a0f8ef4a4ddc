"""The layout-invariant loader: a global batch is the same sequences however
it is reached, and its state resumes at any data-parallel degree.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_data.py -q
"""

import pytest
import torch

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from torchtitan_neuron.data import LayoutInvariantTextDataLoader, layout_invariant

SEQ = 128


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(tokenizer_path="./tests/assets/tokenizer")


def _loader(tokenizer, dp, rank, batch, **config):
    cfg = LayoutInvariantTextDataLoader.Config(dataset="c4_test", **config)
    return LayoutInvariantTextDataLoader(cfg, dp_world_size=dp, dp_rank=rank,
                                         tokenizer=tokenizer, seq_len=SEQ,
                                         local_batch_size=batch)


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _rows(batches, key="input"):
    return torch.cat([inputs[key] for inputs, _ in batches])


def test_global_batch_is_the_same_sequences_on_any_layout(tokenizer):
    # Global batch 8: one rank x 8, one rank x 4 x 2 accumulation steps,
    # two ranks x 4, four ranks x 2: same 8 sequences in the same order.
    reference = _rows(_take(_loader(tokenizer, 1, 0, 8), 2))
    assert torch.equal(_rows(_take(_loader(tokenizer, 1, 0, 4), 4)), reference)
    for dp, batch in ((2, 4), (4, 2)):
        per_rank = [_take(_loader(tokenizer, dp, r, batch), 2) for r in range(dp)]
        # micro-batch m of the run is rank 0's m-th batch, then rank 1's, ...
        stitched = torch.cat([
            torch.cat([per_rank[r][m][0]["input"] for r in range(dp)]) for m in range(2)
        ])
        assert torch.equal(stitched, reference), (dp, batch)


def test_packing_matches_torchtitans_single_rank_stream(tokenizer):
    cfg = HuggingFaceTextDataLoader.Config(dataset="c4_test")
    upstream = HuggingFaceTextDataLoader(cfg, dp_world_size=1, dp_rank=0,
                                         tokenizer=tokenizer, seq_len=SEQ,
                                         local_batch_size=4)
    ours = _take(_loader(tokenizer, 1, 0, 4), 3)
    theirs = _take(upstream, 3)
    for key in ("input", "positions"):
        assert torch.equal(_rows(ours, key), _rows(theirs, key))
    assert torch.equal(torch.cat([l for _, l in ours]), torch.cat([l for _, l in theirs]))


def test_state_resumes_at_another_data_parallel_degree(tokenizer):
    two = [_loader(tokenizer, 2, r, 2) for r in range(2)]
    iters = [iter(x) for x in two]
    for _ in range(3):
        for it in iters:
            next(it)
    states = [x.state_dict() for x in two]
    assert states[0] == states[1]  # one global position, identical on all ranks

    reference = _rows(_take(_loader(tokenizer, 1, 0, 4), 4)[3:])  # global batch 4
    four = [_loader(tokenizer, 4, r, 1) for r in range(4)]
    for loader in four:
        loader.load_state_dict(states[0])
    resumed = torch.cat([next(iter(loader))[0]["input"] for loader in four])
    assert torch.equal(resumed, reference)


def test_bad_settings_are_named(tokenizer):
    with pytest.raises(ValueError, match="--dataloader.num_workers 2"):
        _loader(tokenizer, 1, 0, 2, num_workers=2)
    state = _loader(tokenizer, 1, 0, 2).state_dict()
    other = LayoutInvariantTextDataLoader(
        LayoutInvariantTextDataLoader.Config(dataset="c4_test"), dp_world_size=1,
        dp_rank=0, tokenizer=tokenizer, seq_len=2 * SEQ, local_batch_size=2)
    with pytest.raises(ValueError, match=f"--training.seq_len {SEQ}"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="exclude_from_loading dataloader"):
        other.load_state_dict({"dp_rank_0": b"", "world_size": 2})


def test_recipes_get_the_layout_invariant_loader_with_their_settings():
    upstream = HuggingFaceTextDataLoader.Config(dataset="c4", infinite=False)
    swapped = layout_invariant(upstream)
    assert isinstance(swapped, LayoutInvariantTextDataLoader.Config)
    assert (swapped.dataset, swapped.infinite) == ("c4", False)
