"""GPT-OSS on torchtitan's plain Trainer, with the Neuron model pieces.

The family's model code lives beside its recipes: ``attention`` (sinks,
windows and document masks on SDPA), ``experts`` (experts in the parameter
dtype on the project's kernels) and ``state_dict_adapter`` (the Hugging Face
names of the experts).

Select with ``--module torchtitan_neuron.models.gpt_oss``.

Flavors: upstream's ``20b`` and ``120b`` (and ``debugmodel``), plus
``debugmodel_cpu``, a smaller debug model for CPU ranks (see
``_debugmodel_cpu``).
"""

from dataclasses import replace

from torchtitan.models.gpt_oss import gptoss_configs
from torchtitan.models.gpt_oss import model_registry as gpt_oss_model_registry
from torchtitan.models.gpt_oss.model import GptOssModel
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_neuron.components.model_config import neuron_spec
from torchtitan_neuron.components.moe import register_load_balancing_hook
# Importing the experts registers them with ExpertKernelConverter.
from torchtitan_neuron.models.gpt_oss import experts  # noqa: F401
from torchtitan_neuron.models.gpt_oss.attention import use_rowwise_bias_linear, use_sdpa_sink_model
from torchtitan_neuron.models.gpt_oss.state_dict_adapter import GptOssHFStateDictAdapter

# The CPU debug model: upstream's debugmodel (dim 256, 4 layers, 64 query and
# 8 KV heads of 64, 8 experts, vocab 2048; sliding window on layers 0 and 2)
# with experts 256 wide instead of 2880 and a window of 64 instead of 128, so
# the window is shorter than the CPU runs' sequence of 256 and 10 steps on 2-4
# CPU ranks take a minute or two. The bundled tokenizer's 2,000 ids fit the
# 2048-row embedding, as in upstream's debug flavors.
DEBUG_HIDDEN_DIM = 256
DEBUG_SLIDING_WINDOW = 64
# Rotary cache length: the cache is per layer, and upstream's 131072 rows
# cost 32 MiB a layer; positions never pass the debug runs' sequence.
DEBUG_ROPE_ROWS = 4096


def _debugmodel_cpu(**kwargs) -> GptOssModel.Config:
    config = gptoss_configs["debugmodel"](**kwargs)
    for layer in config.layers:
        layer.moe.routed_experts.inner_experts.hidden_dim = DEBUG_HIDDEN_DIM
        layer.attention.rope.max_seq_len = DEBUG_ROPE_ROWS
        if layer.attention.sliding_window_size is not None:
            layer.attention.sliding_window_size = DEBUG_SLIDING_WINDOW
    return config


GPT_OSS_FLAVORS = {**gptoss_configs, "debugmodel_cpu": _debugmodel_cpu}


def _upstream_spec(flavor: str) -> ModelSpec:
    """Upstream's spec (parallelize, pipelining, state-dict adapter) for a flavor;
    this module's own flavors take their upstream base's."""
    base = flavor if flavor in gptoss_configs else "debugmodel"
    return replace(gpt_oss_model_registry(base), flavor=flavor)


def model_registry(
    flavor: str, converters: list[ModelConfigConverter.Config] | None = None
) -> ModelSpec:
    """Upstream's GPT-OSS spec with SDPA sink attention on every layer (the
    model, ``SdpaSinkGptOssModel``, builds the additive masks once per
    forward and all layers share them), the prefix-cache RoPE switch,
    count-once MoE layers, ``converters`` and this project's load-balancing
    hook.

    Upstream's GPT-OSS runs Flex or CUDA varlen attention only; the converter
    replaces either with sinks, windows and document masks on SDPA, which
    Neuron, CUDA and CPU all run (docs/gpt_oss_attention.md).
    """
    config = GPT_OSS_FLAVORS[flavor](moe_comm_backend="standard", attn_backend="flex")
    # The shared masks: one float S x (S + 1) mask per kind per forward
    # instead of SDPA's float copy of a boolean mask inside every layer
    # (docs/gpt_oss_attention.md).
    config = use_sdpa_sink_model(config)
    # The output projection's bias gets its one-device gradient under TP
    # (row gpt-oss-rowwise-bias-grad).
    use_rowwise_bias_linear(config)
    # The adapter that maps the experts (upstream's drops them: row
    # gpt-oss-hf-adapter of docs/upstream-workarounds.md).
    spec = replace(_upstream_spec(flavor), model=config,
                   state_dict_adapter=GptOssHFStateDictAdapter)
    return neuron_spec(spec, converters, post_optimizer_build_fn=register_load_balancing_hook)
