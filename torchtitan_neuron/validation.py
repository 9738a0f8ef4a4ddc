"""torchtitan's validator with the trainer's own batch preparation.

torchtitan's ``Validator.post_dataloading_process`` repeats the trainer's,
less what this project's trainer adds: the block-causal document mask, the
per-document positions and context parallelism's mask
(``trainer.NeuronTrainerMixin.post_dataloading_process``). A validation batch
of a block-causal recipe then reached the model without its mask. Here the
validator prepares its batches with the trainer's method, so training and
validation see their batches the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.validate import Validator


class TrainerBatchValidator(Validator):
    """``Validator`` whose batches go through ``prepare`` (the trainer's
    ``post_dataloading_process``), set by the trainer once it is built."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    prepare = None

    def post_dataloading_process(self, input_dict, labels, model_parts):
        if self.prepare is None:
            return super().post_dataloading_process(input_dict, labels, model_parts)
        return self.prepare(input_dict, labels)
