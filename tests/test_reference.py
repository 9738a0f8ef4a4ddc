"""The path users run, checked against a reference.

Proves: ``make train``'s own command (2 CPU ranks, the SimpleFSDP Llama
debug recipe compiled with inductor, SimpleFSDP's bucketing and prefetch),
in fp32 and for 8 steps, prints the losses of the same recipe on 1 rank
under ``aot_eager`` (no compiler passes, no sharding, the same 8 sequences
a step) within 1e-5 relative. Every parity, resume and bucketing test
elsewhere runs ``aot_eager``; this one runs what ``make train`` and the
bench run. (DeepSeek's default path: tests/test_deepseek.py.)

Tier: e2e, in ``make test-slow`` (two launches, about 2.5 minutes).
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
    # A cold compile cache of its own, so the passes run (a warm one loads
    # the compiled graphs) and the log says what they did.
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    default = run_command([*command, *FP32_8, f"--dump_folder={tmp_path / 'default'}"],
                          env, timeout=900)
    assert default.returncode == 0, default.output[-4000:]
    assert "compile backend inductor" in default.output
    assert "SimpleFSDP bucketing:" in default.output
    assert "gathers prefetched" in default.output
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
