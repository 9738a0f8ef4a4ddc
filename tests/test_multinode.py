"""Several nodes on torchrun's c10d rendezvous, rehearsed on one machine.

Proves: two launchers on localhost (``NNODES=2``, one rank each, the same
``RDZV_ENDPOINT``) train the SimpleFSDP Llama recipe together with the same
per-step losses as one launcher's 2-rank run; both write to one dump folder
(a checkpoint every rank contributes to, complete), and each node's rank log
is a file under its ``LOG_DIR``; a launcher whose peer never arrives stops
after ``RDZV_TIMEOUT`` with a message naming the endpoint, instead of
waiting; ``NNODES=2`` with no endpoint is refused before anything starts.

Tier: e2e; the two-launcher run in ``make test-slow``, the refusals in
``make test`` (the error matrix).
Run: .venv/bin/python -m pytest tests/test_multinode.py -q
"""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import FAST, run_train
from runlog import free_port, strip_ansi

pytestmark = pytest.mark.e2e
STEPS = ["--training.steps", "3", *FAST]


@pytest.mark.slow
def test_two_launchers_train_like_one_and_share_outputs(tmp_path):
    dump = tmp_path / "shared"
    endpoint = f"localhost:{free_port()}"
    args = [*STEPS, f"--dump_folder={dump}", "--checkpoint.enable",
            "--checkpoint.interval", "3"]

    def node(n: int):
        return run_train(args, ngpu=1, timeout=900, env={
            "NNODES": "2", "NODE_RANK": str(n), "RDZV_ENDPOINT": endpoint, "RDZV_ID": "test",
            "LOG_DIR": str(tmp_path / "logs" / f"node{n}"), "RDZV_TIMEOUT": "300"})

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(node, (0, 1)))
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
        assert "step:  3" in strip_ansi(logs[0].read_text())


def test_a_missing_peer_times_out_with_a_clear_message(tmp_path):
    endpoint = f"localhost:{free_port()}"
    result = run_train(STEPS, ngpu=1, dump_folder=tmp_path / "out", timeout=300, env={
        "NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": endpoint, "RDZV_TIMEOUT": "10",
        "LOG_DIR": str(tmp_path / "logs")})
    output = result.output
    assert result.returncode == 1, output[-4000:]
    assert re.search(r"NNODES=2, but not every node joined the rendezvous at "
                     rf"{endpoint} \(id torchtitan_neuron\) within 10 s", output), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert result.wall_s < 120, result.wall_s


def test_nnodes_without_an_endpoint_is_refused():
    # run_train.sh reads an empty variable as unset.
    unset = {k: "" for k in ("RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT")}
    result = run_train(STEPS, ngpu=1, timeout=60, env={"NNODES": "2", **unset})
    assert result.returncode == 2
    assert ("NNODES=2 needs the rendezvous endpoint: set RDZV_ENDPOINT=host:port"
            in result.output)
