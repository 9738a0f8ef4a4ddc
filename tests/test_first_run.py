"""A first run reads clean: ``make train``'s own command on a cold compile cache.

Proves: every warning line the run prints is on the allow-list below (the jit
deprecation, once); the start-up line says which known upstream warnings were
hidden and how to show them, the ranks' allocator (jemalloc where
installed) and their gloo groups' one worker thread; the first step's compile is announced with its
cache folder, kept alive by heartbeats and timed as a cold cache; rank 0 ends
with a summary (steps, first and last loss as the step lines print them,
medians after the first step, peak memory, compile time, where the outputs
went, the trn2 planner command) and writes it as run_summary.json, which
scripts/plot_run.py draws. The
compile-progress and summary pieces are unit-tested in test_run_report.py.

Tier: e2e, in ``make test-slow``: the recipe trains in bf16, and on a CPU
without native bf16 matrix multiplies (AMD EPYC before Zen 4) its ten steps
take minutes (docs/troubleshooting.md).
Run: .venv/bin/python -m pytest tests/test_first_run.py -q
"""

import json
import os
import re
import shlex
import sys

import pytest

from conftest import REPO
from torchtitan_neuron.devices.cpu_allocator import JEMALLOC_CONF, find_jemalloc
from runlog import run_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The only warning lines a first run may print, each with how often.
ALLOWED_WARNINGS = {
    # The tutorial: the jit mode is deprecated upstream and the only mode here.
    "compile.mode='jit' is deprecated": 1,
}
# A warning line: torchtitan's logger, Python's warnings, torch's glog-style logs.
WARNING_LINE = re.compile(r" - WARNING - |Warning: |^(\[rank\d+\]:)*W\d{4} ")


def make_train_command() -> list[str]:
    """The recipe line of the Makefile's ``train`` target, as make runs it."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    line = re.search(r"^train:.*\n\t(.+)$", text, re.M)[1]
    return shlex.split(line)


def test_make_train_reads_clean(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TORCHTITAN_NEURON_HEARTBEAT_S="5")
    for name in ("TORCHTITAN_NEURON_SHOW_ALL_WARNINGS", "TORCHTITAN_NEURON_CPU_ALLOCATOR",
                 "LD_PRELOAD", "MALLOC_CONF"):
        env.pop(name, None)
    out = tmp_path / "out"
    result = run_command([*make_train_command(), f"--dump_folder={out}"], env, timeout=900)
    text = result.output
    assert result.returncode == 0, text[-4000:]
    assert [s.step for s in result.steps] == list(range(1, 11)), text[-4000:]

    warnings = [line for line in text.splitlines() if WARNING_LINE.search(line)]
    for allowed, count in ALLOWED_WARNINGS.items():
        assert sum(allowed in line for line in warnings) == count, warnings
    unexpected = [w for w in warnings if not any(a in w for a in ALLOWED_WARNINGS)]
    assert not unexpected, "\n".join(unexpected)
    assert "torchrun" not in text and "OMP_NUM_THREADS" not in text
    assert re.search(r"\d known cpu warnings hidden \(.*\); "
                     r"TORCHTITAN_NEURON_SHOW_ALL_WARNINGS=1 shows them", text)

    # The ranks' allocator: jemalloc, preloaded by the launcher, where installed.
    if find_jemalloc():
        assert f"allocator jemalloc (MALLOC_CONF={JEMALLOC_CONF};" in text, text[-4000:]
    else:
        assert "allocator glibc malloc; CPU ranks step faster on jemalloc" in text, text[-4000:]
    # Gloo groups without torch 2.14.1's racing second worker (test_gloo.py).
    assert "gloo process groups with one worker thread" in text, text[-4000:]

    # The compile: announced with the cache folder, heartbeats, timed (cold).
    assert (f"this happens on the first step only (compile cache: {tmp_path / 'inductor'}"
            in text), text[-4000:]
    assert re.search(r"Step 1 still compiling: \d+ s elapsed", text)
    done = re.search(r"Step 1 compiled and ran in ([\d.]+) s \(cold cache: (\d+) graphs compiled",
                     text)
    assert done and float(done[1]) > 0 and int(done[2]) > 0, text[-4000:]

    # The summary, and its file, agree with the step lines.
    summary = json.loads((out / "run_summary.json").read_text())
    steps = result.steps
    assert summary["steps_run"] == 10
    assert summary["loss_first"] == pytest.approx(steps[0].loss, abs=1e-5)
    assert summary["loss_last"] == pytest.approx(steps[-1].loss, abs=1e-5)
    assert summary["first_step_compile_s"] == pytest.approx(float(done[1]), abs=0.1)
    assert "Run summary (simple_fsdp_llama3_debugmodel): 10 steps logged" in text
    assert f"{steps[0].loss:.5f} -> {steps[-1].loss:.5f}" in text
    assert f"structured logs      {out / 'structured_logs'}" in text
    assert ("python -m torchtitan_neuron.plan --module "
            "torchtitan_neuron.experiments.graph_trainer.llama3 --config "
            "simple_fsdp_llama3_8b --ngpu 64 --target trn2") in text

    # The run's own picture: loss and step time from its dump folder.
    png = tmp_path / "run.png"
    plot = run_command([sys.executable, "scripts/plot_run.py", str(out), "--out", str(png)],
                       env, timeout=120)
    assert plot.returncode == 0, plot.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
