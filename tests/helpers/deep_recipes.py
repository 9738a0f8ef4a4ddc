"""Debug recipes with more blocks, for the planner's shallow traces
(tests/test_plan_depth.py): the package's debug Llama and DeepSeek with
their last block repeated, so the run of alike blocks is long enough
(``plan.depth.MIN_REPEATED``) that a plan traces two shallow copies."""

import copy

from torchtitan_neuron.experiments.graph_trainer.deepseek_v3.config_registry import (
    simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2,
)
from torchtitan_neuron.experiments.graph_trainer.llama3.config_registry import (
    simple_fsdp_llama3_debugmodel,
    simple_fsdp_llama3_debugmodel_fullac,
)

BLOCKS = 14


def _deepen(config):
    layers = config.model_spec.model.layers
    layers += [copy.deepcopy(layers[-1]) for _ in range(BLOCKS - len(layers))]
    return config


def deep_llama3_debugmodel():
    return _deepen(simple_fsdp_llama3_debugmodel())


def deep_llama3_debugmodel_fullac():
    return _deepen(simple_fsdp_llama3_debugmodel_fullac())


def deep_deepseek_v3_debugmodel_tp2_fsdp2():
    return _deepen(simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2())
