"""run_train.sh behaves like upstream's launcher, and fails and stops cleanly.

Proves: a refused setting (``--compile.mode aot_fx_trace``) is reported once,
clearly, with a non-zero exit before any rank starts; the launcher's
preflight checks the ranks' own arguments with NGPU from --nproc_per_node.
Ctrl-C on the launcher
(every rank gone within 5 s, exit code 130, no process left) is checked where
test_correctness.py interrupts a checkpointing run; here, a rank ends on
Ctrl-C within the grace second plus 3 s both where library code swallows the
``KeyboardInterrupt`` and where its main thread is held in native code. A rank that crashes
mid-run stops the others within 30 s, and its error is the first printed. A
rank killed by a signal (SIGABRT) is named with the signal in words and its
last lines of output, though ``LOG_RANK`` hid them.
COMM_MODE=fake_backend is torchtitan's one-process dry run of the NGPU-rank
layout (one step, exit 0); an unknown COMM_MODE is refused with the accepted
values, exit 2.

Tier: the three training launches are e2e: the refused mode in ``make test``
(the error matrix), the crashing rank (23 s on the 2-core machine) and the
dry run (29 s) in ``make test-slow``.
Run: .venv/bin/python -m pytest tests/test_launcher.py -q
"""

import sys
import time

import pytest

from conftest import FAST


@pytest.mark.e2e
def test_non_jit_mode_fails_fast_through_the_launcher(run, dump_folder):
    start = time.monotonic()
    result = run(["--compile.mode", "aot_fx_trace", *FAST], dump_folder=dump_folder,
                 preflight=True)
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    text = " ".join(result.output.replace("\u2502", " ").split())  # tyro box edges
    assert text.count("jit is the only supported compile mode for SimpleFSDP") == 1
    assert "torch.distributed.run" not in text and "Training starts" not in text
    assert elapsed < 60


def test_preflight_checks_the_ranks_training_arguments():
    import sys

    from torchtitan_neuron.launch import preflight_command

    train = ["--module", "M", "--config", "C", "--training.steps", "3"]
    for ranks in (["--nproc_per_node=4"], ["--nproc-per-node", "4"]):
        cmd = preflight_command([*ranks, "--tee", "3", "-m", "torchtitan_neuron.train", *train])
        assert cmd == [sys.executable, "-m", "torchtitan_neuron.preflight", "--ngpu", "4", *train]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_crashing_rank_stops_the_others_and_is_named_first(tmp_path):
    """Rank 1 raises at step 3 while rank 0 goes into the step's collectives:
    rank 0 is stopped within 30 s, nothing is left running, and the first
    error printed is rank 1's, with where it was raised."""
    import os

    from runlog import run_command, torchrun

    cmd = torchrun("tests/helpers/train_crashing_rank.py",
                   [*FAST, "--training.steps", "10", f"--dump_folder={tmp_path}"],
                   launcher="torchtitan_neuron.launch")
    result = run_command(cmd, dict(os.environ, CRASH_RANK="1", CRASH_AT_STEP="3"),
                         watch="step:  2", timeout=600)
    output = result.output
    assert result.returncode == 1, output[-3000:]
    assert result.since_marker_s < 30, f"took {result.since_marker_s:.1f}s after step 2"
    assert not result.left, result.left
    errors = [l for l in output.splitlines() if "Error" in l or "failed first" in l]
    assert "rank 1 failed first: RuntimeError: injected failure on rank 1 at step 3" in errors[0]
    assert "train_crashing_rank.py:" in errors[0]


@pytest.mark.e2e
def test_a_rank_ended_by_a_signal_is_named_with_its_last_lines(tmp_path):
    """Rank 1 (hidden by --local-ranks-filter 0) aborts: the launcher names
    SIGABRT in words and prints rank 1's last lines, stderr and stdout, and
    where every rank's output is kept."""
    import os

    from runlog import run_command

    cmd = [sys.executable, "-m", "torchtitan_neuron.launch", "--nproc_per_node=2",
           "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
           "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
           "--log-dir", str(tmp_path), "tests/helpers/abort_rank.py"]
    result = run_command(cmd, dict(os.environ, ABORT_RANK="1"), timeout=120)
    output = result.output
    assert result.returncode == 1, output[-3000:]
    assert not result.left, result.left
    assert ("rank 1 (local rank 1, PID " in output and "was ended by SIGABRT: the process "
            "aborted, usually a failed check or heap corruption inside the C++ runtime"
            in output), output[-3000:]
    assert f"Every rank's output: {tmp_path}" in output
    # Rank 1's last 30 lines of each stream, though its output was filtered.
    assert "rank 1 err 39" in output and "rank 1 line 39" in output
    assert "rank 1 err 10" in output and "rank 1 err 9\n" not in output


def test_signal_words_name_the_usual_cause():
    from torchtitan_neuron.launch import signal_words

    assert signal_words("SIGKILL").startswith("SIGKILL: killed from outside")
    assert "out-of-memory killer" in signal_words("SIGKILL")
    assert signal_words("SIGUSR2") == "SIGUSR2"


@pytest.mark.e2e
@pytest.mark.slow
def test_fake_backend_dry_run_simulates_the_ranks_in_one_process(run, dump_folder):
    result = run(FAST, ngpu=4, env={"COMM_MODE": "fake_backend"},
                 dump_folder=dump_folder, preflight=True)
    assert result.returncode == 0, result.output[-3000:]
    assert "COMM_MODE=fake_backend, one process simulating 4 ranks" in result.output
    # The layout is the 4-rank one: local batch 2 x 4 data-parallel ranks.
    assert "global batch size 8" in result.output
    assert [s.step for s in result.steps] == [1]
    assert "torch.distributed.run" not in result.output


def test_unknown_comm_mode_is_refused_with_the_accepted_values(run):
    result = run(FAST, env={"COMM_MODE": "fake"})
    assert result.returncode == 2
    assert "COMM_MODE=fake is not a mode of this launcher" in result.output
    assert "plan, rehearse, fake_backend or local_tensor" in result.output
    assert "Training starts" not in result.output


@pytest.mark.parametrize("held", ["swallow", "native"])
def test_ctrl_c_ends_a_rank_whatever_its_main_thread_is_doing(held):
    # A KeyboardInterrupt that library code catches and drops, or a main
    # thread held in native code, must not keep a rank alive after Ctrl-C.
    import os
    import signal
    import subprocess

    from torchtitan_neuron.train import INTERRUPT_GRACE_S, INTERRUPTED_MESSAGE

    proc = subprocess.Popen([sys.executable, "tests/helpers/interrupted_rank.py", held],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    output = proc.stdout.read()
    assert code == 130, output
    assert INTERRUPTED_MESSAGE in output
    assert took < INTERRUPT_GRACE_S + 3, f"{held}: {took:.1f}s to stop"
    # Held in native code, the watcher thread ends it; otherwise the handler.
    assert ("ended by the interrupt watcher" in output) == (held == "native"), output
