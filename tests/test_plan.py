"""The memory planner traces the recipe's real step on FakeTensors.

Proves: ``python -m torchtitan_neuron.plan --json`` prints peak, capacity,
verdict and a breakdown for rank 0 of N without allocating the model, with
AdamW's two moments per parameter; ``COMM_MODE=plan ./run_train.sh`` plans the
same command for trn2, with the Neuron runtime's scratchpad and micro-code
terms; a trn2 plan traces on the neuron branch the same graphs (count and op
histogram) the rehearsal checks; a compiled program's boundary tensors, scratchpad need and
over-a-page intermediates are told apart on a real compiled function; the
runtime's two scratchpad modes (contiguous, paged) are picked from its
environment variables and sized as AWS's device-memory page does; the
sweep names the tutorial's order of fixes (full AC, then TP, then a smaller
batch) at a fixed global batch. Planned against measured
memory, and across AC modes, is in test_memory.py.

Tier: the three planner launches are e2e, in ``make test-slow``; the rest fast.
Run: .venv/bin/python -m pytest tests/test_plan.py -q
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import LLAMA_MODULE, REPO
from torchtitan_neuron.plan import sweep as sweeper
from torchtitan_neuron.plan.report import Plan

ARGS = ["--hf_assets_path=./tests/assets/tokenizer", "--training.seq_len=1024",
        "--training.local_batch_size=8", "--compile.backend=aot_eager"]


def _plan(ngpu: int, *extra: str, target: str = "cpu") -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_neuron.plan", "--module", LLAMA_MODULE,
         "--config", "simple_fsdp_llama3_debugmodel", f"--ngpu={ngpu}",
         f"--target={target}", "--json", *ARGS, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])


@pytest.mark.e2e
@pytest.mark.slow
def test_json_plan_has_the_verdict_and_breakdown():
    p = _plan(2)
    assert {"peak_gib", "capacity_gib", "fits", "breakdown"} <= p.keys()
    assert p["fits"] is True and p["capacity_gib"] > 0
    assert p["layout"]["dp_shard"] == 2 and p["layout"]["ac"] == "selective"
    parts = p["breakdown"]
    for key in ("sharded_parameters", "gradients", "optimizer_state",
                "saved_activations", "temporaries", "logits_and_loss",
                "gathered_parameters"):
        assert key in parts
    assert p["peak_gib"] >= sum(parts.values()) - 1e-3
    # fp32 AdamW: two moments per parameter.
    assert parts["optimizer_state"] == pytest.approx(2 * parts["sharded_parameters"], rel=0.01)


@pytest.mark.e2e
@pytest.mark.slow
def test_never_reshard_plans_the_blocks_kept_gathered():
    """--parallelism.fsdp_reshard_after_forward never keeps each block's
    gathered (bf16) parameters from forward to backward: the plan's peak grows
    by more than half of the whole model's bf16 size (the blocks hold all but
    the embedding and output) and by no more than all of it."""
    default = _plan(2)
    never = _plan(2, "--parallelism.fsdp_reshard_after_forward=never")
    whole_bf16 = default["breakdown"]["sharded_parameters"] * 2 / 2  # 2 ranks, fp32 -> bf16
    grown = never["peak_gib"] - default["peak_gib"]
    assert 0.5 * whole_bf16 < grown <= whole_bf16 + 1e-4, (grown, whole_bf16)
    assert never["breakdown"]["sharded_parameters"] == default["breakdown"]["sharded_parameters"]


@pytest.mark.e2e
@pytest.mark.slow
def test_trn2_plan_traces_the_rehearsals_neuron_graphs():
    p = _plan(2, target="trn2")
    assert p["trace"]["device"] == "neuron" and p["trace"]["compile_backend"] == "neuron"
    # The rehearsal of the same recipe and layout (its own compile backend,
    # ``neuron``, in place of the plan's) hands over the same graphs.
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_neuron.rehearse", "--module", LLAMA_MODULE,
         "--config", "simple_fsdp_llama3_debugmodel", "--ngpu=2", "--json", "--one-rank",
         *[a for a in ARGS if not a.startswith("--compile.backend")]],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert p["trace"]["graphs"] == len(report["graphs"]) > 0
    assert p["trace"]["ops"] == report["ops"]
    assert "aten._scaled_dot_product_fused_attention_overrideable" in p["trace"]["ops"]


@pytest.mark.e2e
@pytest.mark.slow
def test_run_train_plans_with_comm_mode_plan():
    env = dict(os.environ, NGPU="64", COMM_MODE="plan", MODULE=LLAMA_MODULE,
               CONFIG="simple_fsdp_llama3_debugmodel", PYTHON=sys.executable)
    proc = subprocess.run(["./run_train.sh", "--target=trn2", *ARGS], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "on 64 x trn2 (tp 1, dp_shard 64" in proc.stdout
    assert "capacity                        24.000 GiB" in proc.stdout
    assert "verdict: fits" in proc.stdout
    # The Neuron runtime's terms: scratchpad and the micro-code of 2 cores.
    assert "shared scratchpad" in proc.stdout and "private scratchpad" in proc.stdout
    # The scratchpad mode the verdict assumes, and the peak under the other.
    assert "scratchpad: contiguous (the default at LNC=2" in proc.stdout
    assert "with NEURON_RT_CONTIGUOUS_SCRATCHPAD=0: peak" in proc.stdout
    assert "runtime code                     0.188 GiB" in proc.stdout
    assert "torch.distributed.run" not in proc.stdout


def test_sweep_names_the_tutorials_order_of_fixes(monkeypatch):
    """The suggestion logic on stand-in plans: full AC first, then TP, then batch."""
    def fake_plan(fits_when):
        def run(opts, overrides, extra):
            tp = int(extra[0].split("=")[1])
            ac = extra[-1].split(":")[1]
            batch = next((int(a.split("=")[1]) for a in extra if "local_batch" in a), 8)
            fits = fits_when(tp, ac, batch)
            return {"fits": fits, "peak_gib": 1.0 if fits else 30.0, "capacity_gib": 24.0,
                    "layout": {"dp_shard": 64 // tp, "grad_accum": 1}}
        return run

    opts = SimpleNamespace(ngpu=64, config="recipe", capacity_gib=None)
    base = Plan("recipe", 64, "trn2", {"tp": 1, "local_batch": 8, "global_batch": 512}, 30.0, 24.0)
    cases = [
        (lambda tp, ac, b: ac == "full", "tensor_parallel_degree=1"),
        (lambda tp, ac, b: ac == "full" and tp >= 4, "tensor_parallel_degree=4"),
        (lambda tp, ac, b: ac == "full" and tp == 8 and b <= 2, "local_batch_size=2"),
    ]
    for fits_when, expected in cases:
        monkeypatch.setattr(sweeper, "_plan_in_subprocess", fake_plan(fits_when))
        last = sweeper.sweep(opts, [], base)[-1]
        assert last.startswith("Smallest change that fits:"), last
        assert expected in last and "activation-checkpoint:full" in last, last
        assert "--training.global_batch_size=512" in last, last  # the batch is held


def test_sweep_holds_and_shows_the_expert_parallel_degree(monkeypatch):
    """Under EP (or CP, PP) the sweep's cells keep the flag (passed through with the
    user's overrides) and its table shows the degree beside TP."""
    seen = []

    def run(opts, overrides, extra):
        seen.append(list(overrides))
        tp = int(extra[0].split("=")[1])
        return {"fits": True, "peak_gib": 8.0, "capacity_gib": 24.0,
                "layout": {"tp": tp, "ep": 4, "dp_shard": 64 // tp, "grad_accum": 1}}

    monkeypatch.setattr(sweeper, "_plan_in_subprocess", run)
    opts = SimpleNamespace(ngpu=64, config="recipe", capacity_gib=None)
    base = Plan("recipe", 64, "trn2", {"tp": 4, "ep": 4, "ep_imbalance": 2.0, "local_batch": 1,
                                        "global_batch": 64}, 8.0, 24.0)
    flags = ["--parallelism.expert_parallel_degree", "4"]
    rows = sweeper.sweep(opts, flags, base)
    assert rows[0].split()[:3] == ["tp", "ep", "dp_shard"], rows[0]
    assert rows[1].split()[:3] == ["1", "4", "64"], rows[1]
    assert all(o == flags for o in seen) and len(seen) == 8
    # A pipeline degree is held and shown the same way.
    base = Plan("recipe", 64, "trn2", {"tp": 4, "pp": 2, "local_batch": 2,
                                        "global_batch": 64}, 8.0, 24.0)
    assert sweeper.sweep(opts, [], base)[0].split()[:3] == ["tp", "pp", "dp_shard"]
    # Without EP, CP or PP the table is as before.
    base = Plan("recipe", 64, "trn2", {"tp": 4, "local_batch": 1, "global_batch": 64}, 8.0, 24.0)
    assert sweeper.sweep(opts, [], base)[0].split()[:2] == ["tp", "dp_shard"]


def test_compiled_program_splits_device_tensors_from_scratchpad():
    """The Neuron model on a real compiled function: what crosses the graph
    boundary is a device tensor, what the graph makes and drops is scratchpad,
    and an intermediate larger than a page is a private allocation."""
    import torch

    from torchtitan_neuron.memory_accounting.storage_tracker import StorageTracker
    from torchtitan_neuron.plan.backend import PlanBackend

    mib = 2**20
    backend = PlanBackend()
    f = torch.compile(
        lambda x: ((x * 2 + 1).repeat(4, 1) * 3).sum(0).repeat(4, 1).sum(0), backend=backend.name
    )
    x = torch.randn(mib // 4)  # 1 MiB of fp32
    f(x)  # compile outside the tracker
    tracker = StorageTracker()
    tracker.large_var_bytes = 3 * mib
    with backend.tracking(tracker):
        out = f(x)
    assert out.shape == (mib // 4,)
    # The output (1 MiB) is the only device tensor the program made.
    assert tracker.tensor_peak == mib
    # Everything else is scratchpad. Its need is the op-by-op peak: the
    # first repeat and its product, live together (4 MiB each), 8 MiB. The three
    # 4 MiB intermediates are over the 3 MiB page, so paged scratchpad gives
    # them private allocations: the first two are live together, the last
    # repeat comes after both are freed and reuses their space, 8 MiB.
    assert list(tracker.scratchpad_need.values()) == [8 * mib]
    assert list(tracker.scratchpad_large.values()) == [8 * mib]


def test_scratchpad_mode_follows_the_runtime_environment(monkeypatch):
    """Contiguous scratchpad is the runtime's default at LNC=2; it is paged
    with NEURON_RT_CONTIGUOUS_SCRATCHPAD=0 or at LNC=1 (AWS's
    neuron-runtime/explore/device-memory page)."""
    from torchtitan_neuron.devices.neuron import scratchpad_mode

    for name in ("NEURON_RT_CONTIGUOUS_SCRATCHPAD", "NEURON_LOGICAL_NC_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert scratchpad_mode()[0] == "contiguous"
    monkeypatch.setenv("NEURON_RT_CONTIGUOUS_SCRATCHPAD", "0")
    assert scratchpad_mode() == ("paged", "NEURON_RT_CONTIGUOUS_SCRATCHPAD=0")
    monkeypatch.delenv("NEURON_RT_CONTIGUOUS_SCRATCHPAD")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert scratchpad_mode()[0] == "paged"


def test_runtime_terms_of_each_scratchpad_mode(monkeypatch):
    """The runtime's arithmetic on a stand-in tracker: contiguous rounds the
    largest program's need to 64 MB and allocates nothing else; paged rounds
    it to its page (512 MB, or NEURON_SCRATCHPAD_PAGE_SIZE) and adds each
    program's over-a-page variables, as the page's two-NEFF example does."""
    from torchtitan_neuron.plan.neuron import runtime_terms

    mb = 2**20
    monkeypatch.delenv("NEURON_SCRATCHPAD_PAGE_SIZE", raising=False)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    # AWS's example: NEFF A needs 1.5 GB with a 1 GB variable, NEFF B 1.6 GB
    # (100 MB + 1.5 GB) with a 1.5 GB one.
    tracker = SimpleNamespace(scratchpad_need={1: 1536 * mb, 2: 1636 * mb},
                              scratchpad_large={1: 1024 * mb, 2: 1536 * mb})
    paged = runtime_terms(tracker, "paged")
    assert paged["shared_scratchpad"] == 2048 * mb  # 4 pages
    assert paged["private_scratchpad"] == 2560 * mb  # 2.5 GB
    assert paged["runtime_code"] == 2 * 96 * mb
    contiguous = runtime_terms(tracker, "contiguous")
    assert contiguous["shared_scratchpad"] == 1664 * mb  # 26 pages of 64 MB
    assert contiguous["private_scratchpad"] == 0
    monkeypatch.setenv("NEURON_SCRATCHPAD_PAGE_SIZE", "2048")
    assert runtime_terms(tracker, "paged")["shared_scratchpad"] == 2048 * mb
    assert runtime_terms(tracker, "contiguous")["shared_scratchpad"] == 1664 * mb


def test_random_tokens_need_no_tokenizer_and_resume_from_their_count():
    import torch

    from torchtitan_neuron.tracing.random_tokens import RandomTokens, VocabularySize

    tokenizer = VocabularySize.Config(vocab_size=100).build(tokenizer_path="")
    assert tokenizer.get_vocab_size() == 100
    with pytest.raises(TypeError, match="random token ids"):
        tokenizer.encode("text")
    kwargs = dict(dp_world_size=2, dp_rank=1, tokenizer=tokenizer, seq_len=16,
                  local_batch_size=3)
    loader = RandomTokens.Config(vocab_size=100).build(**kwargs)
    first, second = loader.batch(), loader.batch()
    inputs, labels = second
    assert inputs["input"].shape == labels.shape == (3, 16)
    assert int(inputs["input"].max()) < 100 and int(labels.min()) >= 0
    assert torch.equal(inputs["positions"][2], torch.arange(16))
    assert not torch.equal(first[0]["input"], inputs["input"])
    resumed = RandomTokens.Config(vocab_size=100).build(**kwargs)
    resumed.load_state_dict({"drawn": 1})
    assert torch.equal(resumed.batch()[0]["input"], inputs["input"])
    with pytest.raises(ValueError, match="vocabulary size"):
        RandomTokens.Config().build(**kwargs)


def test_step_hook_defaults_to_a_training_run():
    from torchtitan_neuron.trainer import QuietMetricsProcessor, StepHook

    hook = StepHook()
    assert hook.read_values and hook.wrap_clip is None
    assert QuietMetricsProcessor.should_log(None, 1) is False
