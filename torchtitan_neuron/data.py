"""A text dataloader whose batches do not depend on the data-parallel layout.

torchtitan's ``HuggingFaceTextDataLoader`` gives each data-parallel rank its
own slice of the documents (``split_dataset_by_node``) and packs each slice
separately, so 1 rank, 2 ranks and 4 ranks train on different sequences, and
its checkpointed state cannot be loaded at another data-parallel degree.

This loader packs one global stream of sequences, exactly as torchtitan packs
a single rank's stream (same tokenization, the same in-document shift of
inputs and labels, the same per-document positions), and cuts it into global
micro-batches of ``local_batch_size x dp_world_size`` consecutive sequences;
data-parallel rank ``r`` takes sequences ``[r*B, (r+1)*B)`` of each one. So a
global batch is the same set of sequences however it is reached (a larger
local batch, more ranks, or accumulation steps), and the loader's state (a
position in the global stream, identical on every rank) resumes at any
data-parallel degree.

The price: every rank tokenizes the whole stream, ``dp_world_size`` times the
tokenization work of the split loader. For the CPU rehearsals this project
targets that is a small share of a step.

Held-out validation (``held_out_validation``): with the validator on and no
dataset of its own, one document in ``HOLDOUT_EVERY`` of the training dataset
(chosen by a hash of its text, so the same documents whatever the order or
epoch) is left out of training (``split train``) and is the validation data
(``split validation``).
"""

from __future__ import annotations

import json
import pickle
import zlib
from collections.abc import Iterator
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets.text_datasets import (
    HuggingFaceTextDataLoader,
    _validate_dataset,
)
from torchtitan.tools.logging import logger

from torchtitan_neuron.config_utils import promote

STATE_KEY = "global_stream"
# One document in this many is held out for validation when the validator
# reads the training dataset (5%: 174 of the bundled c4_test's 3487).
HOLDOUT_EVERY = 20
SPLITS = ("all", "train", "validation")
# torchtitan's default validation dataset: c4's validation split, on the Hub.
UPSTREAM_VALIDATION_DATASET = "c4_validation"


# Chat datasets: JSON lines of {"messages": [user, assistant]}, formatted by
# the tokenizer's chat template or the folder's own chat_template.jinja; only
# the assistant's tokens are in the loss. ``chat`` reads any such folder
# (--dataloader.dataset_path); ``chat_test`` is the bundled set
# (scripts/build_chat_assets.py).
CHAT_DATASETS = {"chat": None,
                 "chat_test": str(Path(__file__).parent / "assets" / "chat_test")}
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def chat_data(name: str, path: str | None, flag: str = "--dataloader") -> Path:
    """The ``data.json`` of chat dataset ``name`` (``path``, or the bundled
    folder); a ValueError naming ``flag``'s options when there is none."""
    folder = path or CHAT_DATASETS[name]
    if folder is None:
        raise ValueError(f"{flag}.dataset {name} reads a chat folder of your own: "
                         f"pass {flag}.dataset_path <folder with data.json>.")
    data = Path(folder) / "data.json"
    if not data.is_file():
        raise ValueError(f"{flag}.dataset {name}: {data} does not exist. Pass "
                         f"{flag}.dataset_path <folder with data.json>.")
    return data


def chat_source(name: str, path: str | None):
    """(loader's data, the folder) of a chat dataset, read as JSON lines."""
    from datasets import load_dataset

    data = chat_data(name, path)
    return load_dataset("json", data_files=str(data), split="train"), str(data.parent)


def held_out(text: str) -> bool:
    """Whether a document is in the validation split: a CRC-32 of its text,
    the same on every rank, in every order and epoch."""
    return zlib.crc32(text.encode("utf-8")) % HOLDOUT_EVERY == 0


class PackedTextStream:
    """The global stream of packed ``seq_len`` sequences over a text dataset."""

    def __init__(self, dataset_name: str, dataset_path: str | None,
                 tokenizer: BaseTokenizer, seq_len: int, infinite: bool, split: str = "all"):
        if split not in SPLITS:
            raise ValueError(f"--dataloader.split {split!r}: one of {', '.join(SPLITS)}")
        self.split = split
        self.dataset_name = dataset_name.lower()
        self.chat = self.dataset_name in CHAT_DATASETS
        if self.chat:
            self._data, folder = chat_source(self.dataset_name, dataset_path)
            self._text_of = lambda sample: sample["messages"]
            template = Path(folder) / CHAT_TEMPLATE_FILE
            if getattr(tokenizer, "_chat_template", None) is None:
                if not template.exists():
                    raise ValueError(
                        f"--dataloader.dataset {self.dataset_name}: the tokenizer has no chat "
                        f"template and {template} does not exist; put the template there")
                tokenizer.set_chat_template(template.read_text())
        else:
            path, loader, self._text_of = _validate_dataset(self.dataset_name, dataset_path)
            self._data = loader(path)
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self.sample_idx = 0
        self.epoch = 0
        self.sequence_idx = 0
        self._inputs: list[int] = []
        self._labels: list[int] = []
        self._positions: list[int] = []
        self._samples: Iterator[Any] | None = None

    def _sample_iter(self) -> Iterator[Any]:
        data = self._data
        if self.epoch > 0 and hasattr(data, "shuffle"):
            # The same per-epoch reshuffle torchtitan's loader applies.
            data = data.shuffle(seed=42 + self.epoch)
        if hasattr(data, "skip") and hasattr(data, "__len__"):
            return iter(data.skip(self.sample_idx)) if self.sample_idx else iter(data)
        it = iter(data)
        for _ in range(self.sample_idx):
            next(it)
        return it

    def _read_document(self) -> bool:
        if self._samples is None:
            self._samples = self._sample_iter()
        try:
            sample = next(self._samples)
        except StopIteration:
            if not self.infinite:
                logger.warning(f"Dataset {self.dataset_name} has run out of data")
                return False
            self.epoch += 1
            self.sample_idx = 0
            self._samples = self._sample_iter()
            logger.warning(
                f"Dataset {self.dataset_name} is being re-looped (epoch {self.epoch})"
            )
            try:
                sample = next(self._samples)
            except StopIteration:
                return False
        self.sample_idx += 1
        content = self._text_of(sample)
        key = json.dumps(content, sort_keys=True) if self.chat else content
        if self.split != "all" and held_out(key) != (self.split == "validation"):
            return True  # the other split's document
        pair = self._chat_pair(content) if self.chat else self._text_pair(content)
        if pair is None:
            return True  # a conversation longer than a sequence: dropped
        inputs, labels = pair
        if self.chat and self._inputs and len(self._inputs) + len(inputs) > self.seq_len:
            # A conversation is never split between sequences: pad the rest of
            # this one (a document of its own, out of the loss).
            pad = self.seq_len - len(self._inputs)
            self._inputs.extend([self._tokenizer.eos_id] * pad)
            self._labels.extend([IGNORE_INDEX] * pad)
            self._positions.extend(range(pad))
        # Shift inside the document: a document's last input never predicts
        # the next document's first token (torchtitan's packing).
        self._inputs.extend(inputs)
        self._labels.extend(labels)
        self._positions.extend(range(len(inputs)))
        return True

    def _text_pair(self, text: str) -> tuple[list[int], list[int]]:
        tokens = self._tokenizer.encode(text, add_bos=True, add_eos=True)
        return tokens[:-1], tokens[1:]

    def _chat_pair(self, messages: list[dict]) -> tuple[list[int], list[int]] | None:
        """A single-turn conversation's inputs and labels, the user's turn and
        the template's markers masked out of the loss (as torchtitan's
        ``ChatDataset`` does); None when it does not fit one sequence."""
        roles = [m.get("role") for m in messages]
        if roles != ["user", "assistant"]:
            raise ValueError(f"dataset {self.dataset_name}, conversation {self.sample_idx - 1}: "
                             f"roles {roles}; a conversation here is one user turn, then "
                             "one assistant turn")
        eos = self._tokenizer.eos_id
        text = self._tokenizer.apply_chat_template(messages).rstrip("\n")
        tokens = self._tokenizer.encode(text, add_bos=True, add_eos=False)
        if tokens[-1] != eos:
            tokens.append(eos)
        if len(tokens) - 1 > self.seq_len:
            return None
        prompt = self._tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
        prompt_len = len(self._tokenizer.encode(prompt, add_bos=True, add_eos=False))
        labels = tokens[1:]
        masked = min(max(prompt_len - 1, 0), len(labels))
        labels[:masked] = [IGNORE_INDEX] * masked
        return tokens[:-1], labels

    def next_sequence(self) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        while len(self._inputs) < self.seq_len:
            if not self._read_document():
                return None
        n = self.seq_len
        positions = self._positions[:n]
        offset = positions[0]
        if offset > 0:
            # A document continued from the previous sequence restarts at 0.
            for i, p in enumerate(positions):
                if p == 0:
                    break
                positions[i] = p - offset
        item = (
            {"input": torch.LongTensor(self._inputs[:n]),
             "positions": torch.LongTensor(positions)},
            torch.LongTensor(self._labels[:n]),
        )
        del self._inputs[:n], self._labels[:n], self._positions[:n]
        self.sequence_idx += 1
        return item

    def state_dict(self) -> dict[str, Any]:
        return {
            "sample_idx": self.sample_idx,
            "epoch": self.epoch,
            "sequence_idx": self.sequence_idx,
            "inputs_buffer": list(self._inputs),
            "labels_buffer": list(self._labels),
            "positions_buffer": list(self._positions),
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seq_len"] != self.seq_len:
            raise ValueError(
                f"The checkpoint's data stream was packed at --training.seq_len "
                f"{state['seq_len']}, this run uses {self.seq_len}; the stream "
                "cannot be resumed at another sequence length. Resume with "
                f"--training.seq_len {state['seq_len']}, or start the data "
                "afresh with --checkpoint.exclude_from_loading dataloader."
            )
        self.sample_idx = state["sample_idx"]
        self.epoch = state["epoch"]
        self.sequence_idx = state["sequence_idx"]
        self._inputs = list(state["inputs_buffer"])
        self._labels = list(state["labels_buffer"])
        self._positions = list(state["positions_buffer"])
        self._samples = None


class LayoutInvariantTextDataLoader(BaseDataLoader):
    """Batches of the global packed stream; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        split: str = "all"
        """Which documents: ``all``; ``train``, all but the held-out ones; or
        ``validation``, only those (one in ``HOLDOUT_EVERY``, by a hash of the
        text). Set by the validator's held-out default."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        **kwargs,
    ):
        if config.num_workers:
            raise ValueError(
                f"--dataloader.num_workers {config.num_workers} is not supported "
                "by the layout-invariant text loader, which reads in the training "
                "process; remove the flag (tokenization is a small share of a step)."
            )
        self.stream = PackedTextStream(
            config.dataset, config.dataset_path, tokenizer, seq_len, config.infinite,
            config.split,
        )
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.local_batch_size = local_batch_size

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        batch_size, rank = self.local_batch_size, self.dp_rank
        while True:
            mine = []
            # One global micro-batch: every rank reads all of it and keeps its
            # part, so between batches all ranks hold the same stream state.
            for k in range(batch_size * self.dp_world_size):
                item = self.stream.next_sequence()
                if item is None:
                    return
                if k // batch_size == rank:
                    mine.append(item)
            inputs = {
                key: torch.stack([d[key] for d, _ in mine]) for key in mine[0][0]
            }
            yield inputs, torch.stack([labels for _, labels in mine])

    def state_dict(self) -> dict[str, Any]:
        # The same on every rank, so one key: DCP stores it once, and any
        # data-parallel degree can load it.
        return {STATE_KEY: pickle.dumps(self.stream.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if STATE_KEY not in state_dict:
            raise ValueError(
                "The checkpoint's dataloader state was written by torchtitan's "
                "per-rank loader, not the layout-invariant loader this recipe "
                f"uses (keys: {sorted(state_dict)}). Resume with the recipe that "
                "wrote it, or add --checkpoint.exclude_from_loading dataloader "
                "to start the data afresh."
            )
        self.stream.load_state_dict(pickle.loads(state_dict[STATE_KEY]))


def layout_invariant(dataloader_config: BaseDataLoader.Config) -> BaseDataLoader.Config:
    """The layout-invariant loader in place of torchtitan's text loader, with
    the same settings; any other loader is returned unchanged."""
    if type(dataloader_config) is not HuggingFaceTextDataLoader.Config:
        return dataloader_config
    return promote(dataloader_config, LayoutInvariantTextDataLoader.Config)


def held_out_validation(config) -> str | None:
    """With the validator on, the data it reads, set in ``config``; returns
    what was chosen, for the log, or None when the validator is off.

    torchtitan's default validation dataset is c4's validation split on the
    Hub: it stays for a run that trains on c4 itself (and the preflight says
    when the Hub cannot be reached). For any other training data, and when
    the validator names the training dataset itself, the validator reads the
    held-out split of the training dataset and training skips it, so no
    training document is validated on. Another dataset named for the
    validator is read as it is."""
    if not getattr(config, "validator", None) or not config.validator.enable:
        return None
    train, val = config.dataloader, config.validator.dataloader
    if not isinstance(train, LayoutInvariantTextDataLoader.Config):
        return f"{getattr(val, 'dataset', type(val).__name__)} (as set)"
    default = (type(val) is HuggingFaceTextDataLoader.Config
               and val.dataset == UPSTREAM_VALIDATION_DATASET and not val.dataset_path)
    same = (isinstance(val, HuggingFaceTextDataLoader.Config) and val.dataset == train.dataset
            and (val.dataset_path or None) == (train.dataset_path or None))
    if default and train.dataset == "c4" and not train.dataset_path:
        return f"{UPSTREAM_VALIDATION_DATASET} (c4's own validation split)"
    if not (default or same):
        return f"{val.dataset} (--validator.dataloader.dataset)"
    held = promote(train, LayoutInvariantTextDataLoader.Config)
    held.split = "validation"
    held.infinite = val.infinite
    config.validator.dataloader = held
    train.split = "train"
    return (f"the held-out 1/{HOLDOUT_EVERY} of {train.dataset}'s documents "
            "(left out of training)")
