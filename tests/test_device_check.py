"""scripts/device_check.sh, the check to run on a machine with an accelerator.

Proves, on this CPU machine: the script parses (``bash -n``); with no
accelerator it refuses with exit 2 and says it is not a CPU test; its dry runs
print the commands it would run, NGPU=1 for CUDA (SimpleFSDP and the compiled
plain recipe) and NGPU = the NeuronCore count for Neuron (the Llama and
DeepSeek SimpleFSDP debug recipes and the rehearsal of each), the DeepSeek
recipe skipped at an odd count; a forced platform is refused outside a dry run.
With a stand-in launcher and interpreter (a copy of the script beside them) it
shows the real-run path: step lines printed without colours, one summary line
per run with its losses, the rehearsal's verdict from its JSON, the whole
output in the log, and exit 1 when a run failed; a run past its time limit is
stopped (exit 124) and named as such.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_device_check.py -q
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "device_check.sh"
LLAMA = "torchtitan_neuron.experiments.graph_trainer.llama3"
DEEPSEEK = "torchtitan_neuron.experiments.graph_trainer.deepseek_v3"
DATA = "--dataloader.dataset c4_test --hf_assets_path=./tests/assets/tokenizer"


def device_check(*args, script=SCRIPT, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICE_CHECK_")}
    full_env.update({"PYTHON": sys.executable, **env})
    return subprocess.run(["bash", str(script), *args], env=full_env, capture_output=True,
                          text=True, timeout=120)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_no_accelerator_exits_2_and_says_it_is_not_a_cpu_test():
    import torch

    if importlib.util.find_spec("torch_neuronx") or torch.cuda.is_available():
        pytest.skip("this machine has an accelerator")
    result = device_check()
    assert result.returncode == 2, result.stderr
    assert "no accelerator on this machine" in result.stderr
    assert "it is not a CPU test" in result.stderr
    assert "step:" not in result.stdout


def test_cuda_dry_run_prints_both_one_rank_runs():
    result = device_check("--dry-run", DEVICE_CHECK_PLATFORM="cuda")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"NGPU=1 MODULE={LLAMA} CONFIG=simple_fsdp_llama3_debugmodel ./run_train.sh " \
           f"--training.steps 10 {DATA}   (time limit 1800 s)" in lines
    assert "NGPU=1 MODULE=torchtitan_neuron.models.llama3 CONFIG=llama3_debugmodel_neuron_compiled" \
           f" ./run_train.sh --training.steps 10 {DATA}   (time limit 1800 s)" in lines
    assert "rehearse" not in result.stdout


def test_neuron_dry_run_uses_every_core_and_rehearses_each_recipe():
    result = device_check("--dry-run", "--steps", "3", DEVICE_CHECK_PLATFORM="neuron",
                          DEVICE_CHECK_NEURON_CORES="64")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"NGPU=64 MODULE={LLAMA} CONFIG=simple_fsdp_llama3_debugmodel ./run_train.sh " \
           f"--training.steps 3 {DATA}" in out
    assert f"NGPU=64 MODULE={DEEPSEEK} CONFIG=simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2 " \
           f"./run_train.sh --training.steps 3 {DATA} --training.global_batch_size=-1" in out
    # Printed whether or not this checkout has the rehearsal yet.
    assert f"-m torchtitan_neuron.rehearse --module {LLAMA} --config " \
           "simple_fsdp_llama3_debugmodel --ngpu 64 --json" in out
    assert f"-m torchtitan_neuron.rehearse --module {DEEPSEEK} --config " \
           "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2 --ngpu 64 --json " \
           "--training.global_batch_size=-1" in out
    assert "NGPU=1 " not in out


def test_neuron_dry_run_skips_deepseek_on_an_odd_core_count():
    result = device_check("--dry-run", DEVICE_CHECK_PLATFORM="neuron",
                          DEVICE_CHECK_NEURON_CORES="3")
    assert result.returncode == 0, result.stderr
    assert "CONFIG=simple_fsdp_llama3_debugmodel" in result.stdout
    assert "TP2 needs an even number of NeuronCores, and 3 is odd" in result.stdout
    assert "CONFIG=simple_fsdp_deepseek" not in result.stdout


@pytest.mark.parametrize("args, platform, message", [
    ((), "cuda", "forces the branch for --dry-run only"),
    (("--dry-run",), "cpu", "DEVICE_CHECK_PLATFORM=cpu: use cuda or neuron"),
])
def test_a_forced_platform_is_only_for_a_dry_run_of_cuda_or_neuron(args, platform, message):
    result = device_check(*args, DEVICE_CHECK_PLATFORM=platform)
    assert result.returncode == 2 and message in result.stderr


def test_a_neuron_dry_run_without_a_core_count_names_the_variable():
    result = device_check("--dry-run", DEVICE_CHECK_PLATFORM="neuron")
    assert result.returncode == 2 and "DEVICE_CHECK_NEURON_CORES" in result.stderr


# A launcher that prints torchtitan's coloured step lines: the Llama run
# trains its 4 steps, the DeepSeek run crashes after step 2.
STAND_IN_LAUNCHER = r"""#!/usr/bin/env bash
last=4; [ "$CONFIG" = simple_fsdp_llama3_debugmodel ] || last=2
echo "launching NGPU=$NGPU $CONFIG $*"
for s in $(seq 1 $last); do
    printf '[rank0]:2026-12-01 06:00:0%s,000 - root - INFO - \033[31mstep:  %s  \033[32mloss:  %s.50000  \033[38;2;180;60;0mgrad_norm:  1.0000  \033[36mmemory:  1.00GiB(1.00%%)\033[39m\n' "$s" "$s" "$((10 - s))"
done
[ "$last" = 4 ] || { echo "RuntimeError: stand-in crash"; exit 1; }
"""

# An interpreter that answers the platform detection (neuron, 4 cores) and
# the rehearsal (not ready), and passes everything else to Python.
STAND_IN_PYTHON = f"""#!/usr/bin/env bash
if [ "$#" = 1 ] && [ "$1" = - ]; then cat >/dev/null; echo "neuron 4 torch stand-in"; exit 0; fi
if [ "$1" = -c ]; then exit 0; fi
if [ "$1" = -m ] && [ "$2" = torchtitan_neuron.rehearse ]; then
    echo "a log line on stdout"
    printf '{{\\n  "ready": false,\\n  "reasons": ["graph break at model.py:7"]\\n}}\\n'
    exit 1
fi
exec {sys.executable} "$@"
"""


def stand_in_checkout(root: Path, launcher: str, python: str) -> Path:
    """A copy of the script with the given launcher and interpreter beside it."""
    (root / "scripts").mkdir()
    script = root / "scripts" / "device_check.sh"
    shutil.copy(SCRIPT, script)
    for name, text in (("run_train.sh", launcher), ("python", python)):
        (root / name).write_text(text)
        (root / name).chmod(0o755)
    return script


def test_a_run_prints_step_lines_summaries_and_keeps_a_log(tmp_path):
    script = stand_in_checkout(tmp_path, STAND_IN_LAUNCHER, STAND_IN_PYTHON)
    log = tmp_path / "check.log"
    result = device_check("--steps", "4", "--log", str(log), script=script,
                          PYTHON=str(tmp_path / "python"))
    out = result.stdout
    assert result.returncode == 1, result.stderr
    assert "\033" not in out
    lines = out.splitlines()
    for step in range(1, 5):  # the passing run's step lines, colours removed
        assert f"[rank0]:2026-12-01 06:00:0{step},000 - root - INFO - step:  {step}  loss:  " \
               f"{10 - step}.50000  grad_norm:  1.0000  memory:  1.00GiB(1.00%)" in lines
    assert "launching NGPU=4 simple_fsdp_llama3_debugmodel" not in out  # only its step lines
    assert "passed  simple_fsdp_llama3_debugmodel  NGPU=4  steps 4/4  loss 9.50000 -> 6.50000" \
           "  exit 0" in out
    assert "FAILED  simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2  NGPU=4  steps 2/4  " \
           "loss 9.50000 -> 8.50000  exit 1" in out
    assert "RuntimeError: stand-in crash" in out  # the failed run's last lines
    assert "rehearsal verdict: not ready: graph break at model.py:7 (exit 1" in out
    assert f"log: {log}" in out.splitlines()[-1]
    text = log.read_text()
    assert "platform: neuron, 4 devices seen; torch stand-in" in text
    assert "commit: unknown (not a git checkout)" in text
    assert "launching NGPU=4 simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2 " \
           "--training.steps 4 --dataloader.dataset c4_test" in text
    assert '"reasons": ["graph break at model.py:7"]' in text


def test_a_run_past_its_time_limit_is_stopped_and_failed(tmp_path):
    hanging = "#!/usr/bin/env bash\necho starting\nexec sleep 60\n"
    on_cuda = STAND_IN_PYTHON.replace("neuron 4 torch stand-in", "cuda 1 torch stand-in")
    script = stand_in_checkout(tmp_path, hanging, on_cuda)
    result = device_check("--timeout", "1", "--log", str(tmp_path / "check.log"),
                          script=script, PYTHON=str(tmp_path / "python"))
    assert result.returncode == 1, result.stderr
    for config in ("simple_fsdp_llama3_debugmodel", "llama3_debugmodel_neuron_compiled"):
        assert f"FAILED  {config}  NGPU=1  steps none/10  loss none -> none  exit 124" \
               in result.stdout
    assert result.stdout.count("stopped at the 1 s limit") == 2
