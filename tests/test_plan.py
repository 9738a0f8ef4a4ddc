"""The memory planner traces the recipe's real step on FakeTensors.

Proves: ``python -m torchtitan_neuron.plan --json`` prints peak, capacity,
verdict and a breakdown for rank 0 of N without allocating the model; the
sharded parameters, gradients and optimizer state it counts halve from 2 to 4
ranks; activation checkpointing lowers the planned saved activations and peak
(full < selective < none); the sweep names the tutorial's order of fixes
(full AC, then TP, then a smaller batch).

Run: .venv/bin/python -m pytest tests/test_plan.py -q
"""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import LLAMA_MODULE, REPO
from torchtitan_neuron import plan as planner

ARGS = ["--hf_assets_path=./tests/assets/tokenizer", "--training.seq_len=1024",
        "--training.local_batch_size=8"]


def _plan(ngpu: int, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_neuron.plan", "--module", LLAMA_MODULE,
         "--config", "simple_fsdp_llama3_debugmodel", f"--ngpu={ngpu}",
         "--target=cpu", "--json", *ARGS, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])


@pytest.fixture(scope="module")
def plans():
    return {
        "2:selective": _plan(2),
        "4:selective": _plan(4),
        "2:full": _plan(2, "activation-checkpoint:full"),
        "2:none": _plan(2, "activation-checkpoint:none"),
    }


def test_json_plan_has_the_verdict_and_breakdown(plans):
    p = plans["2:selective"]
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


def test_sharded_state_halves_with_ranks(plans):
    two, four = plans["2:selective"]["breakdown"], plans["4:selective"]["breakdown"]
    for key in ("sharded_parameters", "gradients", "optimizer_state"):
        assert four[key] == pytest.approx(two[key] / 2, rel=0.02), key


def test_activation_checkpointing_lowers_the_plan(plans):
    acts = {m: plans[f"2:{m}"]["breakdown"]["saved_activations"] for m in ("none", "selective", "full")}
    peaks = {m: plans[f"2:{m}"]["peak_gib"] for m in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] < acts["none"], acts
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


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
    base = planner.Plan("recipe", 64, "trn2", {"tp": 1, "local_batch": 8, "global_batch": 512}, 30.0, 24.0)
    cases = [
        (lambda tp, ac, b: ac == "full", "tensor_parallel_degree=1"),
        (lambda tp, ac, b: ac == "full" and tp >= 4, "tensor_parallel_degree=4"),
        (lambda tp, ac, b: ac == "full" and tp == 8 and b <= 2, "local_batch_size=2"),
    ]
    for fits_when, expected in cases:
        monkeypatch.setattr(planner, "_plan_in_subprocess", fake_plan(fits_when))
        last = planner.sweep(opts, [], base)[-1]
        assert last.startswith("Smallest change that fits:"), last
        assert expected in last and "activation-checkpoint:full" in last, last
        assert "--training.global_batch_size=512" in last, last  # the batch is held
