#!/usr/bin/env python3
"""The planner's answers on the cells of docs/plan_accuracy.md and the
tutorial's four Llama 8B cells (docs/planner.md), one JSON line each: the
check that a change to the code leaves every plan as it was.

    python scripts/plan_cells.py > plans.jsonl
    python scripts/plan_cells.py --compare before.jsonl after.jsonl

``--compare`` prints each cell whose peak or breakdown differs at four
decimals (exit 1 if any).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_plan import cell_flags, cells  # noqa: E402
from runlog import run_command  # noqa: E402

LLAMA3 = "torchtitan_neuron.experiments.graph_trainer.llama3"


def all_cells() -> list[tuple[str, str, int, str, list[str]]]:
    out = []
    for module, config, ngpu, ac, backend, seq, batch in cells(False, ["llama", "medium",
                                                                      "deepseek"]):
        flags = [*cell_flags(ngpu, backend, seq, batch), f"activation-checkpoint:{ac}",
                 "--target=cpu"]
        out.append((module, config, ngpu, ac, flags))
    for config, ac in (("simple_fsdp_llama3_8b", "selective"),
                       ("simple_fsdp_llama3_8b_fullac", "full")):
        for tp in (1, 4):
            out.append((LLAMA3, config, 64, f"{ac} tp{tp}",
                        ["--target", "trn2", "--training.global_batch_size", "64",
                         "--parallelism.data_parallel_shard_degree=-1",
                         f"--parallelism.tensor_parallel_degree={tp}"]))
    return out


def _rounded(obj):
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def compare(before: Path, after: Path) -> int:
    def load(path):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        return {row["cell"]: _rounded(row["plan"]) for row in rows}

    old, new = load(before), load(after)
    bad = [cell for cell in old.keys() | new.keys() if old.get(cell) != new.get(cell)]
    for cell in sorted(bad):
        print(f"differs: {cell}\n  before {old.get(cell)}\n  after  {new.get(cell)}")
    print(f"{len(old)} cells before, {len(new)} after, {len(bad)} differ at four decimals")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    opts = parser.parse_args()
    if opts.compare:
        return compare(*opts.compare)
    for module, config, ngpu, ac, flags in all_cells():
        result = run_command([sys.executable, "-m", "torchtitan_neuron.plan", "--module",
                              module, "--config", config, f"--ngpu={ngpu}", "--json",
                              *flags])
        planned = [line for line in result.output.splitlines() if line.startswith("{")]
        if result.returncode or not planned:
            raise SystemExit(f"plan failed for {config} {ngpu} {ac}:\n"
                             f"{result.output[-2000:]}")
        print(json.dumps({"cell": f"{config} ngpu={ngpu} {ac}",
                          "plan": json.loads(planned[-1])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
