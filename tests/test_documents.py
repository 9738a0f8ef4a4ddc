"""Packed-document isolation (``--model.attn_mask_type block_causal``).

Proves, on the Llama debug model of the SimpleFSDP recipes (eager and under
torch.compile):

- document boundaries, positions and the mask are read from the token stream
  (BOS starts a document, so does the token after an EOS, and every row);
- with block_causal, changing the tokens of document 1 of a packed row leaves
  every logit of document 2 unchanged; with causal they change;
- with block_causal and per-document positions, a packed row gives, for each
  document, the logits of that document run alone (without them too, up to
  rounding: rotary attention depends on relative positions only);
- the startup notice's share of cross-document attention pairs.

End to end, as a user runs them: SimpleFSDP jit at TP2 against torchtitan's
eager FSDP2 Trainer, both block_causal with per-document positions, in
test_correctness.py; the SimpleFSDP DeepSeek TP2 x FSDP2 comparison with one
rank, block_causal, in test_deepseek.py; the causal start-up notice in
test_training.py.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_documents.py -q
"""

import dataclasses

import pytest
import torch

from torchtitan_neuron.components.documents import (
    BlockCausalAttention,
    ModelOptions,
    apply_model_options,
    block_causal_mask,
    cross_document_share,
    document_ids,
    document_positions,
    document_starts,
)

BOS, EOS = 1, 2
SEQ = 48


def _model(mask_type: str, reset_positions: bool):
    from torchtitan_neuron.experiments.graph_trainer.llama3.config_registry import (
        simple_fsdp_llama3_debugmodel,
    )

    config = simple_fsdp_llama3_debugmodel().model_spec.model
    apply_model_options(config, ModelOptions(
        attn_mask_type=mask_type, reset_positions_per_document=reset_positions))
    for layer in config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model.eval()


def _forward(model, tokens, block: bool, reset_positions: bool):
    starts = document_starts(tokens, BOS, EOS)
    kwargs = {"positions": document_positions(starts) if reset_positions
              else torch.arange(tokens.shape[1]).expand_as(tokens)}
    if block:
        kwargs["attention_masks"] = block_causal_mask(starts)
    with torch.no_grad():
        return model(tokens, **kwargs)


def _document(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([BOS]), torch.randint(3, 2000, (length - 1,), generator=g)])


@pytest.fixture(scope="module")
def models():
    return {(mask, reset): _model(mask, reset)
            for mask, reset in (("causal", False), ("block_causal", False),
                                ("block_causal", True))}


def test_boundaries_positions_and_mask_from_tokens():
    tokens = torch.tensor([[7, 8, BOS, 9, 10, EOS, 11, BOS, 12]])
    starts = document_starts(tokens, BOS, EOS)
    # Row start, each BOS, and the token after the EOS.
    assert starts[0].nonzero().flatten().tolist() == [0, 2, 6, 7]
    assert document_ids(starts)[0].tolist() == [1, 1, 2, 2, 2, 2, 3, 4, 4]
    assert document_positions(starts)[0].tolist() == [0, 1, 0, 1, 2, 3, 0, 0, 1]
    mask = block_causal_mask(starts)
    assert mask.shape == (1, 1, 9, 9) and mask.dtype == torch.bool
    docs = document_ids(starts)[0]
    for i in range(9):
        for j in range(9):
            assert bool(mask[0, 0, i, j]) == (j <= i and bool(docs[i] == docs[j]))


def test_cross_document_share():
    one_doc = document_starts(torch.tensor([[BOS, 5, 6, 7]]), BOS, EOS)
    assert cross_document_share(one_doc) == 0.0
    # Two documents of 2 tokens: 10 causal pairs, 3 + 3 within documents.
    two_docs = document_starts(torch.tensor([[BOS, 5, BOS, 6]]), BOS, EOS)
    assert cross_document_share(two_docs) == pytest.approx(1 - 6 / 10)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_document_2_does_not_see_document_1(models, compiled):
    doc1, doc1_changed, doc2 = _document(20, 1), _document(20, 2), _document(SEQ - 20, 3)
    row = torch.cat([doc1, doc2]).unsqueeze(0)
    changed = torch.cat([doc1_changed, doc2]).unsqueeze(0)
    for mask in ("block_causal", "causal"):
        model = models[(mask, False)]
        if compiled:
            model = torch.compile(model, backend="aot_eager", fullgraph=True)
        block = mask == "block_causal"
        a, b = _forward(model, row, block, False), _forward(model, changed, block, False)
        doc2_a, doc2_b = a[0, 20:], b[0, 20:]
        if block:
            torch.testing.assert_close(doc2_a, doc2_b, rtol=0, atol=0)
        else:
            assert (doc2_a - doc2_b).abs().max() > 1e-3
        # Document 1's own logits change in both cases.
        assert (a[0, :20] - b[0, :20]).abs().max() > 1e-3


def test_packed_equals_unpacked_with_document_positions(models):
    lengths = (13, 21, SEQ - 34)
    docs = [_document(n, 10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs).unsqueeze(0)
    model = models[("block_causal", True)]
    logits = _forward(model, packed, block=True, reset_positions=True)[0]
    offset = 0
    for doc in docs:
        alone = _forward(model, doc.unsqueeze(0), block=True, reset_positions=True)[0]
        torch.testing.assert_close(logits[offset:offset + len(doc)], alone,
                                   rtol=1e-5, atol=1e-5)
        offset += len(doc)
    # Rotary attention depends only on relative positions, so inside a
    # closed document a constant position offset changes nothing but rounding:
    # without per-document positions the documents match their runs alone too.
    plain = _forward(models[("block_causal", False)], packed, block=True,
                     reset_positions=False)[0]
    alone = _forward(models[("block_causal", False)], docs[1].unsqueeze(0), block=True,
                     reset_positions=False)[0]
    torch.testing.assert_close(plain[13:34], alone, rtol=1e-4, atol=1e-4)


def test_block_causal_needs_the_mask(models):
    tokens = _document(8, 0).unsqueeze(0)
    with pytest.raises(ValueError, match="document mask"):
        with torch.no_grad():
            models[("block_causal", False)](tokens)


def test_options_validation():
    from torchtitan_neuron.experiments.graph_trainer.llama3.config_registry import (
        simple_fsdp_llama3_debugmodel,
    )

    config = simple_fsdp_llama3_debugmodel().model_spec.model
    apply_model_options(config, ModelOptions(attn_mask_type="causal"))
    assert not isinstance(config.layers[0].attention.inner_attention,
                          BlockCausalAttention.Config)
    assert config.layers[0].attention.rope.use_prefix_cache_for_positions

