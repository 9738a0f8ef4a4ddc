"""A run's loss and step time per step, drawn into one PNG (scripts/plot_run.py).

Proves: from a log written the way torchtitan writes it (ANSI colours, the
thousands separator in tps), the losses drawn are the log's and the step
times are the gaps between log stamps (the first from "Training starts", a
gap of several steps divided by them), in a two-panel PNG next to the log;
from a dump folder, run_summary.json gives both and wins over the structured
logs; from structured logs alone, rank 0's newest file gives the step time
only, said on stderr; a missing path, a folder with neither file, a log
without step lines, a broken summary and a missing matplotlib exit 2 with a
message naming the path and what was expected, never a traceback.

Tier: fast (one short Python process, which reads a missing path; nothing trains).
Run: .venv/bin/python -m pytest tests/test_plot_run.py -q
"""

import json
import struct
import subprocess
import sys

import pytest

import plot_run  # scripts/, on sys.path through conftest

# Rank 0's output of `./run_train.sh --training.steps 10` on 2 CPU ranks,
# cut to its first four steps, colours as printed.
_LOG = """\
W1201 09:03:33.238000 4205 .venv/lib/python3.11/site-packages/torch/distributed/run.py:982] *****
[rank0]:[titan] 2026-12-01 09:03:39,374 - root - INFO - Training starts at step 1
[rank0]:[titan] 2026-12-01 09:04:40,017 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.08471  \
\x1b[38;2;180;60;0mgrad_norm:  0.3912  \x1b[38;2;54;234;195mmemory:  1.14GiB(9.72%)  \x1b[34mtps: 34  \
\x1b[36mtflops: 0.00  \x1b[35mmfu: 0.67%\x1b[39m  grad_accum: 1
[rank0]:[titan] 2026-12-01 09:04:41,552 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  8.01200  \
\x1b[38;2;180;60;0mgrad_norm:  0.4472  \x1b[38;2;54;234;195mmemory:  1.18GiB(9.99%)  \x1b[34mtps: 1,334  \
\x1b[36mtflops: 0.06  \x1b[35mmfu: 26.77%\x1b[39m  grad_accum: 1
[rank0]:[titan] 2026-12-01 09:04:43,016 - root - INFO - \x1b[31mstep:  3  \x1b[32mloss:  7.92488  \
\x1b[38;2;180;60;0mgrad_norm:  0.4734  \x1b[38;2;54;234;195mmemory:  1.18GiB(9.99%)  \x1b[34mtps: 1,400  \
\x1b[36mtflops: 0.06  \x1b[35mmfu: 28.09%\x1b[39m  grad_accum: 1
[rank0]:[titan] 2026-12-01 09:04:44,589 - root - INFO - \x1b[31mstep:  4  \x1b[32mloss:  7.83992  \
\x1b[38;2;180;60;0mgrad_norm:  0.4663  \x1b[38;2;54;234;195mmemory:  1.18GiB(10.00%)  \x1b[34mtps: 1,303  \
\x1b[36mtflops: 0.06  \x1b[35mmfu: 26.14%\x1b[39m  grad_accum: 1
[rank0]:[titan] 2026-12-01 09:04:44,600 - root - INFO - Training completed
"""


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk's width and height


def test_a_log_file_gives_its_losses_and_stamp_gaps(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(_LOG)
    assert plot_run.main([str(log)]) == 0
    assert _png_size(tmp_path / "train.log.png")[0] == 800
    assert "wrote" in capsys.readouterr().out

    series = plot_run.read(log)
    assert series.name == "train.log"
    assert series.loss == {1: 8.08471, 2: 8.012, 3: 7.92488, 4: 7.83992}
    assert series.step_s == pytest.approx({1: 60.643, 2: 1.535, 3: 1.464, 4: 1.573})
    fig = plot_run.draw(series, tmp_path / "again.png")
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "step time (s)"]
    assert fig.axes[1].get_yscale() == "log"  # step 1 compiles: 40 times the others


def test_a_log_every_two_steps_gives_the_mean_over_each_gap(tmp_path):
    # --metrics.log_freq 2: lines for steps 2 and 4 only.
    lines = [line for line in _LOG.splitlines() if "step:  2" in line or "step:  4" in line]
    log = tmp_path / "freq2.log"
    log.write_text("\n".join(lines))
    series = plot_run.read(log)
    assert series.loss == {2: 8.012, 4: 7.83992}
    assert series.step_s == pytest.approx({4: (1.464 + 1.573) / 2})  # no start line: no step 2


def _structured(folder, name: str, step_ms: dict[int, float], tail: str = "") -> None:
    logs = folder / "structured_logs"
    logs.mkdir(parents=True, exist_ok=True)
    records = [{"log_type_name": "structured_logger_started", "rank": 0}]
    for step, ms in step_ms.items():
        records += [{"log_type_name": "step_start", "step": step},
                    {"log_type_name": "metric_value", "event_name": "local_valid_tokens",
                     "step": step, "value": 2048.0},
                    {"log_type_name": "step_end", "step": step, "value": ms}]
    (logs / name).write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_a_dump_folder_with_a_run_summary(tmp_path):
    out = tmp_path / "outputs"
    _structured(out, "training.global_rank_0.20261201-090338-VCMH98.jsonl", {1: 9e9})
    steps = [{"step": n, "loss": 8.0 - n / 10, "step_time_s": 1.5 + n / 100,
              "tokens_per_s": 1300.0, "memory_gib": 1.18} for n in range(1, 6)]
    (out / "run_summary.json").write_text(json.dumps(
        {"recipe": "simple_fsdp_llama3_debugmodel", "steps": steps, "world_size": 2}))
    assert plot_run.main([str(out)]) == 0
    _png_size(out / "run.png")

    series = plot_run.read(out)
    assert series.name == "simple_fsdp_llama3_debugmodel"
    assert series.loss == pytest.approx({n: 8.0 - n / 10 for n in range(1, 6)})
    assert series.step_s == pytest.approx({n: 1.5 + n / 100 for n in range(1, 6)})
    fig = plot_run.draw(series, tmp_path / "again.png")
    assert len(fig.axes) == 2 and fig.axes[1].get_yscale() == "linear"


def test_structured_logs_alone_give_the_step_time_of_the_newest_run(tmp_path, capsys):
    out = tmp_path / "outputs"
    _structured(out, "training.global_rank_0.20261130-080000-AAAAAA.jsonl", {1: 1.0, 2: 2.0})
    _structured(out, "training.global_rank_1.20261201-090338-QTT5IK.jsonl", {1: 7.0})
    _structured(out, "training.global_rank_0.20261201-090338-VCMH98.jsonl",
                {1: 60649.0, 2: 1529.6, 3: 1463.3}, tail='{"log_type_name": "step_e')
    png = tmp_path / "elsewhere.png"
    assert plot_run.main([str(out), "--out", str(png)]) == 0
    _png_size(png)
    assert not (out / "run.png").exists()
    err = capsys.readouterr().err
    assert "no run_summary.json" in err and "20261201-090338-VCMH98" in err and "no loss" in err

    series = plot_run.read(out)
    assert series.loss == {}
    assert series.step_s == pytest.approx({1: 60.649, 2: 1.5296, 3: 1.4633})
    fig = plot_run.draw(series, tmp_path / "again.png")
    assert [ax.get_ylabel() for ax in fig.axes] == ["step time (s)"]


def _bad_inputs(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.log").write_text("[rank0]: validate step:  2  loss:  7.0  memory: 1GiB\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run_summary.json").write_text('{"recipe": "x", "steps": [{"loss": 1}]}')
    return [
        (tmp_path / "missing", "no such file or folder; expected a dump folder or a log file"),
        (tmp_path / "empty", "neither run_summary.json nor structured_logs/"),
        (tmp_path / "notes.log", "no training step lines"),
        (tmp_path / "broken", "not a run summary (KeyError"),
    ]


def test_bad_inputs_exit_2_naming_the_path(tmp_path, capsys):
    for path, expected in _bad_inputs(tmp_path):
        assert plot_run.main([str(path)]) == 2, path
        err = capsys.readouterr().err
        assert f"plot_run: {path}" in err and expected in err, err
        assert not list(tmp_path.rglob("*.png"))


def test_the_script_exits_2_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, plot_run.__file__, str(tmp_path / "missing")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(f"plot_run: {tmp_path / 'missing'}: no such file")
    assert "Traceback" not in result.stderr


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    # A None entry in sys.modules makes the import fail, as if not installed.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    log = tmp_path / "train.log"
    log.write_text(_LOG)
    assert plot_run.main([str(log)]) == 2
    assert ("matplotlib is not installed: pip install -e '.[plot]'"
            in capsys.readouterr().err)
    assert not (tmp_path / "train.log.png").exists()
