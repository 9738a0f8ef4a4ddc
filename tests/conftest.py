"""Shared helpers: launch real multi-process runs and read their step lines."""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LLAMA_MODULE = "torchtitan_neuron.experiments.graph_trainer.llama3"

# Small, fast settings for CPU runs in tests: aot_eager compiles in seconds
# where inductor's C++ codegen takes about a minute cold.
FAST = [
    "--dataloader.dataset", "c4_test",
    "--hf_assets_path=./tests/assets/tokenizer",
    "--compile.backend", "aot_eager",
    "--training.seq_len", "256",
    "--training.local_batch_size", "2",
    "--metrics.log_freq", "1",
    "--debug.seed", "0",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+)\s+memory:\s+([\d.]+)GiB"
)


@dataclass
class StepLine:
    step: int
    loss: float
    grad_norm: float
    memory_gib: float


@dataclass
class RunResult:
    returncode: int
    output: str

    @property
    def steps(self) -> list[StepLine]:
        return [
            StepLine(int(m[1]), float(m[2]), float(m[3]), float(m[4]))
            for m in _STEP.finditer(self.output)
        ]


def run_train(
    args: list[str],
    *,
    ngpu: int = 2,
    config: str = "simple_fsdp_llama3_debugmodel",
    module: str = LLAMA_MODULE,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    dump_folder: Path | None = None,
    preflight: bool = False,
) -> RunResult:
    """Run ./run_train.sh as a user would; rank 0's output is returned.

    The one-process config check (8 s of CPU a launch) runs only where a test
    asks for it (``preflight=True``): the tests of the checks themselves and
    the default rehearsal. Every other launch here is a config already checked.
    """
    full_env = dict(os.environ)
    full_env.update(
        NGPU=str(ngpu), MODULE=module, CONFIG=config, PYTHON=sys.executable,
        PREFLIGHT="1" if preflight else "0",
    )
    full_env.update(env or {})
    extra = [f"--dump_folder={dump_folder}"] if dump_folder else []
    proc = subprocess.run(
        ["./run_train.sh", *extra, *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return RunResult(proc.returncode, _ANSI.sub("", proc.stdout))


@pytest.fixture
def dump_folder(tmp_path):
    return tmp_path / "outputs"


@pytest.fixture
def run():
    return run_train


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
