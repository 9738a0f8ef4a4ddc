"""DeepSeek-V3 on torchtitan's plain Trainer, with the Neuron model pieces.

Select with ``--module torchtitan_neuron.models.deepseek_v3``.
"""

from dataclasses import replace

from torchtitan.models.deepseek_v3 import deepseekv3_configs
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_model_registry
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.components.model_config import neuron_model_spec
from torchtitan_neuron.components.moe import register_load_balancing_hook


def model_registry(
    flavor: str,
    attn_backend: str = "sdpa",
    converters: list[ModelConfigConverter.Config] | None = None,
) -> ModelSpec:
    """Upstream's DeepSeek-V3 spec on SDPA, with the prefix-cache RoPE switch,
    count-once MoE layers, ``converters``, and this project's load-balancing hook."""
    spec = neuron_model_spec(
        deepseek_v3_model_registry,
        deepseekv3_configs,
        flavor,
        attn_backend=attn_backend,
        converters=converters,
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
    )
    return replace(spec, post_optimizer_build_fn=register_load_balancing_hook)
