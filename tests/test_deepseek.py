"""DeepSeek-V3 and the plain-FSDP recipes, trained as a user would.

Proves: the SimpleFSDP DeepSeek debug recipe trains on 4 CPU ranks as
TP2 x FSDP2 through run_train.sh (finite, falling loss), prints the expert
load imbalance each step, and its expert biases move between steps; the
plain-FSDP tiny flavors (Llama, Qwen3 and DeepSeek, TP2 x FSDP2, and Llama
FSDP2) train.

Run: .venv/bin/python -m pytest tests/test_deepseek.py -q
"""

import math
import re

import pytest

DS_MODULE = "torchtitan_neuron.experiments.graph_trainer.deepseek_v3"
DATA = ["--dataloader.dataset", "c4_test", "--debug.seed", "0"]
_BALANCE = re.compile(r"step:\s+(\d+)\s+expert_imbalance: ([\d.]+)\s+expert_bias_spread: ([\d.]+)")


def _finite_and_falling(result, n_steps):
    assert result.returncode == 0, result.output[-4000:]
    steps = result.steps
    assert [s.step for s in steps] == list(range(1, n_steps + 1)), result.output[-4000:]
    assert all(math.isfinite(s.loss) for s in steps)
    assert steps[-1].loss < steps[0].loss


def test_simple_fsdp_deepseek_tp2_fsdp2_trains_and_balances(run, dump_folder):
    result = run(
        ["--training.steps", "6", *DATA, "--compile.backend", "aot_eager"],
        ngpu=4, module=DS_MODULE, config="simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2",
        dump_folder=dump_folder,
    )
    _finite_and_falling(result, 6)
    assert "tp=2" in result.output and "dp_shard=2" in result.output
    balance = [(int(s), float(i), float(b)) for s, i, b in _BALANCE.findall(result.output)]
    assert [s for s, _, _ in balance] == list(range(1, 7))
    assert all(i >= 1.0 for _, i, _ in balance)
    spreads = [b for _, _, b in balance]
    assert spreads[0] > 0 and len(set(spreads)) > 1, spreads  # biases move every step


@pytest.mark.parametrize(
    "module, config, ngpu",
    [
        ("torchtitan_neuron.models.llama3", "llama3_debugmodel_neuron", 2),
        ("torchtitan_neuron.models.llama3", "llama3_debugmodel_tp2_fsdp2_sac", 4),
        ("torchtitan_neuron.models.qwen3", "qwen3_debugmodel_tp2_fsdp2_sac", 4),
        ("torchtitan_neuron.models.deepseek_v3", "deepseek_v3_debugmodel_neuron_tp2_fsdp2", 4),
    ],
)
def test_plain_fsdp_tiny_flavors_train(run, dump_folder, module, config, ngpu):
    result = run(["--training.steps", "3", *DATA], ngpu=ngpu, module=module,
                 config=config, dump_folder=dump_folder)
    _finite_and_falling(result, 3)
