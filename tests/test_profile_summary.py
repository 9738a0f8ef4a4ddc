"""scripts/profile_summary.py on a trace torch's profiler writes.

Proves: from a real chrome trace (torch.profiler with a schedule, as
torchtitan runs it), the summary finds the last ProfilerStep# span, sums self
time (nested ops subtracted, so aten::mm is not counted again under
aten::matmul) per group, counts calls per op, and says what to pass when the
trace has no step span or does not exist.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_profile_summary.py -q
"""

import gzip
import json
import subprocess
import sys

import pytest
import torch

import profile_summary  # scripts/, on sys.path through conftest


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "rank0_trace.json"
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(2):
            for _ in range(5):
                c = torch.matmul(a, b)
            torch.cat([c, c])
            prof.step()
    return path


def test_self_time_per_group_inside_the_step(trace):
    events = profile_summary.load(trace)
    step, groups, per_op = profile_summary.self_times(events)
    assert per_op["aten::mm"][1] == 5          # the active step's five, not the warmup's
    assert per_op["aten::cat"][1] == 1
    assert groups["matmul"] > 0 and groups["copy"] > 0
    # Self times: matmul's own time excludes the aten::mm nested in it, so the
    # groups never add up to more than the step.
    assert per_op["aten::matmul"][0] < per_op["aten::mm"][0]
    assert sum(groups.values()) <= step + 1e-6


def test_reads_gzip_and_prints_the_groups(trace, tmp_path):
    gz = tmp_path / "rank0_trace.json.gz"
    gz.write_bytes(gzip.compress(trace.read_bytes()))
    out = subprocess.run([sys.executable, profile_summary.__file__, str(gz), "--top", "3"],
                         capture_output=True, text=True, check=True).stdout
    assert "step " in out and "matmul" in out and "aten::mm" in out


def test_clear_errors(tmp_path):
    missing = subprocess.run([sys.executable, profile_summary.__file__, str(tmp_path / "x.json")],
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "no such trace" in missing.stderr
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    out = subprocess.run([sys.executable, profile_summary.__file__, str(empty)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "no ProfilerStep#" in out.stderr
