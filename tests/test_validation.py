"""Validation offline on held-out data: the validator reads the documents
training leaves out, the preflight refuses a validation dataset it cannot
read, the evaluation graph compiles once, and the run summary reports the
last validation loss.

Tier: fast, but the launch (slow).
Run: .venv/bin/python -m pytest tests/test_validation.py -q
"""

import json
from pathlib import Path

import pytest
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import ConfigManager
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, _validate_dataset

from torchtitan_neuron.data import (
    CHAT_DATASETS,
    HOLDOUT_EVERY,
    LayoutInvariantTextDataLoader,
    PackedTextStream,
    held_out,
    held_out_validation,
)

CHAT = Path(CHAT_DATASETS["chat_test"])
LLAMA = ("torchtitan_neuron.experiments.graph_trainer.llama3", "simple_fsdp_llama3_debugmodel")


def _parse(*flags):
    module, config = LLAMA
    return ConfigManager().parse_args(["--module", module, "--config", config,
                                       "--dataloader.dataset", "c4_test", *flags])


def _documents(stream: PackedTextStream) -> list[int]:
    """The sample indices a stream reads (tokenizes) in one pass."""
    read = []
    while True:
        before = len(stream._inputs)
        index = stream.sample_idx
        if not stream._read_document():
            return read
        if len(stream._inputs) > before:
            read.append(index)


def test_the_splits_part_the_documents_by_their_text():
    path, loader, text_of = _validate_dataset("c4_test")
    texts = [text_of(sample) for sample in loader(path)]
    tokenizer = HuggingFaceTokenizer(tokenizer_path="./tests/assets/tokenizer")
    reads = {split: _documents(PackedTextStream("c4_test", None, tokenizer, 64, False, split))
             for split in ("all", "train", "validation")}
    held = [i for i, text in enumerate(texts) if held_out(text)]
    assert reads["all"] == list(range(len(texts)))
    assert reads["validation"] == held
    assert sorted(reads["train"] + reads["validation"]) == reads["all"]
    assert not set(reads["train"]) & set(reads["validation"])
    # About one in HOLDOUT_EVERY (174 of c4_test's 3487 documents).
    assert abs(len(held) - len(texts) / HOLDOUT_EVERY) < 0.2 * len(texts) / HOLDOUT_EVERY
    with pytest.raises(ValueError, match=r"--dataloader.split 'test': one of all, train, "):
        PackedTextStream("c4_test", None, tokenizer, 64, False, "test")


def test_the_validator_reads_the_held_out_split_unless_given_another_dataset():
    # Off: nothing changes.
    config = _parse()
    assert held_out_validation(config) is None
    assert config.dataloader.split == "all"
    # torchtitan's default (c4_validation, on the Hub) on a c4_test run, and
    # the training dataset named again: both read the held-out split.
    for flags in ((), ("--validator.dataloader.dataset", "c4_test")):
        config = _parse("--validator.enable", *flags)
        assert "held-out 1/20 of c4_test" in held_out_validation(config)
        val = config.validator.dataloader
        assert isinstance(val, LayoutInvariantTextDataLoader.Config)
        assert (val.dataset, val.split, config.dataloader.split) == (
            "c4_test", "validation", "train")
    # A run on c4 itself keeps c4's own validation split.
    config = _parse("--validator.enable", "--dataloader.dataset", "c4")
    assert held_out_validation(config).startswith("c4_validation")
    assert type(config.validator.dataloader) is HuggingFaceTextDataLoader.Config
    assert config.dataloader.split == "all"
    # Another dataset is read as it is.
    config = _parse("--validator.enable", "--validator.dataloader.dataset_path", "/data/val",
                    "--validator.dataloader.dataset", "c4_test")
    assert held_out_validation(config) == "c4_test (--validator.dataloader.dataset)"
    assert config.dataloader.split == "all"


def test_the_preflight_refuses_a_validation_dataset_it_cannot_read(monkeypatch, tmp_path):
    from torchtitan_neuron.preflight import PreflightError
    from torchtitan_neuron.preflight import data as checks

    monkeypatch.setattr(checks, "_hub_unreachable", lambda repo: "no network")
    config = _parse("--validator.enable", "--validator.dataloader.dataset", "c4")
    with pytest.raises(PreflightError, match=r"--validator.dataloader.dataset c4 streams "
                       r"allenai/c4 from the Hugging Face Hub, which cannot be reached "
                       r"\(no network\). Use --validator.dataloader.dataset c4_test .* "
                       r"Without a dataset of its own the validator reads a held-out part"):
        checks.check_dataset(config)
    missing = tmp_path / "nowhere"
    config = _parse("--validator.enable", "--validator.dataloader.dataset", "c4_test",
                    f"--validator.dataloader.dataset_path={missing}")
    with pytest.raises(PreflightError, match=r"--validator.dataloader.dataset_path=.*nowhere: "
                       r"no such file or folder"):
        checks.check_dataset(config)
    checks.check_dataset(_parse("--validator.enable"))  # the held-out default reads


def test_chat_conversations_are_masked_to_the_answer_and_never_split(tmp_path):
    from torchtitan.components.loss import IGNORE_INDEX

    tokenizer = HuggingFaceTokenizer(tokenizer_path="./tests/assets/tokenizer")
    stream = PackedTextStream("chat_test", None, tokenizer, 128, False)
    path, _ = str(CHAT / "data.json"), None
    conversations = [json.loads(line)["messages"] for line in open(path)]
    answers, rows = [], []
    for _ in range(6):
        inputs, labels = stream.next_sequence()
        rows.append((inputs["input"].tolist(), labels.tolist(), inputs["positions"].tolist()))
    # Every document (positions from 0) either is one whole conversation,
    # whose labels are its answer and the end of text, or padding.
    for tokens, labels, positions in rows:
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for a, b in zip(starts, starts[1:]):
            kept = [y for y in labels[a:b] if y != IGNORE_INDEX]
            if not kept:
                assert set(tokens[a:b]) == {tokenizer.eos_id}  # padding
                continue
            assert kept[-1] == tokenizer.eos_id
            answers.append(tokenizer.decode(kept[:-1]))
    expected = [m[1]["content"] for m in conversations[:len(answers)]]
    assert answers == expected and len(answers) >= 8
    # The bundled template is used when the tokenizer has none; roles are checked.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "data.json").write_text(json.dumps({"messages": [
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi"}]}) + "\n")
    (bad / "chat_template.jinja").write_text((CHAT / "chat_template.jinja").read_text())
    with pytest.raises(ValueError, match=r"roles \['assistant', 'user'\]; a conversation here "
                       r"is one user turn, then one assistant turn"):
        PackedTextStream("chat", str(bad), tokenizer, 128, False).next_sequence()


def test_the_preflight_reads_a_chat_folder_line_by_line(tmp_path):
    from torchtitan_neuron.preflight import PreflightError
    from torchtitan_neuron.preflight import data as checks

    checks.check_dataset(_parse("--dataloader.dataset", "chat_test"))
    with pytest.raises(PreflightError, match=r"--dataloader.dataset chat reads a chat folder "
                       r"of your own: pass --dataloader.dataset_path"):
        checks.check_dataset(_parse("--dataloader.dataset", "chat"))
    (tmp_path / "data.json").write_text('{"messages": []}\n')
    with pytest.raises(PreflightError, match=r"data.json:1: messages with roles \[\]\. Each "
                       r"line of a chat dataset is one user turn then one assistant turn"):
        checks.check_dataset(_parse("--dataloader.dataset", "chat",
                                    f"--dataloader.dataset_path={tmp_path}"))


@pytest.mark.e2e
@pytest.mark.slow
def test_sft_recipe_trains_on_answers_validates_held_out_and_compiles_once(run, dump_folder):
    # The CPU SFT recipe as a user runs it (NGPU, CONFIG, nothing else but a
    # shorter run): chat data, block-causal, the validator on its held-out
    # conversations with the trainer's own masks.
    out = run(["--training.steps", "6", "--validator.freq", "3"],
              config="simple_fsdp_llama3_debugmodel_sft", ngpu=2, dump_folder=dump_folder,
              env={"TORCH_LOGS": "recompiles"})
    assert out.returncode == 0, out.tail()
    assert "reads the held-out 1/20 of chat_test's documents" in out.output
    validations = [line for line in out.output.splitlines() if "validate step:" in line]
    assert len(validations) == 3, validations  # steps 1, 3 and 6
    # The evaluation graphs compile at the first validation (grad mode off),
    # once each for the model and the loss; later validations reuse them.
    recompiles = [line for line in out.output.splitlines() if "Recompiling function" in line]
    assert len(recompiles) == 2, recompiles
    summary = json.loads((dump_folder / "run_summary.json").read_text())
    assert [v["step"] for v in summary["validation"]] == [1, 3, 6]
    losses = [row["loss"] for row in summary["steps"]]
    assert losses[-1] < losses[0] - 1.0  # the answers' format is learnt fast
    assert summary["validation"][-1]["loss"] < summary["validation"][0]["loss"]
    assert f"validation loss      {summary['validation_loss_last']:.5f} at step 6" in out.output


def test_the_bundled_chat_set_rebuilds_byte_for_byte(monkeypatch, tmp_path):
    import build_chat_assets

    monkeypatch.setattr(build_chat_assets, "OUT", tmp_path)
    build_chat_assets.main()
    for name in ("data.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (CHAT / name).read_bytes()
