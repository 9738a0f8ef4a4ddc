#!/usr/bin/env python3
"""Draw a training run's loss and step time per step into one PNG.

    python scripts/plot_run.py <dump folder | log file> [--out PNG]

What it reads:

- a log file, the output of ``./run_train.sh`` (colours and all): its step
  lines, through scripts/runlog.py. A step's time is the time between its
  line's log stamp and the previous step line's, divided by the steps between
  them (the mean over the interval when ``--metrics.log_freq`` is above 1);
  the first step's is from "Training starts", so it includes compilation;
- a dump folder (``--dump_folder``, default ``./outputs``): its
  ``run_summary.json``, which rank 0 writes after the last step; without one,
  rank 0's newest structured log, ``structured_logs/training.global_rank_0.*.jsonl``,
  whose ``step_end`` records give the step time but not the loss, so only
  the step time is drawn (said on stderr).

Writes ``<dump folder>/run.png``, or ``<log>.png`` next to a log file, unless
``--out`` names the PNG. Exits 0 when it is written, 2 when the input is not
one of the above or holds no steps, or matplotlib is missing (the message
names the path and what was expected).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from runlog import Run, strip_ansi  # noqa: E402

SUMMARY = "run_summary.json"
STRUCTURED = "structured_logs/training.global_rank_0.*.jsonl"
MISSING_MATPLOTLIB = "matplotlib is not installed: pip install -e '.[plot]'"


class BadInput(Exception):
    """An input this script cannot draw; the message names it and says why."""


@dataclass
class Series:
    """What is drawn: per step, the loss and the step time in seconds."""

    name: str
    loss: dict[int, float] = field(default_factory=dict)
    step_s: dict[int, float] = field(default_factory=dict)
    note: str = ""  # a second title line: where the figures come from, when partial


def from_log(path: Path) -> Series:
    run = Run(0, strip_ansi(path.read_text(errors="replace")))
    if not run.steps:
        raise BadInput(f"{path}: no training step lines ('step: N  loss: X  grad_norm: ...'); "
                       "expected the output of ./run_train.sh")
    series = Series(path.name, loss={s.step: s.loss for s in run.steps})
    timed = [s for s in run.steps if s.time]
    try:
        start = run.stamp("Training starts")
        if timed and timed[0].time >= start:
            series.step_s[timed[0].step] = (timed[0].time - start).total_seconds()
    except LookupError:
        pass  # a log cut before its start: the first step has no time
    for prev, cur in zip(timed, timed[1:]):
        if cur.step > prev.step:
            series.step_s[cur.step] = (cur.time - prev.time).total_seconds() / (cur.step - prev.step)
    if not series.step_s:
        series.note = "loss only: the step lines have no log times"
        print(f"plot_run: {path}: {series.note}", file=sys.stderr)
    return series


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def from_summary(path: Path) -> Series:
    try:
        summary = json.loads(path.read_text())
        steps = summary["steps"]
        series = Series(summary.get("recipe") or path.parent.name)
        for entry in steps:
            n = int(entry["step"])
            if _number(entry.get("loss")) is not None:
                series.loss[n] = _number(entry["loss"])
            if _number(entry.get("step_time_s")) is not None:
                series.step_s[n] = _number(entry["step_time_s"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path}: not a run summary ({type(e).__name__}: {e}); expected "
                       '{"recipe": ..., "steps": [{"step": N, "loss": X, "step_time_s": T}, ...]}'
                       ) from None
    if not series.loss and not series.step_s:
        raise BadInput(f"{path}: no steps with a loss or a step time")
    return series


def from_structured(folder: Path) -> Series:
    # The name carries the run's start (training.global_rank_0.YYYYMMDD-HHMMSS-ID),
    # so the last by name is the newest run even in a copied folder.
    path = sorted(folder.glob(STRUCTURED))[-1]
    series = Series(folder.resolve().name, note=f"step time from {path.name} (it has no loss)")
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a run killed mid-write leaves a partial last line
        if (isinstance(record, dict) and record.get("log_type_name") == "step_end"
                and isinstance(record.get("step"), int) and _number(record.get("value")) is not None):
            series.step_s[record["step"]] = record["value"] / 1000  # ms
    if not series.step_s:
        raise BadInput(f"{path}: no step_end records; expected torchtitan's structured log "
                       "of a run that finished at least one step")
    print(f"plot_run: no {SUMMARY} in {folder}; drawing the step time from {path.name} "
          "(structured logs have no loss)", file=sys.stderr)
    return series


def read(path: Path) -> Series:
    """The series of a log file or a dump folder (see the module docstring)."""
    if path.is_dir():
        if (path / SUMMARY).is_file():
            return from_summary(path / SUMMARY)
        if any(path.glob(STRUCTURED)):
            return from_structured(path)
        raise BadInput(f"{path}: neither {SUMMARY} nor {STRUCTURED}; expected the dump "
                       "folder of a training run (--dump_folder, default ./outputs)")
    if path.is_file():
        return from_log(path)
    raise BadInput(f"{path}: no such file or folder; expected a dump folder or a log "
                   "file of ./run_train.sh")


def agg_figure(**kwargs):
    """A matplotlib Figure on the Agg canvas: PNG out, no display, and no
    pyplot state shared with the caller. matplotlib is an optional extra,
    so it is imported here, where a plot is asked for."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(MISSING_MATPLOTLIB) from None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def draw(series: Series, out: Path):
    """One panel per quantity the run has, loss above step time; the figure."""
    panels = [(series.loss, "loss", "tab:blue"), (series.step_s, "step time (s)", "tab:orange")]
    panels = [p for p in panels if p[0]]
    fig = agg_figure(figsize=(8, 3 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (values, label, color) in zip(axes, panels):
        steps = sorted(values)
        ax.plot(steps, [values[n] for n in steps], marker="o", markersize=3, color=color)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    times = [t for t in series.step_s.values() if t > 0]
    # The first step compiles and can take tens of times as long as the
    # others; on a linear axis it would flatten them into one line.
    if times and max(times) > 10 * min(times):
        from matplotlib.ticker import FuncFormatter

        axes[-1].set_yscale("log")
        # Plain numbers (2, 60, not 2x10^0, 6x10^1), and of the minor ticks
        # only 2 and 5 of each decade, which leaves room between labels.
        axes[-1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axes[-1].yaxis.set_minor_formatter(FuncFormatter(
            lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    axes[-1].set_xlabel("step")
    fig.suptitle(f"{series.name}\n{series.note}" if series.note else series.name)
    fig.savefig(out, dpi=100)
    return fig


def default_out(path: Path) -> Path:
    return path / "run.png" if path.is_dir() else path.with_name(path.name + ".png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="dump folder or log file of a training run")
    parser.add_argument("--out", type=Path, help="the PNG (default: see above)")
    opts = parser.parse_args(argv)
    out = opts.out or default_out(opts.run)
    try:
        series = read(opts.run)
        draw(series, out)
    except (BadInput, ImportError) as e:
        print(f"plot_run: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"plot_run: cannot read the run or write {out}: {e}", file=sys.stderr)
        return 2
    kept = ", ".join(k for k, v in (("loss", series.loss), ("step time", series.step_s)) if v)
    print(f"wrote {out} ({kept}; {len(series.loss or series.step_s)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
