"""Launch ``./run_train.sh`` as a user would and read rank 0's log.

The one launcher the tests, the scripts and the benchmarks share:

- ``launch(args, ngpu=, module=, config=, env=)``: ``NGPU MODULE CONFIG
  ./run_train.sh *args``; ``run_command(cmd, env)`` for any other command
  (torchrun with a test helper, the download script);
- ``watch=<text>``: note the moment that text is first printed and the ranks
  then running, and ``then(proc)`` at that moment (``ctrl_c`` presses Ctrl-C);
- the result, ``Run``: exit code, output without colours, its step lines
  (``Run.steps``: step, loss, grad_norm, memory, and tps, tflops, mfu and the
  log time where the line has them), the times between log markers, and the
  ranks still alive when the launcher exited (``Run.left``);
- nothing outlives a launch: the launcher runs in its own session and its
  process group is killed at the end, and so are the ranks, which torchrun
  starts in sessions of their own.

Lives in ``scripts/`` because ``run_train.sh`` lives in the checkout, not in
the wheel; ``tests/conftest.py`` puts this folder on ``sys.path``.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
LLAMA_MODULE = "torchtitan_neuron.experiments.graph_trainer.llama3"
DEBUG_CONFIG = "simple_fsdp_llama3_debugmodel"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TIME = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)"
_STAMP = re.compile(_TIME)
# torchtitan's step line: "step: N  loss: X  grad_norm: Y  memory: Z GiB(P%)
# tps: T  tflops: F  mfu: M%", after the log time; "validate step:" lines
# have no grad_norm and do not match.
_STEP = re.compile(
    rf"^(?:[^\n]*?{_TIME} )?[^\n]*?step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+)\s+"
    r"memory:\s+([\d.]+)GiB(?:[^\n]*?tps:\s+([\d,]+)\s+tflops:\s+([\d,.]+)\s+"
    r"mfu:\s+([\d.]+%|N/A))?",
    re.MULTILINE,
)


def precise_losses(dump_folder) -> dict[int, float]:
    """Each step's loss at full precision, from the run's summary
    (``<dump folder>/run_summary.json``, written by rank 0 at the end of a
    run; the step line prints 5 decimals). Empty when there is none."""
    import json

    path = Path(dump_folder) / "run_summary.json"
    if not path.exists():
        return {}
    return {row["step"]: row["loss"] for row in json.loads(path.read_text())["steps"]
            if row.get("loss") is not None}


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f")


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Step:
    step: int
    loss: float
    grad_norm: float
    memory_gib: float
    tps: float | None = None
    tflops: float | None = None
    mfu_pct: float | None = None
    time: datetime.datetime | None = None


def parse_steps(output: str) -> list[Step]:
    """Every training step line of ``output`` (colours already stripped)."""
    steps = []
    for m in _STEP.finditer(output):
        tps, tflops, mfu = m[6], m[7], m[8]
        steps.append(Step(
            int(m[2]), float(m[3]), float(m[4]), float(m[5]),
            float(tps.replace(",", "")) if tps else None,
            float(tflops.replace(",", "")) if tflops else None,
            float(mfu[:-1]) if mfu and mfu != "N/A" else None,
            parse_time(m[1]) if m[1] else None,
        ))
    return steps


@dataclass
class Run:
    """One finished command: its exit code and output (colours stripped)."""

    returncode: int
    output: str
    wall_s: float = float("nan")
    # With ``watch``: seconds from the marker to the launcher's exit (nan when
    # the marker never came), the ranks running at the marker, and those of
    # them still alive when the launcher had exited.
    since_marker_s: float | None = None
    ranks: set[int] = field(default_factory=set)
    left: set[int] = field(default_factory=set)

    @cached_property
    def steps(self) -> list[Step]:
        return parse_steps(self.output)

    def stamp(self, marker: str) -> datetime.datetime:
        """The log time of the first line containing ``marker``."""
        for line in self.output.splitlines():
            if marker in line:
                match = _STAMP.search(line)
                if match:
                    return parse_time(match[1])
        raise LookupError(f"no '{marker}' line in the run's output")

    def first_step_s(self) -> float:
        """From "Training starts" to the step-1 line: compilation included."""
        return (self.steps[0].time - self.stamp("Training starts")).total_seconds()

    def step_times(self, first: int) -> list[float]:
        """Seconds between consecutive step lines, for steps ``first``.. on."""
        by_step = {s.step: s.time for s in self.steps if s.time}
        return [(by_step[n] - by_step[n - 1]).total_seconds()
                for n in sorted(by_step) if n >= first and n - 1 in by_step]

    def median(self, attribute: str, first: int) -> float:
        return statistics.median(getattr(s, attribute) for s in self.steps if s.step >= first)

    def tail(self, chars: int = 3000) -> str:
        return self.output[-chars:]


def descendants(root: int) -> set[int]:
    """Every process below ``root`` now (torchrun's ranks have sessions of
    their own, so the launcher's process group does not reach them)."""
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


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie, dead but not yet reaped by
    whoever adopted it, is not)."""
    left = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.add(pid)
        except ProcessLookupError:
            pass
        except FileNotFoundError:  # gone in between, or no /proc
            if not Path("/proc/self").exists():
                left.add(pid)
    return left


def ctrl_c(proc: subprocess.Popen) -> None:
    """What Ctrl-C in a terminal sends: SIGINT to the launcher's process group."""
    os.killpg(proc.pid, signal.SIGINT)


def _stop(proc: subprocess.Popen, ranks: set[int]) -> None:
    """Kill whatever is left of a launch, its ranks and its process group,
    and wait (up to 10 s) until they are gone."""
    left = alive(ranks | descendants(proc.pid))
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
    deadline = time.monotonic() + 10
    while alive(left) and time.monotonic() < deadline:
        time.sleep(0.05)


def run_command(cmd: list[str], env: dict[str, str] | None = None, *,
                timeout: float | None = None, watch: str | None = None,
                then: Callable[[subprocess.Popen], None] | None = None,
                log: Path | None = None) -> Run:
    """Run ``cmd`` in the checkout, stdout and stderr together, and stop it
    and everything it started once it has exited. ``watch``/``then``: see the
    module docstring. ``log``: also write the output there. Past ``timeout``
    seconds the whole launch is killed and ``subprocess.TimeoutExpired`` raised."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    ranks: set[int] = set()
    marked: list[float] = []

    def read():
        # A thread, so that the launch ends when the launcher exits, even
        # where a process left behind still holds the pipe open.
        for line in proc.stdout:
            lines.append(line)
            if watch and not marked and watch in line:
                ranks.update(descendants(proc.pid))
                marked.append(time.monotonic())
                if then:
                    then(proc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc, ranks)
        reader.join()
        raise subprocess.TimeoutExpired(cmd, timeout, strip_ansi("".join(lines))) from None
    end = time.monotonic()
    left = alive(ranks)
    _stop(proc, ranks)
    reader.join()
    output = strip_ansi("".join(lines))
    if log:
        log.write_text(output)
    since = None if watch is None else (end - marked[0] if marked else float("nan"))
    return Run(proc.returncode, output, end - start, since, ranks, left)


def train_env(ngpu: int = 2, module: str = LLAMA_MODULE, config: str = DEBUG_CONFIG,
              preflight: bool | None = None, env: dict[str, str] | None = None
              ) -> dict[str, str]:
    """The environment of ``NGPU MODULE CONFIG ./run_train.sh``: this Python
    unless PYTHON names another; PREFLIGHT as given (None: as set outside)."""
    full = dict(os.environ, NGPU=str(ngpu), MODULE=module, CONFIG=config,
                PYTHON=os.environ.get("PYTHON", sys.executable))
    if preflight is not None:
        full["PREFLIGHT"] = "1" if preflight else "0"
    full.update(env or {})
    return full


def launch(args: list[str], *, ngpu: int = 2, module: str = LLAMA_MODULE,
           config: str = DEBUG_CONFIG, env: dict[str, str] | None = None,
           preflight: bool | None = None, dump_folder: Path | None = None,
           **options) -> Run:
    """``NGPU=ngpu MODULE=module CONFIG=config ./run_train.sh *args``;
    ``options`` are ``run_command``'s (timeout, watch, then, log)."""
    extra = [f"--dump_folder={dump_folder}"] if dump_folder else []
    return run_command(["./run_train.sh", *extra, *args],
               train_env(ngpu, module, config, preflight, env), **options)


def torchrun(script: str, args: list[str], *, launcher: str = "torch.distributed.run",
             module: str = LLAMA_MODULE, config: str = DEBUG_CONFIG) -> list[str]:
    """The command run_train.sh runs for 2 local ranks, with ``script`` (a
    test helper that wraps the trainer) in place of torchtitan_neuron.train."""
    return [sys.executable, "-m", launcher, "--nproc_per_node=2",
            "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
            "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
            script, "--module", module, "--config", config, *args]
