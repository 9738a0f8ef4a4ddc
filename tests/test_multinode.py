"""Several nodes on torchrun's c10d rendezvous, rehearsed on one machine.

Proves: two launchers on localhost (``NNODES=2``, one rank each, the same
``RDZV_ENDPOINT``) train the SimpleFSDP Llama recipe together with the same
per-step losses as one launcher's 2-rank run; both write to one dump folder
(a checkpoint every rank contributes to, complete), and each node's rank log
is a file under its ``LOG_DIR``; a launcher whose peer never arrives stops
after ``RDZV_TIMEOUT`` with a message naming the endpoint, instead of
waiting; ``NNODES=2`` with no endpoint is refused before anything starts.

Run: .venv/bin/python -m pytest tests/test_multinode.py -q
"""

import os
import re
import socket
import subprocess
import sys
import time

from conftest import FAST, LLAMA_MODULE, REPO, RunResult, _ANSI, run_train

STEPS = ["--training.steps", "3", *FAST]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(env: dict[str, str], args: list[str]) -> subprocess.Popen:
    full_env = dict(os.environ, MODULE=LLAMA_MODULE, CONFIG="simple_fsdp_llama3_debugmodel",
                    PYTHON=sys.executable, PREFLIGHT="0", **env)
    return subprocess.Popen(["./run_train.sh", *args], cwd=REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_two_launchers_train_like_one_and_share_outputs(tmp_path):
    dump = tmp_path / "shared"
    endpoint = f"localhost:{_free_port()}"
    args = [*STEPS, f"--dump_folder={dump}", "--checkpoint.enable",
            "--checkpoint.interval", "3"]
    nodes = [
        _launch({"NGPU": "1", "NNODES": "2", "NODE_RANK": str(n), "RDZV_ENDPOINT": endpoint,
                 "RDZV_ID": "test", "LOG_DIR": str(tmp_path / "logs" / f"node{n}"),
                 "RDZV_TIMEOUT": "300"}, args)
        for n in (0, 1)
    ]
    outputs = [p.communicate(timeout=900)[0] for p in nodes]
    results = [RunResult(p.returncode, _ANSI.sub("", o)) for p, o in zip(nodes, outputs)]
    for result in results:
        assert result.returncode == 0, result.output[-4000:]
        assert "node " in result.output and "of 2, 1 ranks, rendezvous at" in result.output
        assert "dp_shard=2" in result.output
    # Every rank logs the global loss: both nodes print the same steps.
    assert [s.loss for s in results[0].steps] == [s.loss for s in results[1].steps]

    # The default rehearsal as a user launches it, config check included.
    single = run_train(STEPS, ngpu=2, dump_folder=tmp_path / "single", preflight=True)
    assert single.returncode == 0, single.output[-4000:]
    multi = results[0].steps
    assert [s.step for s in multi] == [1, 2, 3]
    for mine, ref in zip(multi, single.steps):
        assert abs(mine.loss - ref.loss) <= 1e-5 * abs(ref.loss), (multi, single.steps)

    # One checkpoint in the shared folder, with both ranks' shards.
    step3 = dump / "checkpoint" / "step-3"
    assert (step3 / ".metadata").is_file(), sorted(dump.rglob("*"))[:20]
    assert len(list(step3.glob("__*_0.distcp"))) == 2, sorted(step3.iterdir())
    assert not list((dump / "checkpoint").glob(".partial-*"))
    # Each node's rank log is a file under its LOG_DIR.
    for n in (0, 1):
        logs = list((tmp_path / "logs" / f"node{n}").rglob("stdout.log"))
        assert len(logs) == 1, logs
        assert "step:  3" in _ANSI.sub("", logs[0].read_text())


def test_a_missing_peer_times_out_with_a_clear_message(tmp_path):
    endpoint = f"localhost:{_free_port()}"
    start = time.monotonic()
    proc = _launch({"NGPU": "1", "NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": endpoint,
                    "RDZV_TIMEOUT": "10", "LOG_DIR": str(tmp_path / "logs")},
                   [*STEPS, f"--dump_folder={tmp_path / 'out'}"])
    output = _ANSI.sub("", proc.communicate(timeout=300)[0])
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, output[-4000:]
    assert re.search(r"NNODES=2, but not every node joined the rendezvous at "
                     rf"{endpoint} \(id torchtitan_neuron\) within 10 s", output), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert elapsed < 120, elapsed


def test_nnodes_without_an_endpoint_is_refused():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(["./run_train.sh", *STEPS], cwd=REPO, timeout=60,
                          env=dict(env, NNODES="2", NGPU="1", PYTHON=sys.executable),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 2
    assert "NNODES=2 needs the rendezvous endpoint: set RDZV_ENDPOINT=host:port" in proc.stdout
