"""Debug recipes with more blocks, for the planner's shallow traces
(tests/test_plan_depth.py): the package's debug Llama and DeepSeek with
their last block repeated, and the debug GPT-OSS with its last two, so the
run of alike units is long enough (``plan.depth.MIN_REPEATED``) that a plan
traces two shallow copies."""

import copy

from torchtitan_neuron.experiments.graph_trainer.deepseek_v3.config_registry import (
    simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2,
)
from torchtitan_neuron.experiments.graph_trainer.gpt_oss.config_registry import (
    simple_fsdp_gpt_oss_debugmodel,
)
from torchtitan_neuron.experiments.graph_trainer.llama3.config_registry import (
    simple_fsdp_llama3_debugmodel,
    simple_fsdp_llama3_debugmodel_fullac,
)

BLOCKS = 14


def _deepen(config, period: int = 1):
    """Repeat the last ``period`` blocks until there are ``BLOCKS`` units."""
    layers = config.model_spec.model.layers
    while len(layers) < BLOCKS * period:
        layers.append(copy.deepcopy(layers[len(layers) - period]))
    return config


def deep_llama3_debugmodel():
    return _deepen(simple_fsdp_llama3_debugmodel())


def deep_llama3_debugmodel_fullac():
    return _deepen(simple_fsdp_llama3_debugmodel_fullac())


def deep_deepseek_v3_debugmodel_tp2_fsdp2():
    return _deepen(simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2())


def deep_gpt_oss_debugmodel():
    """Sliding-window and full attention alternate: 14 units of two blocks."""
    return _deepen(simple_fsdp_gpt_oss_debugmodel(), period=2)
