"""First step with a cold and a warm compile cache, on `make train`'s run.

    .venv/bin/python scripts/bench_compile_cache.py [--steps 3] [overrides...]

Runs ``./run_train.sh`` (NGPU=2, the default SimpleFSDP recipe, bundled data,
the recipe's own compile backend: inductor on CPU) twice with one fresh
TORCHINDUCTOR_CACHE_DIR, and prints each run's first step (from "Training
starts" to the step-1 line, from rank 0's log timestamps), its second step,
and warm/cold. Takes about 3 minutes here.
"""

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)")


def _time(output: str, marker: str) -> datetime.datetime:
    for line in output.splitlines():
        if marker in line:
            match = _STAMP.search(line)
            if match:
                return datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")
    raise SystemExit(f"no '{marker}' line in the run's output:\n{output[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    opts, overrides = parser.parse_known_args()
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, NGPU="2",
                   PYTHON=os.environ.get("PYTHON", sys.executable))
        for run in ("cold", "warm"):
            proc = subprocess.run(
                ["./run_train.sh", "--training.steps", str(opts.steps),
                 "--dataloader.dataset", "c4_test", "--hf_assets_path=./tests/assets/tokenizer",
                 "--metrics.log_freq", "1", *overrides],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:])
                return 1
            start = _time(proc.stdout, "Training starts")
            one, two = _time(proc.stdout, "step:  1"), _time(proc.stdout, "step:  2")
            results[run] = ((one - start).total_seconds(), (two - one).total_seconds())
            print(f"{run}: first step {results[run][0]:.1f} s, second step "
                  f"{results[run][1]:.2f} s", flush=True)
    ratio = results["warm"][0] / results["cold"][0]
    print(f"warm/cold first step: {100 * ratio:.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
