"""Every recipe builds, round-trips through torchtitan's ConfigManager, and says
what the tutorial says it does.

Proves: each recipe parses with ``--module <fully qualified path> --config <name>``
and resolves its layout at NGPU=64 (FSDP64 for Llama, TP4 x FSDP16 with the
tutorial's overrides); SimpleFSDP recipes are jit-only with SDPA, the
prefix-cache rotary path and compiled model/loss/grad_clip on the neuron
backend; ``--compile.mode`` other than jit is refused at parse time;
``promote`` carries every field and loses none without being told to; every
recipe builds, field by field, the config saved in
``tests/assets/recipe_configs.json.xz`` (``scripts/dump_configs.py``), so a
change that moves code changes no recipe unnoticed.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_recipes.py -q
"""

import pytest
import torch

from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.trainer import Trainer

from torchtitan_neuron.components.experts import LocalExperts
from torchtitan_neuron.components.moe import register_load_balancing_hook
from torchtitan_neuron.config_utils import promote
from torchtitan_neuron.experiments.graph_trainer.trainer import NeuronGraphTrainer
from torchtitan_neuron.trainer import NeuronTrainer

GRAPH_LLAMA = "torchtitan_neuron.experiments.graph_trainer.llama3"
PLAIN_LLAMA = "torchtitan_neuron.models.llama3"

SIMPLE_FSDP_RECIPES = {
    "simple_fsdp_llama3_8b": (SelectiveAC.Config, "8B"),
    "simple_fsdp_llama3_8b_fullac": (FullAC.Config, "8B"),
    "simple_fsdp_llama3_70b_fullac": (FullAC.Config, "70B"),
    "simple_fsdp_llama3_debugmodel": (SelectiveAC.Config, "debugmodel"),
    "simple_fsdp_llama3_debugmodel_fullac": (FullAC.Config, "debugmodel"),
}
PLAIN_RECIPES = [
    "llama3_8b_neuron",
    "llama3_8b_neuron_compiled",
    "llama3_debugmodel_neuron",
    "llama3_debugmodel_neuron_compiled",
]
DS_GRAPH = "torchtitan_neuron.experiments.graph_trainer.deepseek_v3"
DS_PLAIN = "torchtitan_neuron.models.deepseek_v3"
GO_GRAPH = "torchtitan_neuron.experiments.graph_trainer.gpt_oss"
GO_PLAIN = "torchtitan_neuron.models.gpt_oss"
# (module, recipe, world size, expected (tp, dp_shard), AC type or None for as-upstream)
TP_RECIPES = [
    (DS_PLAIN, "deepseek_v3_16b_neuron_tp4_fsdp16", 64, (4, 16), None),
    (DS_GRAPH, "simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16", 64, (4, 16), SelectiveAC.Config),
    (DS_GRAPH, "simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16_fac", 64, (4, 16), FullAC.Config),
    (DS_PLAIN, "deepseek_v3_debugmodel_neuron_tp2_fsdp2", 4, (2, 2), None),
    (DS_GRAPH, "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2", 4, (2, 2), SelectiveAC.Config),
    (DS_GRAPH, "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2_fac", 4, (2, 2), FullAC.Config),
    ("torchtitan_neuron.models.qwen3", "qwen3_8b_tp4_fsdp16_sac", 64, (4, 16), SelectiveAC.Config),
    ("torchtitan_neuron.models.qwen3", "qwen3_debugmodel_tp2_fsdp2_sac", 4, (2, 2), SelectiveAC.Config),
    (PLAIN_LLAMA, "llama3_8b_tp4_fsdp16_sac", 64, (4, 16), SelectiveAC.Config),
    (PLAIN_LLAMA, "llama3_debugmodel_tp2_fsdp2_sac", 4, (2, 2), SelectiveAC.Config),
    (GO_PLAIN, "gpt_oss_20b_neuron_tp2_fsdp32", 64, (2, 32), None),
    (GO_GRAPH, "simple_fsdp_gpt_oss_20b", 64, (2, 32), SelectiveAC.Config),
    (GO_GRAPH, "simple_fsdp_gpt_oss_20b_fullac", 64, (2, 32), FullAC.Config),
    (GO_PLAIN, "gpt_oss_120b_neuron_tp8", 128, (8, 16), None),
    (GO_GRAPH, "simple_fsdp_gpt_oss_120b_fullac", 128, (8, 16), FullAC.Config),
    (GO_PLAIN, "gpt_oss_debugmodel_neuron_tp2_fsdp2", 4, (2, 2), None),
    (GO_GRAPH, "simple_fsdp_gpt_oss_debugmodel", 2, (1, 2), SelectiveAC.Config),
    (GO_GRAPH, "simple_fsdp_gpt_oss_debugmodel_fullac", 2, (1, 2), FullAC.Config),
    (GO_GRAPH, "simple_fsdp_gpt_oss_debugmodel_tp2_fsdp2", 4, (2, 2), SelectiveAC.Config),
]


def parse(module: str, config: str, *overrides: str):
    return ConfigManager().parse_args(["--module", module, "--config", config, *overrides])


def _layout(config, world_size: int) -> ParallelDims:
    return ParallelDims.from_config(config.parallelism, world_size)


# Long-sequence recipes: (recipe, world size, (cp, dp_shard), seq_len)
CP_RECIPES = [
    ("simple_fsdp_llama3_8b_cp4_32k", 64, (4, 16), 32768),
    ("simple_fsdp_llama3_debugmodel_cp2", 2, (2, 1), 512),
    ("simple_fsdp_llama3_debugmodel_cp2", 4, (2, 2), 512),
]


def test_llama_70b_two_node_recipe():
    config = parse(GRAPH_LLAMA, "simple_fsdp_llama3_70b_tp8_fsdp16")
    dims = _layout(config, 128)
    assert (dims.tp, dims.dp_shard) == (8, 16)
    assert type(config.activation_checkpoint) is FullAC.Config
    assert (config.training.local_batch_size, config.training.global_batch_size) == (2, 128)


def test_pipeline_recipe():
    config = parse(GRAPH_LLAMA, "simple_fsdp_llama3_debugmodel_pp2")
    dims = _layout(config, 4)
    assert (dims.pp, dims.dp_shard, dims.cp, dims.tp) == (2, 2, 1, 1)
    assert config.parallelism.pipeline_parallel_schedule == "Interleaved1F1B"


@pytest.mark.parametrize("name, world, layout, seq_len", CP_RECIPES)
def test_context_parallel_recipes(name, world, layout, seq_len):
    config = parse(GRAPH_LLAMA, name)
    assert type(config) is NeuronGraphTrainer.Config and config.compile.mode == "jit"
    dims = _layout(config, world)
    assert (dims.cp, dims.dp_shard, dims.tp) == (*layout, 1)
    assert config.training.seq_len == seq_len
    # The planner's figures in the recipe's docstring are for full AC.
    if "8b" in name:
        assert type(config.activation_checkpoint) is FullAC.Config
        assert config.training.local_batch_size == 1


@pytest.mark.parametrize("name", sorted(SIMPLE_FSDP_RECIPES))
def test_simple_fsdp_recipe(name):
    ac_type, flavor = SIMPLE_FSDP_RECIPES[name]
    config = parse(GRAPH_LLAMA, name)
    assert type(config) is NeuronGraphTrainer.Config
    assert config.model_spec.name == "simple_fsdp/llama3"
    assert config.model_spec.flavor == flavor
    assert type(config.activation_checkpoint) is ac_type
    compile_config = config.compile
    assert compile_config.enable and compile_config.mode == "jit"
    assert compile_config.backend == "neuron"
    assert compile_config.components == ["model", "loss", "grad_clip"]
    for layer in config.model_spec.model.layers:
        assert layer.attention.rope.use_prefix_cache_for_positions
        assert isinstance(layer.attention.inner_attention, ScaledDotProductAttention.Config)
    dims = _layout(config, 64)
    if flavor == "70B":
        # The recipe function adds no degree; upstream's llama3_70b pins TP 8.
        assert (dims.tp, dims.dp_shard) == (8, 8)
    else:
        # No parallelism degree pinned: SimpleFSDP shards across every rank.
        assert (dims.tp, dims.dp_shard) == (1, 64)
    if flavor == "8B":
        assert config.hf_assets_path == "./assets/hf/Llama-3.1-8B"


def test_tutorial_step3_overrides_give_tp4_fsdp16_with_accumulation():
    config = parse(
        GRAPH_LLAMA,
        "simple_fsdp_llama3_8b",
        "--training.global_batch_size", "64",
        "--dataloader.dataset", "c4",
        "--parallelism.tensor_parallel_degree=4",
        "--parallelism.data_parallel_shard_degree=-1",
    )
    dims = _layout(config, 64)
    assert (dims.tp, dims.dp_shard) == (4, 16)
    # local batch 1 x 16 data-parallel ranks -> 4 accumulation steps for 64.
    local = config.training.local_batch_size
    assert config.training.global_batch_size // (local * dims.dp_shard) == 4
    assert config.dataloader.dataset == "c4"


@pytest.mark.parametrize("name", PLAIN_RECIPES)
def test_plain_fsdp_recipe(name):
    config = parse(PLAIN_LLAMA, name)
    assert type(config) is NeuronTrainer.Config
    assert config.compile.enable == name.endswith("_compiled")
    for layer in config.model_spec.model.layers:
        assert layer.attention.rope.use_prefix_cache_for_positions
    assert _layout(config, 64).dp_shard == 64


def test_bucketing_flags(capsys):
    config = parse(GRAPH_LLAMA, "simple_fsdp_llama3_8b")
    assert (config.compile.bucketing, config.compile.bucket_mib) == (True, 512)
    config = parse(GRAPH_LLAMA, "simple_fsdp_llama3_8b", "--compile.no-bucketing",
                   "--compile.bucket_mib", "256")
    assert (config.compile.bucketing, config.compile.bucket_mib) == (False, 256)
    assert not config.compile.overlap_collectives
    config = parse(GRAPH_LLAMA, "simple_fsdp_llama3_8b", "--compile.overlap_collectives")
    assert config.compile.overlap_collectives
    with pytest.raises(SystemExit) as exc:
        parse(GRAPH_LLAMA, "simple_fsdp_llama3_8b", "--compile.bucket_mib", "0")
    assert exc.value.code != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "--compile.bucket_mib 0 is not a bucket size" in err, err
    # The default bound is the Neuron runtime's default scratchpad page, and a
    # direct caller of bucket_blocks() gets the same refusal as the flag.
    from torchtitan_neuron.experiments.graph_trainer.bucketing import bucket_blocks
    from torchtitan_neuron.devices.neuron import NEURON_DEFAULT_SCRATCHPAD_PAGE_MB
    assert config.compile.bucket_mib == NEURON_DEFAULT_SCRATCHPAD_PAGE_MB == 512
    with pytest.raises(ValueError, match="--compile.bucket_mib -1 is not a bucket size"):
        bucket_blocks(torch.nn.Module(), torch.bfloat16, torch.float32, bucket_mib=-1)


@pytest.mark.parametrize("mode", ["aot_fx_trace"])
def test_non_jit_mode_is_refused_at_parse_time(mode, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(GRAPH_LLAMA, "simple_fsdp_llama3_8b_fullac", "--compile.mode", mode)
    assert exc.value.code != 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"--compile.mode {mode} is not supported" in err
    assert "jit is the only supported compile mode for SimpleFSDP" in err


@pytest.mark.parametrize("module, name, world, layout, ac_type", TP_RECIPES)
def test_tp_recipes(module, name, world, layout, ac_type):
    config = parse(module, name)
    dims = _layout(config, world)
    assert (dims.tp, dims.dp_shard) == layout
    if ac_type is not None:
        assert type(config.activation_checkpoint) is ac_type
    for layer in config.model_spec.model.layers:
        assert layer.attention.rope.use_prefix_cache_for_positions
    if module in (DS_GRAPH, GO_GRAPH):
        assert type(config) is NeuronGraphTrainer.Config
        assert config.compile.mode == "jit" and config.compile.backend == "neuron"
        assert config.compile.components == ["model", "loss", "grad_clip"]
    if "deepseek" in name:
        assert config.model_spec.post_optimizer_build_fn is register_load_balancing_hook
        moes = [l.moe for l in config.model_spec.model.layers if getattr(l, "moe", None)]
        assert moes and all(
            isinstance(m.routed_experts.inner_experts, LocalExperts.Config) for m in moes
        )
        assert config.hf_assets_path == "./tests/assets/tokenizer"
    if "gpt_oss" in name:
        _assert_gpt_oss_shaping(config, name)
    if "16b" in name or "20b" in name or "120b" in name:
        # The layout reaches the recipe's own global batch: 64 sequences on
        # one node, 128 on the 120B's two.
        local = config.training.local_batch_size
        target = 128 if "120b" in name else 64
        assert config.training.global_batch_size == target
        assert target % (local * dims.dp_shard) == 0


def _assert_gpt_oss_shaping(config, name):
    """SDPA sink attention, count-once MoE, GPT-OSS experts on the kernel
    choice and the load-balancing hook, as the DeepSeek recipes have them."""
    from torchtitan_neuron.models.gpt_oss.experts import GptOssLocalExperts
    from torchtitan_neuron.components.moe import CountOnceMoE
    from torchtitan_neuron.models.gpt_oss.attention import (
        SdpaSinkAttention,
        SdpaSinkGptOssModel,
    )

    spec = config.model_spec
    assert spec.post_optimizer_build_fn is register_load_balancing_hook
    # Both registries build the model that shares its masks across layers.
    assert isinstance(spec.model, SdpaSinkGptOssModel.Config)
    assert config.parallelism.expert_parallel_degree == 1
    for layer in spec.model.layers:
        assert isinstance(layer.attention, SdpaSinkAttention.Config)
        assert isinstance(layer.moe, CountOnceMoE.Config)
        assert isinstance(layer.moe.routed_experts.inner_experts, GptOssLocalExperts.Config)
    windows = [layer.attention.sliding_window_size for layer in spec.model.layers]
    if not name.startswith("simple_fsdp"):
        assert type(spec.model) is SdpaSinkGptOssModel.Config
    if "debugmodel" in name:
        assert spec.flavor == "debugmodel_cpu" and len(windows) == 4
        # Windows on layers 0 and 2, shorter than the sequence.
        assert windows == [64, None, 64, None] and config.training.seq_len == 256
        assert config.hf_assets_path == "./tests/assets/tokenizer"
    else:
        flavor, n_layers = ("120b", 36) if "120b" in name else ("20b", 24)
        assert spec.flavor == flavor and len(windows) == n_layers
        assert config.hf_assets_path == f"./assets/hf/gpt-oss-{flavor}"
    if name.startswith("simple_fsdp"):
        assert spec.name == "simple_fsdp/gpt_oss"
        assert type(spec.model).__qualname__ == "GraphTrainerGptOssModel.Config"


def test_promote_carries_every_field_and_loses_none_unasked():
    config = parse(PLAIN_LLAMA, "llama3_debugmodel_neuron")
    with pytest.raises(TypeError, match="Trainer.Config has no field model"):
        promote(config, Trainer.Config)
    plain = promote(config, Trainer.Config, drop=["model"])
    again = promote(plain, NeuronTrainer.Config, model=config.model)
    assert type(plain) is Trainer.Config and type(again) is NeuronTrainer.Config
    # The same objects, not copies: a recipe's later edits reach the result.
    assert again.model_spec is config.model_spec and again.model is config.model
    assert again == config


def test_overlap_collectives_sets_inductor_reordering_only_for_inductor():
    import torch._inductor.config as inductor_config

    from torchtitan_neuron.experiments.graph_trainer.parallelize import (
        OVERLAP_PASSES,
        overlap_collectives,
    )

    with inductor_config.patch(reorder_for_compute_comm_overlap=False,
                               reorder_for_compute_comm_overlap_passes=[]):
        for backend in ("neuron", "aot_eager"):
            assert not overlap_collectives(backend)
            assert not inductor_config.reorder_for_compute_comm_overlap
        assert overlap_collectives("inductor")
        assert inductor_config.reorder_for_compute_comm_overlap
        assert inductor_config.reorder_for_compute_comm_overlap_passes == OVERLAP_PASSES
        # Each pass is one inductor knows by name.
        from torch._inductor import comms

        assert all(callable(getattr(comms, name)) for name in OVERLAP_PASSES)


def test_every_recipe_builds_the_config_it_built_before():
    # A recipe that changes on purpose is saved again with
    #   .venv/bin/python scripts/dump_configs.py --write tests/assets/recipe_configs.json.xz
    # and its diff read before committing.
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "scripts/dump_configs.py", "--check",
         "tests/assets/recipe_configs.json.xz"],
        cwd=repo, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(repo)),  # this checkout's package
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 differences" in result.stdout


def test_the_config_dump_names_the_field_that_changed():
    from dump_configs import _strip_modules, differences, walk

    from torchtitan_neuron.experiments.graph_trainer.llama3.config_registry import (
        simple_fsdp_llama3_debugmodel,
    )

    before = walk(simple_fsdp_llama3_debugmodel())
    changed = simple_fsdp_llama3_debugmodel()
    changed.training.seq_len += 1
    assert differences(before, walk(changed)) == [
        f"training.seq_len: {changed.training.seq_len - 1} -> {changed.training.seq_len}"
    ]
    # A class that only moved module differs, unless module paths are ignored.
    moved = {"@type": "torchtitan_neuron.elsewhere.NeuronCompileConfig"}
    kept = {"@type": "torchtitan_neuron.experiments.graph_trainer.trainer.NeuronCompileConfig"}
    assert differences(kept, moved) and not differences(_strip_modules(kept),
                                                        _strip_modules(moved))
