"""Where one profiled step spends its time: self time per group of ops.

    .venv/bin/python scripts/profile_summary.py TRACE [TRACE ...] [--top 12]

TRACE is a rank's trace from torch's profiler, as torchtitan writes it with
``--profiler.enable_profiling`` (``<dump>/profiling/traces/iteration_N/rank0_trace.json.gz``).
For each trace it prints the profiled step's length (the ``ProfilerStep#N``
span) and the self time (a span less the spans nested in it on the same
thread) of the CPU ops of that thread, summed per group: matmuls, attention,
waiting on collectives, issuing collectives, copies, and the rest; then the
largest single ops. Only the thread that runs the step is counted: gloo's own
threads, which move the bytes, do not appear in the trace.
"""

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

GROUPS = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                "aten::linear", "mkldnn")),
    ("attention", ("flash", "attention")),
    ("collective wait", ("wait_tensor", "c10d::wait")),
    ("collective issue", ("all_gather", "reduce_scatter", "allgather",
                          "all_reduce", "allreduce")),
    ("copy", ("aten::copy_", "aten::clone", "aten::cat", "aten::_to_copy")),
]


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, keys in GROUPS:
        if any(k.lower() in lowered for k in keys):
            return group
    return "other"


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def self_times(events: list[dict]) -> tuple[float, dict[str, float], dict[str, list[float]]]:
    """(step seconds, self seconds per group, self seconds and calls per op)
    on the thread that holds the ``ProfilerStep#`` span."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in spans if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise SystemExit("no ProfilerStep# span in the trace: was it written by "
                         "torch's profiler with --profiler.enable_profiling?")
    step = steps[-1]
    start, end = step["ts"], step["ts"] + step["dur"]
    ops = sorted((e for e in spans if (e["pid"], e["tid"]) == (step["pid"], step["tid"])
                  and e.get("cat") == "cpu_op" and start <= e["ts"] < end),
                 key=lambda e: (e["ts"], -e["dur"]))
    own = [float(e["dur"]) for e in ops]
    stack: list[int] = []
    for i, e in enumerate(ops):
        while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= e["dur"]
        stack.append(i)
    groups: dict[str, float] = defaultdict(float)
    per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e, t in zip(ops, own):
        groups[group_of(e["name"])] += t / 1e6
        per_op[e["name"]][0] += t / 1e6
        per_op[e["name"]][1] += 1
    return step["dur"] / 1e6, dict(groups), dict(per_op)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12)
    opts = parser.parse_args()
    for path in opts.traces:
        if not path.exists():
            raise SystemExit(f"{path}: no such trace; pass a rank's trace file, e.g. "
                             "<dump>/profiling/traces/iteration_6/rank0_trace.json.gz")
        step, groups, per_op = self_times(load(path))
        print(f"{path}: step {step:.3f} s")
        for group, _ in [*GROUPS, ("other", ())]:
            t = groups.get(group, 0.0)
            print(f"  {group:<17} {t:7.3f} s  {100 * t / step:5.1f}%")
        print(f"  {'not in an op':<17} {step - sum(groups.values()):7.3f} s")
        for name, (t, calls) in sorted(per_op.items(), key=lambda kv: -kv[1][0])[:opts.top]:
            print(f"    {t:7.3f} s  {int(calls):5d} calls  {name}")


if __name__ == "__main__":
    main()
