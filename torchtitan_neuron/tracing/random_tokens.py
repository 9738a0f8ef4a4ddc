"""Random token batches of a recipe's vocabulary: no tokenizer, no corpus.

For a step whose values do not matter (the memory planner traces it on
FakeTensors), so that a recipe's tokenizer and dataset, gated, remote or
only in a checkout, are not needed. Both plug in through torchtitan's own
component configs (``config.tokenizer``, ``config.dataloader``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer


class VocabularySize(BaseTokenizer):
    """A tokenizer that knows only the vocabulary size: nothing is encoded."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 0

    def __init__(self, config: Config, *, tokenizer_path: str | None = None):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.bos_id = None

    def encode(self, *args, **kwargs) -> list[int]:
        raise TypeError(
            "VocabularySize has no vocabulary file and encodes no text; its "
            "step reads random token ids (RandomTokens). Use the recipe's "
            "tokenizer to train on text."
        )

    def decode(self, *args, **kwargs) -> str:
        raise TypeError("VocabularySize has no vocabulary file and decodes no ids.")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class RandomTokens(BaseDataLoader):
    """Endless ``({"input", "positions"}, labels)`` batches of uniform random
    ids below ``vocab_size``; batch ``i`` of a data-parallel rank is drawn
    from its own seed, so the loader resumes from its count."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "random_tokens"
        vocab_size: int = 0
        seed: int = 0
        infinite: bool = True
        """Always endless; the field is there because torchtitan's validator
        sets it on its loader's config."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int,
                 tokenizer: BaseTokenizer | None, seq_len: int, local_batch_size: int,
                 snapshot_every_n_steps: int | None = None):
        if config.vocab_size <= 0:
            raise ValueError(
                f"RandomTokens needs the model's vocabulary size, got {config.vocab_size}: "
                "set RandomTokens.Config(vocab_size=config.model_spec.model.vocab_size)."
            )
        self.config = config
        self.rank, self.world = dp_rank, dp_world_size
        self.shape = (local_batch_size, seq_len)
        self.drawn = 0

    def batch(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        generator = torch.Generator().manual_seed(
            (self.config.seed * self.world + self.rank) * 2**32 + self.drawn)
        self.drawn += 1
        batch, seq = self.shape
        vocab = self.config.vocab_size
        tokens = torch.randint(0, vocab, self.shape, generator=generator)
        positions = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
        labels = torch.randint(0, vocab, self.shape, generator=generator)
        return {"input": tokens, "positions": positions}, labels

    def __iter__(self):
        while True:
            yield self.batch()

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.drawn = state_dict["drawn"]


def use_random_tokens(config) -> None:
    """Point a trainer config's tokenizer and data loader at random tokens of
    its model's vocabulary; the tokenizer path is cleared, so no asset
    file is opened either."""
    vocab = config.model_spec.model.vocab_size
    config.tokenizer = VocabularySize.Config(vocab_size=vocab)
    config.dataloader = RandomTokens.Config(vocab_size=vocab)
    validator = getattr(config, "validator", None)
    if validator is not None and validator.enable:
        # The validator's batches too (its own seed), so no dataset is read.
        validator.dataloader = RandomTokens.Config(vocab_size=vocab, seed=1)
    config.hf_assets_path = ""
