"""GPT-OSS as a GraphTrainer model: initialization sees the raw parameters.

graph_trainer 0.3.0 ships no GPT-OSS model. SimpleFSDP replaces each
parameter with a property that all-gathers it; initializing through that
property would write into a temporary gathered copy. Upstream's DeepSeek-V3
GraphTrainer model (``GraphTrainerDeepSeekV3Model``) therefore runs
``init_states`` with the parametrization disabled; this is the same for
GPT-OSS.
"""

from dataclasses import dataclass

import torch

from torchtitan.experiments.graph_trainer.simple_fsdp import (
    disable_active_parametrization,
)
from torchtitan.models.gpt_oss.model import GptOssModel


class GraphTrainerGptOssModel(GptOssModel):
    @dataclass(kw_only=True, slots=True)
    class Config(GptOssModel.Config):
        pass

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        with disable_active_parametrization():
            super().init_states(buffer_device=buffer_device)
