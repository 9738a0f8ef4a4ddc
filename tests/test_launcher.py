"""run_train.sh behaves like upstream's launcher, and fails and stops cleanly.

Proves: a refused setting (``--compile.mode aot_fx_trace``) is reported once,
clearly, with a non-zero exit before any rank starts. Ctrl-C on the launcher
(every rank gone within 5 s, exit code 130, no process left) is checked where
test_correctness.py interrupts a checkpointing run.

Run: .venv/bin/python -m pytest tests/test_launcher.py -q
"""

import time

from conftest import FAST


def test_non_jit_mode_fails_fast_through_the_launcher(run, dump_folder):
    start = time.monotonic()
    result = run(["--compile.mode", "aot_fx_trace", *FAST], dump_folder=dump_folder)
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    text = " ".join(result.output.replace("\u2502", " ").split())  # tyro box edges
    assert text.count("jit is the only supported compile mode for SimpleFSDP") == 1
    assert "torch.distributed.run" not in text and "Training starts" not in text
    assert elapsed < 60
