"""Validation offline on held-out data: the validator reads the documents
training leaves out, the preflight refuses a validation dataset it cannot
read, the evaluation graph compiles once, and the run summary reports the
last validation loss. The SFT recipe on 1 rank, FSDP2, TP2 x FSDP2, CP2 and
PP2, and the LoRA recipe on the first three, print the same training and
validation losses (fp32).

Tier: fast, but the eight launches (slow, about 5 minutes).
Run: .venv/bin/python -m pytest tests/test_validation.py -q
"""

import json
import re
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
    # Sound lines, but neither the tokenizer nor the folder has a chat template.
    (tmp_path / "data.json").write_text((CHAT / "data.json").read_text().splitlines()[0] + "\n")
    with pytest.raises(PreflightError, match=r"--dataloader.dataset chat: the tokenizer in "
                       r"\S+ has no chat template .*/chat_template.jinja does not exist: put a "
                       r"Jinja chat template in either"):
        checks.check_dataset(_parse("--dataloader.dataset", "chat", "--hf_assets_path",
                                    "./tests/assets/tokenizer",
                                    f"--dataloader.dataset_path={tmp_path}"))
    (tmp_path / "chat_template.jinja").write_text((CHAT / "chat_template.jinja").read_text())
    checks.check_dataset(_parse("--dataloader.dataset", "chat", "--hf_assets_path",
                                "./tests/assets/tokenizer", f"--dataloader.dataset_path={tmp_path}"))


def test_the_bundled_chat_set_rebuilds_byte_for_byte(monkeypatch, tmp_path):
    import build_chat_assets

    monkeypatch.setattr(build_chat_assets, "OUT", tmp_path)
    build_chat_assets.main()
    for name in ("data.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (CHAT / name).read_bytes()


SFT_LAYOUTS = {
    # name: (NGPU, flags, LOG_RANK): 8 sequences a step on every layout, and
    # 8 a validation (the validator reads the local batch on each DP rank).
    "1 rank": (1, ["--training.local_batch_size", "8"], None),
    "FSDP2": (2, [], None),
    "TP2 x FSDP2": (4, ["--parallelism.tensor_parallel_degree", "2"], None),
    "CP2": (2, ["--parallelism.context_parallel_degree", "2",
                "--training.local_batch_size", "8"], None),
    "PP2": (2, ["--parallelism.pipeline_parallel_degree", "2",
                "--training.local_batch_size", "8"], "1"),
}
FP32_RUN = ["--compile.backend", "aot_eager", "--training.mixed_precision_param", "float32",
            "--debug.seed", "0", "--training.steps", "4", "--validator.freq", "2"]


@pytest.mark.e2e
@pytest.mark.slow
def test_sft_and_lora_losses_agree_across_layouts(run, tmp_path):
    """The SFT recipe on 1 rank, FSDP2, TP2 x FSDP2, CP2 and PP2, and the
    LoRA recipe on the first three (fp32, the same 8 conversations a step):
    training and held-out validation losses within 1e-5 relative of 1 rank's."""
    recipes = {"simple_fsdp_llama3_debugmodel_sft": list(SFT_LAYOUTS),
               "simple_fsdp_llama3_debugmodel_lora": ["1 rank", "FSDP2", "TP2 x FSDP2"]}
    worst = 0.0
    for recipe, layouts in recipes.items():
        reference = None
        for name in layouts:
            ngpu, flags, log_rank = SFT_LAYOUTS[name]
            dump = tmp_path / f"{recipe}-{ngpu}-{len(flags)}"
            out = run([*FP32_RUN, *flags], config=recipe, ngpu=ngpu, dump_folder=dump,
                      env={"LOG_RANK": log_rank} if log_rank else {"TORCH_LOGS": "recompiles"})
            assert out.returncode == 0, out.tail()
            if (recipe, name) == ("simple_fsdp_llama3_debugmodel_sft", "FSDP2"):
                _check_sft_launch(out, dump)
            losses = [s.loss for s in out.steps]
            # As printed: training to 5 decimals, validation to 4.
            validation = [float(v) for v in re.findall(r"validate step:\s+\d+\s+loss:\s+([\d.]+)",
                                                        out.output)]
            assert len(losses) == 4 and len(validation) == 3, (losses, validation)
            print(f"sft-figure {recipe} {name}: losses {losses}, validation {validation}")
            if reference is None:
                reference = losses, validation
                continue
            for a, b in zip(losses, reference[0]):
                worst = max(worst, abs(a - b) / abs(b))
                assert abs(a - b) <= 1e-5 * abs(b), (recipe, name, losses, reference[0])
            for a, b in zip(validation, reference[1]):
                assert abs(a - b) <= 1.5e-4, (recipe, name, validation, reference[1])
    print(f"sft-figure largest relative difference of a training loss: {worst:.2e}")


def _check_sft_launch(out, dump):
    """The SFT recipe on 2 ranks: chat data, block-causal, the validator on
    its held-out conversations with the trainer's own masks, compiled once."""
    assert "reads the held-out 1/20 of chat_test's documents" in out.output
    # The evaluation graphs compile at the first validation (grad mode off),
    # once each for the model and the loss; later validations reuse them.
    recompiles = [line for line in out.output.splitlines() if "Recompiling function" in line]
    assert len(recompiles) == 2, recompiles
    summary = json.loads((dump / "run_summary.json").read_text())
    assert [v["step"] for v in summary["validation"]] == [1, 2, 4]
    losses = [row["loss"] for row in summary["steps"]]
    assert losses[-1] < losses[0] - 1.0  # the answers' format is learnt fast
    assert summary["validation"][-1]["loss"] < summary["validation"][0]["loss"]
    assert f"validation loss      {summary['validation_loss_last']:.5f} at step 4" in out.output
