"""The one launcher of tests, scripts and benchmarks (scripts/runlog.py).

Proves: step lines are read with or without the log time and the throughput
tail (a validation line is not a step); a watched marker records the
processes then running, ``then`` acts at it (Ctrl-C), a process started in
a session of its own (as torchrun starts ranks) is reported as left behind
and then killed; a launch past its timeout is killed whole and raises.

Tier: fast (each launch is a few-line Python or shell process).
Run: .venv/bin/python -m pytest tests/test_runlog.py -q
"""

import signal
import subprocess
import sys
import time

import pytest

from runlog import alive, ctrl_c, parse_steps, run_command

_LINES = """\
[rank0]:[titan] 2026-11-30 10:00:01,250 - root - INFO - step:  1  loss:  8.12345  \
grad_norm:  1.5000  memory:  0.42GiB(3.10%)  tps: 12,345  tflops: 1,234.50  mfu: N/A
[rank0]:step:  2  loss:  7.50000  grad_norm:  0.2500  memory:  0.43GiB(3.20%)
[rank0]:[titan] 2026-11-30 10:00:02,000 - root - INFO - validate step:  2  loss:  7.0000  \
memory:  0.43GiB(3.20%)  tps: 100
[rank0]:[titan] 2026-11-30 10:00:03,500 - root - INFO - step:  3  loss:  nan  \
grad_norm:  0.1250  memory:  0.44GiB(3.30%)  tps: 900  tflops: 0.02  mfu: 12.50%  grad_accum: 2
"""


def test_step_lines_with_and_without_time_and_throughput():
    steps = parse_steps(_LINES)
    assert [s.step for s in steps] == [1, 2, 3]
    assert (steps[0].loss, steps[0].grad_norm, steps[0].memory_gib) == (8.12345, 1.5, 0.42)
    assert (steps[0].tps, steps[0].tflops, steps[0].mfu_pct) == (12345, 1234.5, None)
    assert steps[0].time.second == 1 and steps[0].time.microsecond == 250000
    assert (steps[1].loss, steps[1].tps, steps[1].time) == (7.5, None, None)
    assert steps[2].loss != steps[2].loss and steps[2].mfu_pct == 12.5  # nan
    assert steps[2].tps == 900 and steps[2].time.second == 3


# A shell that runs the tests in the background starts them with SIGINT
# ignored, which every child inherits, and Python then installs no
# KeyboardInterrupt handler: the stand-in launcher restores it, as torchrun
# does by installing its own handler.
_SPAWNS_OWN_SESSION = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                         start_new_session=True)
print("\\x1b[31mready\\x1b[39m", child.pid, flush=True)
time.sleep(300)
"""


def test_marker_ctrl_c_and_a_process_left_behind():
    start = time.monotonic()
    run = run_command([sys.executable, "-c", _SPAWNS_OWN_SESSION], watch="ready",
                      then=ctrl_c, timeout=120)
    child = int(run.output.split()[1])
    assert run.output.startswith("ready ")  # colours stripped
    # Python re-raises an uncaught SIGINT on exit.
    assert run.returncode == -signal.SIGINT and "KeyboardInterrupt" in run.output, run.output
    assert child in run.ranks and run.left == {child}
    assert 0 <= run.since_marker_s < 30 and run.wall_s < time.monotonic() - start + 1
    assert not alive({child})  # killed once the launch was over


def test_timeout_kills_the_whole_launch():
    script = "sleep 300 & echo $!; wait"
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_command(["bash", "-c", script], timeout=2)
    sleeper = int(info.value.output.split()[0])
    assert not alive({sleeper})
