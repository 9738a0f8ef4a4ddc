"""Launch ``./run_train.sh`` as a user would and read rank 0's log.

The helpers the benchmarks share: one launch (``launch``), its step lines
with their log timestamps (``Run.steps``), and the times between log markers
(``Run.stamp``).
"""

import datetime
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)")
_STEP = re.compile(
    r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) .*?step:\s+(\d+)\s+loss:\s+(\S+)\s+"
    r"grad_norm:\s+(\S+)\s+memory:\s+([\d.]+)GiB.*?tps:\s+([\d,]+)\s+"
    r"tflops:\s+(\S+)\s+mfu:\s+([\d.]+)%"
)


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f")


@dataclass
class Step:
    step: int
    time: datetime.datetime
    loss: float
    memory_gib: float
    tps: float
    mfu_pct: float


@dataclass
class Run:
    returncode: int
    output: str
    wall_s: float
    steps: list[Step] = field(init=False)

    def __post_init__(self):
        self.steps = [
            Step(int(m[2]), parse_time(m[1]), float(m[3]), float(m[5]),
                 float(m[6].replace(",", "")), float(m[8]))
            for m in _STEP.finditer(self.output)
        ]

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
        by_step = {s.step: s.time for s in self.steps}
        return [(by_step[n] - by_step[n - 1]).total_seconds()
                for n in sorted(by_step) if n >= first and n - 1 in by_step]

    def median(self, attribute: str, first: int) -> float:
        return statistics.median(getattr(s, attribute) for s in self.steps if s.step >= first)

    def tail(self, chars: int = 3000) -> str:
        return self.output[-chars:]


def launch(module: str, config: str, ngpu: int, args: list[str],
           env: dict[str, str] | None = None, timeout: float | None = None) -> Run:
    """``NGPU=ngpu MODULE=module CONFIG=config ./run_train.sh *args``."""
    full_env = dict(os.environ, NGPU=str(ngpu), MODULE=module, CONFIG=config,
                    PYTHON=os.environ.get("PYTHON", sys.executable))
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.run(["./run_train.sh", *args], cwd=REPO, env=full_env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return Run(proc.returncode, ANSI.sub("", proc.stdout), time.monotonic() - start)
