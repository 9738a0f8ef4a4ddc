"""Every way a launch can go wrong gets a clear message, before any rank starts.

Proves, on the preflight checks ``run_train.sh`` runs (torchtitan_neuron.preflight):
a short MODULE names the fully qualified module that has the recipe; a recipe
module that fails to import shows its real error and where; NGPU above the
NeuronCores/GPUs present is refused naming both numbers, and on CPU more
ranks than cores gives a one-line note; layout arithmetic that cannot work
(TP not dividing NGPU, a sequence length TP does not divide, a global batch
that is not a multiple of local batch x data-parallel degree) is refused with
the numbers and a fix; a missing tokenizer folder, ``c4`` with no network and
a dataset file with a bad JSON line or no ``text`` field are named (file and
line); a Trainium-sized recipe whose sharded state alone exceeds the CPU
host's memory per rank is refused with both figures, its CPU twin and the
planner command; and a token in the environment never appears in a message. Through
the launcher as a user runs it: one message, exit 2, no rank started (also for
an unknown ``TORCHTITAN_NEURON_CPU_ALLOCATOR``).
Checkpoints are written under ``.partial-N`` and renamed when complete.

Tier: fast, but for the launch through run_train.sh (e2e, in ``make test``).
Run: .venv/bin/python -m pytest tests/test_errors.py -q
"""

import json
import sys
import time

import pytest

from torchtitan.config import ConfigManager

from torchtitan_neuron import checkpoint as ckpt
from torchtitan_neuron import preflight
from torchtitan_neuron.preflight import PreflightError

from conftest import FAST

LLAMA = "torchtitan_neuron.experiments.graph_trainer.llama3"
DEBUG = "simple_fsdp_llama3_debugmodel"


def _config(*overrides):
    return ConfigManager().parse_args(["--module", LLAMA, "--config", DEBUG, *overrides])


def _message(fn, *args) -> str:
    with pytest.raises(PreflightError) as exc:
        fn(*args)
    return str(exc.value)


def test_short_module_names_the_fully_qualified_one():
    msg = _message(preflight.check_recipe, "llama3", DEBUG)
    assert f"set MODULE={LLAMA}" in msg
    msg = _message(preflight.check_recipe, "llama3", "simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16")
    assert "MODULE=torchtitan_neuron.experiments.graph_trainer.deepseek_v3" in msg
    # A typo is answered with the close names in the module.
    msg = _message(preflight.check_recipe, LLAMA, "simple_fsdp_llama3_debugmodl")
    assert "Did you mean simple_fsdp_llama3_debugmodel" in msg


def test_recipe_module_import_error_is_shown(tmp_path, monkeypatch):
    package = tmp_path / "broken_recipes"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config_registry.py").write_text("import not_a_real_package\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = _message(preflight.check_recipe, "broken_recipes", "my_recipe")
    assert "broken_recipes.config_registry failed to import" in msg
    assert "No module named 'not_a_real_package'" in msg
    assert "config_registry.py:1" in msg
    # The recipe module itself fails (before its .config_registry is tried).
    (tmp_path / "broken_module.py").write_text("x = 1\nundefined_name\n")
    msg = _message(preflight.check_recipe, "broken_module", "my_recipe")
    assert "MODULE=broken_module failed to import: NameError" in msg
    assert "broken_module.py:2" in msg
    # A module that does not exist at all is not an import error of its own.
    msg = _message(preflight.check_recipe, "no_such_module_here", "my_recipe")
    assert "MODULE=no_such_module_here cannot be imported" in msg


def test_ngpu_above_devices_is_refused_and_cpu_oversubscription_noted():
    msg = _message(preflight.check_ngpu, 64, "neuron", 32)
    assert "NGPU=64" in msg and "32 NeuronCores" in msg and "neuron-ls" in msg
    msg = _message(preflight.check_ngpu, 8, "cuda", 4)
    assert "NGPU=8" in msg and "4 GPUs" in msg
    assert preflight.check_ngpu(32, "neuron", 32) is None
    note = preflight.check_ngpu(3, "cpu", None, 2)
    assert "NGPU=3 CPU ranks on 2 cores" in note and "oversubscribed" in note
    assert preflight.check_ngpu(2, "cpu", None, 2) is None


def test_layout_arithmetic_is_refused_with_the_numbers():
    msg = _message(preflight.check_layout, _config("--parallelism.tensor_parallel_degree", "4"), 6)
    assert "NGPU=6" in msg and "--parallelism.tensor_parallel_degree 4" in msg
    msg = _message(preflight.check_layout, _config(
        "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "250"), 4)
    assert "--training.seq_len 250 is not divisible by 4" in msg
    assert "--training.seq_len 252" in msg
    msg = _message(preflight.check_layout, _config(
        "--training.global_batch_size", "10", "--training.local_batch_size", "4"), 2)
    assert "--training.global_batch_size 10" in msg and "4 x data-parallel degree 2 = 8" in msg
    assert "--training.global_batch_size 8 or 16" in msg
    msg = _message(preflight.check_layout, _config(
        "--parallelism.data_parallel_shard_degree", "3"), 4)
    assert "= 3 ranks, but NGPU=4" in msg
    layout = preflight.check_layout(_config(
        "--parallelism.tensor_parallel_degree", "4", "--training.global_batch_size", "64"), 64)
    assert layout == {"tp": 4, "dp_shard": 16, "dp": 16}
    # Several nodes: the layout spans NGPU x NNODES ranks.
    msg = _message(preflight.check_layout, _config("--parallelism.tensor_parallel_degree", "3"),
                   2, 2)
    assert "NGPU=2 x NNODES=2 = 4 ranks is not divisible by" in msg
    layout = preflight.check_layout(_config(
        "--parallelism.tensor_parallel_degree", "4", "--training.global_batch_size", "128"), 64, 2)
    assert layout == {"tp": 4, "dp_shard": 32, "dp": 32}


@pytest.mark.parametrize("overrides, ngpu", [
    (("--parallelism.data_parallel_shard_degree", "0"), 2),
    (("--parallelism.expert_parallel_degree", "0"), 2),
    (("--parallelism.context_parallel_degree", "4"), 2),
    (("--parallelism.tensor_parallel_degree", "2"), 3),
    (("--parallelism.data_parallel_replicate_degree", "2",
      "--parallelism.data_parallel_shard_degree", "2"), 4),
])
def test_layout_is_refused_exactly_where_torchtitan_refuses_it(overrides, ngpu):
    """The degrees are validated by torchtitan's own ParallelDims: preflight
    refuses what it refuses (naming the flag) and passes what it passes."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    config = _config(*overrides)
    try:
        ParallelDims.from_config(config.parallelism, ngpu)
        upstream_refuses = False
    except AssertionError:
        upstream_refuses = True
    if upstream_refuses:
        msg = _message(preflight.check_layout, config, ngpu)
        assert overrides[0] in msg or f"NGPU={ngpu}" in msg, msg
    else:
        assert preflight.check_layout(config, ngpu)["dp"] >= 1


GPT_OSS = "torchtitan_neuron.experiments.graph_trainer.gpt_oss"


@pytest.mark.parametrize("recipe, overrides, ngpu, expected", [
    ("simple_fsdp_gpt_oss_20b", ("--parallelism.tensor_parallel_degree", "16"), 64,
     "--parallelism.tensor_parallel_degree 16 does not divide GPT-OSS's 8 KV heads; "
     "use 1, 2, 4 or 8."),
    ("simple_fsdp_gpt_oss_debugmodel", ("--parallelism.tensor_parallel_degree", "3"), 6,
     "--parallelism.tensor_parallel_degree 3 does not divide GPT-OSS's 8 KV heads; "
     "use 1, 2, 4 or 8."),
    ("simple_fsdp_gpt_oss_debugmodel", ("--parallelism.expert_parallel_degree", "3",
                                        "--training.global_batch_size", "12",
                                        # upstream refuses EP with CUDA graphs on
                                        "--training.disable_cuda_graphs"), 6,
     "--parallelism.expert_parallel_degree 3 does not divide GPT-OSS's 8 experts; "
     "use 1, 2, 4 or 8."),
    # TP2 on 6 ranks leaves 3 FSDP ranks for the 8 experts SimpleFSDP shards.
    ("simple_fsdp_gpt_oss_debugmodel", ("--parallelism.tensor_parallel_degree", "2",
                                        "--training.global_batch_size", "6"), 6,
     "SimpleFSDP cannot shard GPT-OSS's 8 experts over 3 FSDP ranks (world size / "
     "--parallelism.tensor_parallel_degree 2): it shards each TP rank's part again "
     "over the FSDP ranks, so their number must divide 8. Choose a layout whose FSDP "
     "degree is 1 or 2, or split the experts with --parallelism.expert_parallel_degree."),
    # 120B at 256 ranks, TP8 x FSDP32: the vocabulary, 2^7 x 1571, allows no
    # TP x FSDP over 128.
    ("simple_fsdp_gpt_oss_120b_fullac", ("--parallelism.tensor_parallel_degree", "8",
                                         "--training.global_batch_size", "32"), 256,
     "SimpleFSDP cannot shard GPT-OSS's embedding and output (25136 vocabulary rows "
     "per TP rank: 201088 / --parallelism.tensor_parallel_degree 8) over 32 FSDP "
     "ranks (world size / --parallelism.tensor_parallel_degree 8): it shards each TP "
     "rank's part again over the FSDP ranks, so their number must divide 25136. "
     "Choose a layout whose FSDP degree is 2, 4, 8 or 16, or "
     "--parallelism.tensor_parallel_degree 1 (FSDP alone shards any size), or "
     "--parallelism.data_parallel_replicate_degree for the ranks beyond it."),
    # 120B's 128 experts over TP8 x FSDP24 (192 ranks, 3 nodes).
    ("simple_fsdp_gpt_oss_120b_fullac", ("--parallelism.tensor_parallel_degree", "8",
                                         "--training.global_batch_size", "24"), 192,
     "SimpleFSDP cannot shard GPT-OSS's 128 experts over 24 FSDP ranks"),
])
def test_gpt_oss_layout_the_model_cannot_take_is_refused(recipe, overrides, ngpu, expected):
    """Degrees torchtitan's ParallelDims accepts but GPT-OSS's heads or
    experts cannot be split by: one message naming the flag and the fix."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    config = ConfigManager().parse_args(["--module", GPT_OSS, "--config", recipe, *overrides])
    ParallelDims.from_config(config.parallelism, ngpu)  # upstream lets it through
    msg = _message(preflight.check_layout, config, ngpu)
    assert msg == expected or (expected.endswith("ranks") and msg.startswith(expected)), msg


def test_plain_fsdp_shards_gpt_oss_experts_unevenly():
    """The experts rule is SimpleFSDP's: FSDP2 pads uneven shards."""
    config = ConfigManager().parse_args(
        ["--module", "torchtitan_neuron.models.gpt_oss",
         "--config", "gpt_oss_debugmodel_neuron_tp2_fsdp2",
         "--parallelism.data_parallel_shard_degree", "-1",
         "--training.global_batch_size", "6"])
    assert preflight.check_layout(config, 6)["dp_shard"] == 3


def test_gpt_oss_layouts_that_fit_the_model_pass():
    for tp in (1, 2, 4, 8):
        config = ConfigManager().parse_args(
            ["--module", GPT_OSS, "--config", "simple_fsdp_gpt_oss_20b",
             "--parallelism.tensor_parallel_degree", str(tp)])
        assert preflight.check_layout(config, 64)["tp"] == tp


def test_missing_tokenizer_is_named_with_the_fix(tmp_path):
    msg = _message(preflight.check_tokenizer, _config(f"--hf_assets_path={tmp_path / 'gone'}"))
    assert "no such folder" in msg and "python -m torchtitan_neuron.hf download" in msg
    msg = _message(preflight.check_tokenizer, _config(f"--hf_assets_path={tmp_path}"))
    assert "has no tokenizer.json" in msg


def test_c4_without_network_names_the_flags(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETtoken123")
    from huggingface_hub import HfApi

    def unreachable(self, repo_id, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "dataset_info", unreachable)
    msg = _message(preflight.check_dataset, _config("--dataloader.dataset", "c4"))
    assert "allenai/c4" in msg and "cannot be reached" in msg
    assert "--dataloader.dataset c4_test" in msg and "--dataloader.dataset_path" in msg
    assert "hf_SECRETtoken123" not in msg
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE" in _message(
        preflight.check_dataset, _config("--dataloader.dataset", "c4"))


@pytest.mark.parametrize("line, expected", [
    ('{"text": "cut off', "data.json:3: not valid JSON"),
    ('{"body": "no text field"}', "data.json:3: no \"text\" string field (found ['body'])"),
])
def test_corrupt_dataset_line_is_named(tmp_path, line, expected):
    good = json.dumps({"text": "A document."})
    (tmp_path / "data.json").write_text(f"{good}\n{good}\n{line}\n{good}\n")
    config = _config("--dataloader.dataset", "c4_test",
                     f"--dataloader.dataset_path={tmp_path}")
    assert expected in _message(preflight.check_dataset, config)


def test_bundled_data_and_tokenizer_pass():
    config = _config(*FAST)
    preflight.check_tokenizer(config)
    preflight.check_dataset(config)
    assert preflight.check_layout(config, 2) == {"tp": 1, "dp_shard": 2, "dp": 2}


@pytest.mark.e2e
def test_launcher_refuses_before_any_rank(run, dump_folder):
    start = time.monotonic()
    result = run(FAST[:3], ngpu=4, module="llama3",
                 dump_folder=dump_folder, preflight=True)
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    assert result.output.count(f"set MODULE={LLAMA}") == 1
    assert "torch.distributed.run" not in result.output and "[rank" not in result.output
    assert elapsed < 60


@pytest.mark.e2e
def test_unknown_cpu_allocator_is_refused_before_any_rank(run, dump_folder):
    result = run(FAST[:3], env={"TORCHTITAN_NEURON_CPU_ALLOCATOR": "tcmalloc"},
                 dump_folder=dump_folder)
    assert result.returncode == 2
    assert result.output.count("TORCHTITAN_NEURON_CPU_ALLOCATOR='tcmalloc' is not an "
                               "allocator: use auto, jemalloc, system") == 1
    assert "Traceback" not in result.output and "[rank" not in result.output


def test_trainium_recipe_on_a_cpu_host_is_refused_with_both_figures():
    """The tutorial's trn2 command pasted on a CPU host: each rank's sharded
    state (fp32 parameters, gradients, AdamW moments) is set against the host
    memory per rank, and the message names the CPU twin and the planner."""
    from torchtitan_neuron.preflight.host_memory import check_host_memory, parameter_count

    config = ConfigManager().parse_args(
        ["--module", LLAMA, "--config", "simple_fsdp_llama3_8b_fullac"])
    params = parameter_count(config)
    assert params == 8_030_261_248  # Llama 3.1 8B
    message = check_host_memory(config, 64, LLAMA, "simple_fsdp_llama3_8b_fullac",
                                host_bytes=24 * 1024**3)
    per_rank = params * 16 / 64 / 1024**3
    assert f"each needs {per_rank:.2f} GiB for its sharded state" in message
    assert "this host has 0.38 GiB per rank (24.0 GiB / 64)" in message
    assert "CONFIG=simple_fsdp_llama3_debugmodel_fullac NGPU=2" in message
    assert ("python -m torchtitan_neuron.plan --module " + LLAMA
            + " --config simple_fsdp_llama3_8b_fullac --ngpu 64 --target trn2") in message
    # The debug twin at its own ranks fits easily; so does the 8B on a host
    # with 32 GiB per rank.
    assert check_host_memory(_config(), 2, LLAMA, DEBUG, host_bytes=24 * 1024**3) is None
    assert check_host_memory(config, 64, LLAMA, "simple_fsdp_llama3_8b_fullac",
                             host_bytes=64 * 32 * 1024**3) is None


def _checkpoint_manager(monkeypatch, folder, upstream_save):
    """A NeuronCheckpointManager on ``folder`` whose upstream ``dcp_save``
    (what its override calls) is ``upstream_save``: the override is the real
    one, the DCP writer a fake."""
    from torchtitan.components.checkpointer import CheckpointManager

    monkeypatch.setattr(CheckpointManager, "dcp_save", upstream_save)
    manager = object.__new__(ckpt.NeuronCheckpointManager)
    manager.enable, manager.folder, manager.atomic = True, str(folder), True
    return manager


def test_saves_are_renamed_when_complete(tmp_path, monkeypatch):
    """A fake DCP writer: the files appear under .partial-N while it writes;
    step-N appears only once it has returned; an interrupted save leaves no
    step-N. A Hugging Face export gets its hand-off before the rename."""

    def upstream_save(self, state_dict, checkpoint_id, async_mode, **kwargs):
        assert checkpoint_id.endswith(".partial-5")
        (tmp_path / ".partial-5").mkdir()
        (tmp_path / ".partial-5" / "__0_0.distcp").write_text("shard")
        if state_dict.get("interrupt"):
            raise KeyboardInterrupt
        (tmp_path / ".partial-5" / ".metadata").write_text("done")

    manager = _checkpoint_manager(monkeypatch, tmp_path, upstream_save)
    with pytest.raises(KeyboardInterrupt):
        manager.dcp_save({"interrupt": True}, str(tmp_path / "step-5"), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".partial-5"]
    assert ckpt.report_leftovers(str(tmp_path)) == [".partial-5"]
    handed = []
    manager.hf_hand_off = handed.append
    manager.dcp_save({}, str(tmp_path / "step-5"), None, to_hf=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]
    assert (tmp_path / "step-5" / ".metadata").read_text() == "done"
    assert handed == [str(tmp_path / ".partial-5")]


def test_async_saves_are_renamed_when_the_upload_completes(tmp_path, monkeypatch):
    from concurrent.futures import Future

    upload = Future()

    def upstream_save(self, state_dict, checkpoint_id, async_mode, **kwargs):
        (tmp_path / ".partial-7").mkdir()
        return upload

    manager = _checkpoint_manager(monkeypatch, tmp_path, upstream_save)
    assert manager.dcp_save({}, str(tmp_path / "step-7"), "async") is upload
    assert sorted(p.name for p in tmp_path.iterdir()) == [".partial-7"]
    (tmp_path / ".partial-7" / ".metadata").write_text("done")
    upload.set_result(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-7"]


def test_recipes_name_the_projects_checkpoint_manager_and_metrics_processor():
    # Upstream's doors (Configurable subclasses chosen by the config), not
    # methods swapped on torchtitan's instances.
    from torchtitan_neuron.experiments.graph_trainer.llama3.config_registry import (
        simple_fsdp_llama3_debugmodel,
    )
    from torchtitan_neuron.models.llama3.config_registry import llama3_debugmodel_neuron
    from torchtitan_neuron.run_report import NeuronMetricsProcessor

    for config in (llama3_debugmodel_neuron(), simple_fsdp_llama3_debugmodel()):
        assert type(config.checkpoint) is ckpt.NeuronCheckpointManager.Config
        assert type(config.metrics) is NeuronMetricsProcessor.Config


def test_neuron_cores_are_counted_through_torch_accelerator(monkeypatch):
    """With torch-neuronx present (a stand-in here), the count is what
    torch.accelerator reports for the registered neuron device."""
    import types

    import torch

    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 64)
    from torchtitan_neuron import devices

    assert devices.device_count("neuron") == 64
    assert devices.device_count("cpu") is None


def test_multinode_endpoint_is_checked():
    assert "is not host:port" in _message(preflight.check_endpoint, "trn-0")
    assert "is not host:port" in _message(preflight.check_endpoint, "trn-0:99999")
    msg = _message(preflight.check_endpoint, "nohost.invalid:29500")
    assert "the host 'nohost.invalid' does not resolve" in msg
    preflight.check_endpoint("localhost:29500")  # resolves: no error
