"""run_train.sh behaves like upstream's launcher, and fails and stops cleanly.

Proves: a refused setting (``--compile.mode aot_fx_trace``) is reported once,
clearly, with a non-zero exit before any rank starts; Ctrl-C (SIGINT to the
launcher's process group) stops every rank within seconds with a non-zero
exit and leaves no process behind.

Run: .venv/bin/python -m pytest tests/test_launcher.py -q
"""

import os
import signal
import subprocess
import sys
import time

from conftest import FAST, LLAMA_MODULE, REPO


def test_non_jit_mode_fails_fast_through_the_launcher(run, dump_folder):
    start = time.monotonic()
    result = run(["--compile.mode", "aot_fx_trace", *FAST], dump_folder=dump_folder)
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    text = " ".join(result.output.replace("\u2502", " ").split())  # tyro box edges
    assert text.count("jit is the only supported compile mode for SimpleFSDP") == 1
    assert "torch.distributed.run" not in text and "Training starts" not in text
    assert elapsed < 60


def _descendants(root: int) -> set[int]:
    ps = subprocess.run(["ps", "-eo", "pid=,ppid="], stdout=subprocess.PIPE, text=True)
    children: dict[int, list[int]] = {}
    for line in ps.stdout.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.add(pid)
        except ProcessLookupError:
            pass
    return alive


def test_ctrl_c_stops_every_rank(tmp_path):
    env = dict(os.environ, NGPU="2", MODULE=LLAMA_MODULE,
               CONFIG="simple_fsdp_llama3_debugmodel", PYTHON=sys.executable)
    proc = subprocess.Popen(
        ["./run_train.sh", f"--dump_folder={tmp_path}", "--training.steps", "1000", *FAST],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    seen, ranks = [], set()
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            seen.append(line)
            if "step:  2" in line or time.monotonic() > deadline:
                break
        assert any("step:  2" in line for line in seen), "".join(seen)[-3000:]
        ranks = _descendants(proc.pid)
        assert len(ranks) >= 2, ranks  # torchrun's two workers

        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        # torchrun starts its workers in their own sessions: clean up both.
        for pid in _alive(ranks | _descendants(proc.pid)):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert elapsed < 5, f"ranks took {elapsed:.1f}s to stop"
    time.sleep(0.5)
    assert _alive(ranks) == set()
