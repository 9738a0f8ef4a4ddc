"""DeepSeek-V3 on torchtitan's plain Trainer, with the Neuron model pieces.

Select with ``--module torchtitan_neuron.models.deepseek_v3``.
"""

from dataclasses import replace

from torchtitan.experiments.graph_trainer.common_utils import (
    build_decoder_config_for_backend,
)
from torchtitan.models.deepseek_v3 import deepseekv3_configs
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_model_registry
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.models.common import neuron_decoder_config
from torchtitan_neuron.models.moe import register_load_balancing_hook


def model_registry(
    flavor: str,
    attn_backend: str = "sdpa",
    converters: list[ModelConfigConverter.Config] | None = None,
) -> ModelSpec:
    """Upstream's DeepSeek-V3 spec on SDPA, with the prefix-cache RoPE switch,
    count-once MoE layers, ``converters``, and this project's load-balancing hook."""
    spec = deepseek_v3_model_registry(flavor)
    config = build_decoder_config_for_backend(
        deepseekv3_configs[flavor],
        attn_backend,
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
    )
    return replace(
        spec,
        model=neuron_decoder_config(config, converters),
        post_optimizer_build_fn=register_load_balancing_hook,
    )
