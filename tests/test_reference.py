"""The path users run, checked against a reference.

Proves: ``make train``'s own command (2 CPU ranks, the SimpleFSDP Llama
debug recipe compiled with inductor, SimpleFSDP's bucketing and prefetch),
in fp32 and for 8 steps, prints the losses of the same recipe on 1 rank
under ``aot_eager`` (no compiler passes, no sharding, the same 8 sequences
a step) within 1e-5 relative; with ``--compile.no-prefetch`` it prints the
same losses bit for bit, and only the prefetching run's log says what the
pass moved. Every parity, resume and bucketing test elsewhere runs
``aot_eager``; this one runs what ``make train`` and the bench run.
(DeepSeek's default path: tests/test_deepseek.py.)

Tier: e2e, in ``make test-slow`` (three launches, about 3.5 minutes).
Run: .venv/bin/python -m pytest tests/test_reference.py -q
"""

from __future__ import annotations

import os

import pytest

from runlog import run_command
from test_first_run import make_train_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FP32_8 = ["--training.mixed_precision_param", "float32", "--training.steps", "8",
          "--debug.seed", "0"]


def _without_steps(command: list[str]) -> list[str]:
    """``command`` less its ``--training.steps N``."""
    at = command.index("--training.steps")
    return command[:at] + command[at + 2:]


def test_make_train_prints_the_one_rank_aot_eager_losses(tmp_path):
    from conftest import run_train

    command = _without_steps(make_train_command())
    runs = {}
    for name, flag in (("default", []), ("no-prefetch", ["--compile.no-prefetch"])):
        # A cold compile cache of its own, so the passes run (a warm one
        # loads the compiled graphs) and the log says what they did.
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"))
        run = run_command([*command, *FP32_8, *flag, f"--dump_folder={tmp_path / name}"],
                          env, timeout=900)
        assert run.returncode == 0, run.output[-4000:]
        assert "compile backend inductor" in run.output
        assert "SimpleFSDP bucketing:" in run.output
        assert ("gathers prefetched" in run.output) == (not flag), run.output[-4000:]
        runs[name] = run
    default = runs["default"]
    # Prefetch only moves collectives: the same arithmetic, bit for bit.
    assert [s.loss for s in default.steps] == [s.loss for s in runs["no-prefetch"].steps]
    # The recipe's 4 sequences on each of 2 ranks: 8 on the one rank.
    reference = run_train([*command[1:], *FP32_8, "--compile.backend", "aot_eager",
                           "--training.local_batch_size", "8"],
                          ngpu=1, dump_folder=tmp_path / "reference")
    assert reference.returncode == 0, reference.output[-4000:]
    mine, ref = [s.loss for s in default.steps], [s.loss for s in reference.steps]
    assert len(mine) == len(ref) == 8, (mine, ref)
    worst = max(abs(a - b) / abs(b) for a, b in zip(mine, ref))
    print(f"reference-figure llama inductor 2 ranks {mine}, aot_eager 1 rank {ref}, "
          f"largest relative difference {worst:.2e}")
    assert worst <= 1e-5, (mine, ref)
