"""A recipe whose model reads a tensor value in its forward (``.item()``).

``simple_fsdp_llama3_debugmodel`` with every feed-forward block deciding on
a value read back from the device: a graph break under torch.compile (a
host synchronisation inside the graph if scalars are captured). The
rehearsal must call it ``not ready`` and name the line of that read.
Select it as ``--module tests.helpers.item_in_forward``.
"""

from dataclasses import dataclass

import torch
from torchtitan.models.common.feed_forward import FeedForward

from torchtitan_neuron.config_utils import promote
from torchtitan_neuron.experiments.graph_trainer.llama3.config_registry import (
    simple_fsdp_llama3_debugmodel,
)


class ItemReadingFeedForward(FeedForward):
    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The read and the decision on it share a line: Dynamo stops at the
        # decision (a guard on a data-dependent value) when scalars are
        # captured, and at the .item() itself when they are not.
        scale = 1.0 if x.detach().abs().amax().item() < 1e30 else 0.5
        return super().forward(x) * scale



def simple_fsdp_llama3_debugmodel_item() -> object:
    config = simple_fsdp_llama3_debugmodel()
    for layer in config.model_spec.model.layers:
        layer.feed_forward = promote(layer.feed_forward, ItemReadingFeedForward.Config)
    return config
