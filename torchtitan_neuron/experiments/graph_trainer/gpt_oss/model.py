"""GPT-OSS as a GraphTrainer model: initialization sees the raw parameters.

graph_trainer 0.3.0 ships no GPT-OSS model. SimpleFSDP replaces each
parameter with a property that all-gathers it; initializing through that
property would write into a temporary gathered copy. Upstream's DeepSeek-V3
GraphTrainer model (``GraphTrainerDeepSeekV3Model``) therefore runs
``init_states`` with the parametrization disabled; this is the same for
GPT-OSS.

The base class is ``SdpaSinkGptOssModel`` (upstream's ``GptOssModel`` with
SDPA sink attention and masks built once per forward, shared by all layers),
so the SimpleFSDP recipes run the same forward as the plain ones.
"""

from dataclasses import dataclass

import torch

from torchtitan.experiments.graph_trainer.simple_fsdp import (
    disable_active_parametrization,
)

from torchtitan_neuron.models.gpt_oss.attention import SdpaSinkGptOssModel


class GraphTrainerGptOssModel(SdpaSinkGptOssModel):
    @dataclass(kw_only=True, slots=True)
    class Config(SdpaSinkGptOssModel.Config):
        pass

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        with disable_active_parametrization():
            super().init_states(buffer_device=buffer_device)
