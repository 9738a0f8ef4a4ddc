"""GPT-OSS on SimpleFSDP, trained, resumed, planned and rehearsed as a user would.

Proves: the SimpleFSDP GPT-OSS debug flavor gives the same per-step losses
(fp32, one seed and data, block-causal attention, within 1e-5) on 1 rank and
on FSDP2 (2 ranks), falling, with the expert imbalance printed every step and
the expert biases moving; the FSDP2 run's step-3 checkpoint resumes at FSDP2
with loss and grad norm bit for bit (the 6-step schedule, as a run stopped
after its step-3 save), and at TP2 x EP2 x FSDP2 (4 ranks) with the 1-rank
losses within 1e-5; the planner gives a verdict for
the GPT-OSS debug recipes at their ranks (FSDP, TP2 x EP2, plain FSDP); the
Neuron rehearsal says ``ready`` for the SimpleFSDP debug flavors.

Tier: e2e, in ``make test-slow``.
Run: .venv/bin/python -m pytest tests/test_gpt_oss.py -q
"""

import json
import math
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, run_train
from runlog import Run, run_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GPT_OSS = "torchtitan_neuron.experiments.graph_trainer.gpt_oss"
PLAIN_GPT_OSS = "torchtitan_neuron.models.gpt_oss"
_BALANCE = re.compile(r"step:\s+(\d+)\s+expert_imbalance: ([\d.]+)\s+expert_bias_spread: ([\d.]+)")
PARITY = [
    "--dataloader.dataset", "c4_test", "--hf_assets_path=./tests/assets/tokenizer",
    "--compile.backend", "aot_eager", "--training.mixed_precision_param", "float32",
    "--training.seq_len", "256", "--training.local_batch_size", "2",
    "--metrics.log_freq", "1", "--debug.seed", "0",
]


def _balance(result: Run, steps: list[int]):
    """The expert imbalance printed every step, and the biases moving."""
    balance = [(int(s), float(i), float(b)) for s, i, b in _BALANCE.findall(result.output)]
    assert [s for s, _, _ in balance] == steps and all(i >= 1.0 for _, i, _ in balance)
    spreads = [b for _, _, b in balance]
    assert spreads[0] > 0 and len(set(spreads)) > 1, spreads


def test_simple_fsdp_gpt_oss_matches_one_rank_and_resumes_across_layouts(tmp_path):
    """FSDP2 against 1 rank over 6 steps; its step-3 checkpoint resumes at
    its own layout bit for bit, and at TP2 x EP2 x FSDP2 (4 ranks) within
    1e-5 of the 1-rank run. One launch per layout: the parity, the resume and
    the TP2 x EP2 layout share them."""
    side = f"PREFLIGHT=0 MODULE={GPT_OSS} CONFIG=simple_fsdp_gpt_oss_debugmodel"
    proc = run_command(
        [sys.executable, "scripts/loss_compare.py", "--steps", "6", "--rtol", "1e-5",
         "--out", str(tmp_path),
         "--a", f"NGPU=1 {side}",
         "--b", f"NGPU=2 {side} --checkpoint.enable --checkpoint.interval 3",
         "--", "--model.attn_mask_type", "block_causal"],
        timeout=1500,
    )
    # Global batch 4 in both: 1 rank accumulates 2 micro-batches, FSDP2 has
    # 2 data-parallel ranks.
    assert proc.returncode == 0, proc.output[-4000:]
    assert float(re.search(r"max_rel_diff=(\S+)", proc.output)[1]) <= 1e-5
    fsdp2 = Run(0, (tmp_path / "b.log").read_text())
    steps = fsdp2.steps
    assert [s.step for s in steps] == list(range(1, 7)) and all(math.isfinite(s.loss)
                                                               for s in steps)
    assert steps[-1].loss < steps[0].loss
    assert "tp=1, ep=1" in fsdp2.output and "dp_shard=2" in fsdp2.output
    assert "cross a document boundary" not in fsdp2.output
    _balance(fsdp2, list(range(1, 7)))
    one = Run(0, (tmp_path / "a.log").read_text()).steps

    # Resumed from step 3, as a run stopped after its step-3 save is.
    flags = [*PARITY, "--model.attn_mask_type", "block_causal", "--training.steps", "6",
             "--checkpoint.enable", "--checkpoint.interval", "3"]
    layouts = {"fsdp2": (2, "simple_fsdp_gpt_oss_debugmodel", "tp=1, ep=1"),
               "tp2_ep2": (4, "simple_fsdp_gpt_oss_debugmodel_tp2_ep2", "tp=2, ep=2")}
    for name, (ngpu, config, layout) in layouts.items():
        shutil.copytree(tmp_path / "b" / "checkpoint" / "step-3",
                        tmp_path / name / "checkpoint" / "step-3")
        run = run_train(flags, ngpu=ngpu, config=config, module=GPT_OSS,
                        dump_folder=tmp_path / name, timeout=1200)
        assert run.returncode == 0, run.output[-4000:]
        assert "Loading the checkpoint from" in run.output and "step-3" in run.output
        assert layout in run.output and "dp_shard=2" in run.output
        assert [s.step for s in run.steps] == [4, 5, 6]
        if name == "fsdp2":  # its own layout: loss and grad norm bit for bit
            assert [(s.loss, s.grad_norm) for s in run.steps] == [
                (s.loss, s.grad_norm) for s in steps[3:]]
        else:
            _balance(run, [4, 5, 6])
            for mine, ref in zip(run.steps, one[3:]):
                assert abs(mine.loss - ref.loss) <= 1e-5 * abs(ref.loss), (run.steps, one)


def _tool(tool: str, module: str, config: str, ngpu: int, *extra: str):
    proc = subprocess.run(
        [sys.executable, "-m", f"torchtitan_neuron.{tool}", "--module", module,
         "--config", config, f"--ngpu={ngpu}", "--json", *extra,
         *(["--one-rank"] if tool == "rehearse" else [])],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    return proc.returncode, json.loads(lines[-1])


# One process each: the FSDP, the TP x EP and the plain-FSDP recipes. The
# full-AC and TP2 x FSDP2 SimpleFSDP flavors differ from these only in AC and
# TP, which the Llama plans cover (test_plan.py, test_memory.py); their
# rehearsals are below.
@pytest.mark.parametrize("module, config, ngpu, tp", [
    (GPT_OSS, "simple_fsdp_gpt_oss_debugmodel", 2, 1),
    (GPT_OSS, "simple_fsdp_gpt_oss_debugmodel_tp2_ep2", 4, 2),
    (PLAIN_GPT_OSS, "gpt_oss_debugmodel_neuron_tp2_fsdp2", 4, 2),
])
def test_planner_gives_a_verdict_for_each_debug_recipe(module, config, ngpu, tp):
    code, plan = _tool("plan", module, config, ngpu, "--target=trn2")
    assert code == 0, plan
    assert plan["fits"] is True and plan["peak_gib"] > 0
    assert plan["layout"]["tp"] == tp and plan["layout"]["dp_shard"] == ngpu // tp
    if config.endswith("_ep2"):  # planned with the EP all-to-all (row plan-ep-splits)
        assert plan["layout"]["ep"] == 2 and plan["layout"]["ep_imbalance"] == 2.0


@pytest.mark.parametrize("config, ngpu", [
    ("simple_fsdp_gpt_oss_debugmodel", 2),
    ("simple_fsdp_gpt_oss_debugmodel_fullac", 2),
    ("simple_fsdp_gpt_oss_debugmodel_tp2_fsdp2", 4),
])
def test_rehearsal_is_ready_for_the_simple_fsdp_debug_flavors(config, ngpu):
    code, report = _tool("rehearse", GPT_OSS, config, ngpu)
    assert code == 0 and report["ready"], report["reasons"]
    assert report["graph_breaks"] == [] and report["recompiles"] == []
    assert report["collectives"]["all_gather_into_tensor"]["count"] > 0
    assert "aten._scaled_dot_product_fused_attention_overrideable" in report["ops"]
