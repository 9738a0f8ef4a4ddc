"""What a run tells its user: the step lines, through ``NeuronMetricsProcessor``
(torchtitan's metrics processor, which every recipe's config names: each
logged step kept for the summary, ``grad_accum: N`` on the step line, and an
expert-balance line on MoE models); the first step's compile announced, kept
alive by a heartbeat and timed; and a summary after the last step (also
written as ``<dump folder>/run_summary.json``, which ``scripts/plot_run.py``
draws). Rank 0 speaks; the other ranks stay quiet.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.metrics import BaseLogger, MetricsProcessor
from torchtitan.tools.logging import logger

from torchtitan_neuron import cpu_twins
from torchtitan_neuron.components.moe import expert_balance_stats

HEARTBEAT_ENV = "TORCHTITAN_NEURON_HEARTBEAT_S"
HEARTBEAT_S = 30.0
SUMMARY_FILE = "run_summary.json"


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _inductor_cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX-graph and AOTAutograd caches so far."""
    from torch._dynamo.utils import counters

    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = (counters["inductor"]["fxgraph_cache_miss"]
              + counters["aot_autograd"]["autograd_cache_miss"])
    return hits, misses


def _files_under(folder: str | None) -> int:
    if not folder or not os.path.isdir(folder):
        return 0
    return sum(len(files) for _, _, files in os.walk(folder))


class CompileProgress:
    """Announces the first step's trace and compile, prints a heartbeat at
    most every ``HEARTBEAT_S`` seconds while it runs, and times it."""

    def __init__(self, backend: str, cache_dir: str | None, neff_cache_dir: str | None):
        self.backend, self.cache_dir, self.neff_cache_dir = backend, cache_dir, neff_cache_dir
        self.seconds: float | None = None
        self.cache_state = ""

    def __enter__(self):
        self._start = time.perf_counter()
        self._before = (_inductor_cache_counts(), _files_under(self.neff_cache_dir))
        where = self.neff_cache_dir or self.cache_dir
        if is_rank0():
            logger.info(
                f"Step 1 traces and compiles the whole training step with the "
                f"'{self.backend}' backend; this happens on the first step only"
                + (f" (compile cache: {where})" if where else "") + ".")
        self._stop = threading.Event()
        self._thread = None
        if is_rank0():
            interval = float(os.environ.get(HEARTBEAT_ENV, HEARTBEAT_S))
            self._thread = threading.Thread(target=self._beat, args=(interval,), daemon=True)
            self._thread.start()
        return self

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            logger.info(f"Step 1 still compiling: {time.perf_counter() - self._start:.0f} s "
                        "elapsed")

    def __exit__(self, exc_type, *_):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.seconds = time.perf_counter() - self._start
        self.cache_state = self._cache_state()
        if exc_type is None and is_rank0():
            logger.info(f"Step 1 compiled and ran in {self.seconds:.1f} s ({self.cache_state})")
        return False

    def _cache_state(self) -> str:
        (hits0, misses0), files0 = self._before
        hits, misses = (a - b for a, b in zip(_inductor_cache_counts(), (hits0, misses0)))
        if self.neff_cache_dir:
            new = _files_under(self.neff_cache_dir) - files0
            return "cold NEFF cache" if new > 0 else "warm NEFF cache"
        if misses > 0:
            return f"cold cache: {misses} graphs compiled" + (f", {hits} reused" if hits else "")
        if hits > 0:
            return f"warm cache: {hits} graphs reused"
        return f"no on-disk cache for the '{self.backend}' backend"


class RunRecord(BaseLogger):
    """The metrics torchtitan logs each logged step, kept for the summary;
    passes them on to the run's own loggers (TensorBoard, W&B)."""

    def __init__(self, inner: BaseLogger):
        self.inner = inner
        self.rows: list[dict] = []
        self.validation: list[dict] = []  # the validator's losses, by step

    def log(self, metrics: dict, step: int) -> None:
        if "validation_metrics/loss" in metrics:
            self.validation.append({"step": step, "loss": metrics["validation_metrics/loss"]})
            self.inner.log(metrics, step)
            return
        self.rows.append({
            "step": step,
            "loss": metrics.get("loss_metrics/global_avg_loss"),
            "step_time_s": metrics.get("time_metrics/end_to_end(s)"),
            "tokens_per_s": metrics.get("throughput(tps)"),
            "memory_gib": metrics.get("memory/max_reserved(GiB)"),
        })
        self.inner.log(metrics, step)

    def close(self) -> None:
        self.inner.close()

    def tensorboard_dir(self) -> str | None:
        loggers = getattr(self.inner, "_loggers", [self.inner])
        for each in loggers:
            writer = getattr(each, "writer", None)
            if writer is not None:
                return writer.log_dir
        return None


class _StepLineSuffix(logging.Filter):
    """Appends ``suffix`` to torchtitan's step line (``step: ... loss: ...``)."""

    def __init__(self, suffix: str):
        super().__init__()
        self.suffix = suffix

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "step:" in record.msg \
                and self.suffix not in record.msg:
            record.msg = record.msg + self.suffix
        return True


@contextlib.contextmanager
def step_line_suffix(suffix: str):
    """``suffix`` on the step line ``MetricsProcessor.log`` prints inside."""
    if not suffix:
        yield
        return
    line = _StepLineSuffix(suffix)
    logger.addFilter(line)
    try:
        yield
    finally:
        logger.removeFilter(line)


class NeuronMetricsProcessor(MetricsProcessor):
    """torchtitan's metrics processor, with what every Neuron recipe reports.

    - Each logged step's metrics are kept (``self.record``, a ``RunRecord``
      around torchtitan's TensorBoard / W&B loggers) for the run summary.
    - The step line ends with ``grad_accum: N`` once the trainer sets
      ``grad_accum_steps``, so the batch arithmetic shows on every line.
    - On an MoE model a line on expert balance follows each step line.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.record = RunRecord(self.logger)
        self.logger = self.record
        self.grad_accum_steps: int | None = None

    def log(self, step: int, global_avg_loss: float, global_max_loss: float,
            grad_norm: float, extra_metrics: dict | None = None) -> None:
        accum = self.grad_accum_steps
        with step_line_suffix(f"  grad_accum: {accum}" if accum else ""):
            super().log(step, global_avg_loss, global_max_loss, grad_norm,
                        extra_metrics=extra_metrics)
        stats = expert_balance_stats(self.model_parts or [])
        if stats is not None:
            logger.info(
                f"step: {step:2}  expert_imbalance: {stats[0]:.4f}  "
                f"expert_bias_spread: {stats[1]:.5f}  "
                "(max/mean tokens per expert; max-min expert bias; "
                "means over MoE layers)"
            )


def recipe_from_argv(argv: list[str] | None = None) -> tuple[str | None, str | None]:
    """(--module, --config) as the rank was started with them."""
    argv = sys.argv if argv is None else argv
    found = {}
    for i, arg in enumerate(argv):
        for name in ("--module", "--config"):
            if arg == name and i + 1 < len(argv):
                found[name] = argv[i + 1]
            elif arg.startswith(name + "="):
                found[name] = arg.split("=", 1)[1]
    return found.get("--module"), found.get("--config")


def summarize(config, record: RunRecord, compile_progress: CompileProgress | None,
              platform_name: str) -> dict:
    """The summary of a finished run, as a dict (written to the dump folder)."""
    rows = [r for r in record.rows if r["loss"] is not None]
    later = rows[1:]
    dump = Path(config.dump_folder)
    module, recipe = recipe_from_argv()
    summary = {
        "recipe": recipe, "module": module, "platform": platform_name,
        "steps_run": len(rows),
        "first_step": rows[0]["step"] if rows else None,
        "last_step": rows[-1]["step"] if rows else None,
        "loss_first": rows[0]["loss"] if rows else None,
        "loss_last": rows[-1]["loss"] if rows else None,
        "median_step_time_s": statistics.median(r["step_time_s"] for r in later) if later else None,
        "median_tokens_per_s_per_rank":
            statistics.median(r["tokens_per_s"] for r in later) if later else None,
        "peak_memory_gib_rank0": max((r["memory_gib"] or 0) for r in rows) if rows else None,
        "first_step_compile_s": compile_progress.seconds if compile_progress else None,
        "compile_cache": compile_progress.cache_state if compile_progress else None,
        "checkpoints": str(dump / config.checkpoint.folder) if config.checkpoint.enable else None,
        "tensorboard": record.tensorboard_dir(),
        "structured_logs": (str(dump / "structured_logs")
                            if config.debug.enable_structured_logging else None),
        "steps": rows,
        "validation": record.validation,
        "validation_loss_last": record.validation[-1]["loss"] if record.validation else None,
    }
    counterpart = cpu_twins.trainium_counterpart(module or "", recipe or "")
    if platform_name == "cpu" and counterpart:
        summary["trn2_plan_command"] = cpu_twins.plan_command(module, counterpart)
    return summary


def describe(summary: dict) -> str:
    """The lines rank 0 prints after the last step."""
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"Run summary ({summary['recipe']}): {summary['steps_run']} steps logged "
        f"(steps {summary['first_step']}-{summary['last_step']})",
        f"  loss                 {fmt(summary['loss_first'], '.5f')} -> "
        f"{fmt(summary['loss_last'], '.5f')}",
        f"  step time            {fmt(summary['median_step_time_s'], '.3f')} s, "
        f"{fmt(summary['median_tokens_per_s_per_rank'], ',.0f')} tokens/s per rank "
        "(medians after the first step)",
        f"  peak memory          {fmt(summary['peak_memory_gib_rank0'], '.2f')} GiB per rank "
        "(rank 0, max reserved)",
    ]
    if summary["first_step_compile_s"] is not None:
        lines.append(f"  first step           {summary['first_step_compile_s']:.1f} s with "
                     f"tracing and compiling ({summary['compile_cache']})")
    if summary.get("parameters") and summary["parameters_trained"] < summary["parameters"]:
        lines.append(f"  parameters trained   {summary['parameters_trained']:,} of "
                     f"{summary['parameters']:,} (the others frozen)")
    if summary.get("validation"):
        last = summary["validation"][-1]
        lines.append(f"  validation loss      {last['loss']:.5f} at step {last['step']} "
                     f"({len(summary['validation'])} validations)")
    for label, key in (("checkpoints", "checkpoints"), ("tensorboard", "tensorboard"),
                       ("structured logs", "structured_logs"), ("this summary", "file")):
        lines.append(f"  {label:<20} {summary.get(key) or 'off'}")
    if summary.get("trn2_plan_command"):
        lines.append("  on trn2 (64 NeuronCores), will its Trainium recipe fit? "
                     + summary["trn2_plan_command"])
    return "\n".join(lines)


def write_summary(config, summary: dict) -> str:
    path = Path(config.dump_folder) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    summary["file"] = str(path)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return str(path)
