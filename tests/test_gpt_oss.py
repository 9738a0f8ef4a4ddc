"""GPT-OSS on SimpleFSDP, trained, resumed, planned and rehearsed as a user would.

Proves: the SimpleFSDP GPT-OSS debug flavor gives the same per-step losses
(fp32, one seed and data, block-causal attention, within 1e-5) on 1 rank, on
FSDP2 (2 ranks) and on TP2 x EP2 x FSDP2 (4 ranks), falling, with the expert
imbalance printed every step and the expert biases moving; 10 steps with a
checkpoint at 5 equal the same run resumed from its step-5 checkpoint (the
step-10 checkpoint removed, so the resume starts at step 6 with the 10-step
schedule), loss and grad norm bit for bit; the planner gives a verdict for
every GPT-OSS debug recipe at its ranks, the TP2 x EP2 one included; the
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


@pytest.mark.parametrize("ngpu, config, layout", [
    (2, "simple_fsdp_gpt_oss_debugmodel", "tp=1, ep=1"),
    (4, "simple_fsdp_gpt_oss_debugmodel_tp2_ep2", "tp=2, ep=2"),
])
def test_simple_fsdp_gpt_oss_matches_one_rank(tmp_path, ngpu, config, layout):
    side = f"PREFLIGHT=0 MODULE={GPT_OSS}"
    proc = run_command(
        [sys.executable, "scripts/loss_compare.py", "--steps", "3", "--out", str(tmp_path),
         "--a", f"NGPU=1 {side} CONFIG=simple_fsdp_gpt_oss_debugmodel",
         "--b", f"NGPU={ngpu} {side} CONFIG={config}",
         "--", "--model.attn_mask_type", "block_causal"],
        timeout=1500,
    )
    # Global batch 4 in both: 1 rank accumulates 2 micro-batches, the other
    # layouts have 2 data-parallel ranks.
    assert proc.returncode == 0, proc.output[-4000:]
    assert float(re.search(r"max_rel_diff=(\S+)", proc.output)[1]) <= 1e-5
    result = Run(0, (tmp_path / "b.log").read_text())
    steps = result.steps
    assert [s.step for s in steps] == [1, 2, 3] and all(math.isfinite(s.loss) for s in steps)
    assert steps[-1].loss < steps[0].loss
    assert layout in result.output and "dp_shard=2" in result.output
    assert "cross a document boundary" not in result.output
    balance = [(int(s), float(i), float(b)) for s, i, b in _BALANCE.findall(result.output)]
    assert [s for s, _, _ in balance] == [1, 2, 3] and all(i >= 1.0 for _, i, _ in balance)
    spreads = [b for _, _, b in balance]
    assert spreads[0] > 0 and len(set(spreads)) > 1, spreads


def test_resume_from_step_5_equals_the_uninterrupted_run(tmp_path):
    ten = [*PARITY, "--training.steps", "10", "--checkpoint.enable",
           "--checkpoint.interval", "5"]
    dump = tmp_path / "run"
    full = run_train(ten, config="simple_fsdp_gpt_oss_debugmodel", module=GPT_OSS,
                     dump_folder=dump, timeout=1200)
    assert full.returncode == 0, full.output[-4000:]
    assert [s.step for s in full.steps] == list(range(1, 11))
    # What a run stopped after its step-5 save leaves behind.
    shutil.rmtree(dump / "checkpoint" / "step-10")
    resumed = run_train(ten, config="simple_fsdp_gpt_oss_debugmodel", module=GPT_OSS,
                        dump_folder=dump, timeout=1200)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "Loading the checkpoint from" in resumed.output and "step-5" in resumed.output
    assert [(s.step, s.loss, s.grad_norm) for s in resumed.steps] == [
        (s.step, s.loss, s.grad_norm) for s in full.steps[5:]
    ]


def _tool(tool: str, module: str, config: str, ngpu: int, *extra: str):
    proc = subprocess.run(
        [sys.executable, "-m", f"torchtitan_neuron.{tool}", "--module", module,
         "--config", config, f"--ngpu={ngpu}", "--json", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    return proc.returncode, json.loads(lines[-1])


@pytest.mark.parametrize("module, config, ngpu, tp", [
    (GPT_OSS, "simple_fsdp_gpt_oss_debugmodel", 2, 1),
    (GPT_OSS, "simple_fsdp_gpt_oss_debugmodel_fullac", 2, 1),
    (GPT_OSS, "simple_fsdp_gpt_oss_debugmodel_tp2_fsdp2", 4, 2),
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
