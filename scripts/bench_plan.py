#!/usr/bin/env python3
"""Planned vs measured peak tensor memory per rank, on CPU ranks.

For each cell (recipe x ranks x AC mode) it runs
``python -m torchtitan_neuron.plan --target cpu --json`` and then the real
training run through ``run_train.sh`` with
``TORCHTITAN_NEURON_MEASURE_MEMORY_STEP=2``, which follows every real tensor
storage of step 2 on rank 0 (the compiled graphs included, run op by op by
aot_eager) with the same dispatch-mode tracker the planner uses on
FakeTensors; parameters, gradients and optimizer state are counted from the
live shards. Recipes: the Llama and DeepSeek debug models and a medium Llama
(scripts/bench_recipes.py, about 58 M parameters). It prints a markdown table
and ``max_abs_rel_error=<x>``.

    python scripts/bench_plan.py [--quick] [--out docs/plan_accuracy.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from runlog import REPO, launch, run_command  # noqa: E402

LLAMA = ("torchtitan_neuron.experiments.graph_trainer.llama3", "simple_fsdp_llama3_debugmodel")
MEDIUM = ("scripts.bench_recipes", "simple_fsdp_llama3_medium")
DEEPSEEK = ("torchtitan_neuron.experiments.graph_trainer.deepseek_v3",
            "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2")
COMMON = ["--dataloader.dataset", "c4_test", "--hf_assets_path=./tests/assets/tokenizer",
          "--training.steps", "2", "--metrics.log_freq", "1", "--debug.seed", "0"]


def cells(quick: bool, models: list[str]):
    out = []
    recipes = {"llama": (LLAMA, 1024, 8), "medium": (MEDIUM, 512, 4),
               "deepseek": (DEEPSEEK, 256, 4)}
    for (module, config), seq, batch in (recipes[m] for m in models):
        for ngpu in ((2,) if quick else (1, 2, 4)):
            for ac in ("selective", "full"):
                out.append((module, config, ngpu, ac, "aot_eager", seq, batch))
    return out


def cell_flags(ngpu: int, backend: str, seq: int, batch: int) -> list[str]:
    """The trainer flags of a cell, the plan's and the run's alike."""
    return [*COMMON, "--compile.backend", backend, "--training.seq_len", str(seq),
            "--training.local_batch_size", str(batch),
            # One micro-batch per rank per step, whatever the recipe pins.
            "--training.global_batch_size", str(batch * ngpu),
            "--parallelism.tensor_parallel_degree=1",
            "--parallelism.data_parallel_shard_degree=-1"]


def run_cell(module, config, ngpu, ac, backend, seq, batch, workdir: Path) -> dict:
    flags = cell_flags(ngpu, backend, seq, batch)
    sub = [f"activation-checkpoint:{ac}"]
    plan = run_command(
        [sys.executable, "-m", "torchtitan_neuron.plan", "--module", module, "--config",
         config, f"--ngpu={ngpu}", "--target=cpu", "--json", *flags, *sub])
    plan_s = plan.wall_s
    planned = [l for l in plan.output.splitlines() if l.startswith("{")]
    if plan.returncode or not planned:
        raise RuntimeError(f"plan failed for {config} {ngpu} {ac}:\n{plan.output[-2000:]}")
    planned = json.loads(planned[-1])
    run = launch([*flags, *sub], ngpu=ngpu, module=module, config=config,
                 dump_folder=workdir,
                 env={"PYTHON": sys.executable, "TORCHTITAN_NEURON_MEASURE_MEMORY_STEP": "2",
                      # the kernel the plan uses
                      "TORCHTITAN_NEURON_EXPERT_KERNEL": "grouped_mm"})
    text = run.output
    m = re.search(r"measured_peak_gib=([\d.]+)", text)
    if run.returncode or not m:
        raise RuntimeError(f"run failed for {config} {ngpu} {ac}:\n{text[-2000:]}")
    measured = float(m[1])
    return {"config": config, "ngpu": ngpu, "ac": ac, "backend": backend,
            "seq": seq, "batch": batch, "planned": planned["peak_gib"],
            "measured": measured, "plan_s": plan_s,
            "rel_error": (planned["peak_gib"] - measured) / measured}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 ranks only")
    parser.add_argument("--models", nargs="+", default=["llama", "medium", "deepseek"],
                        choices=["llama", "medium", "deepseek"])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "plan_accuracy.md")
    opts = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, cell in enumerate(cells(opts.quick, opts.models)):
            row = run_cell(*cell, Path(tmp) / str(i))
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [
        f"Planned vs measured peak tensor memory per rank (rank 0, step 2), "
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores. Command: "
        f"`python scripts/bench_plan.py{' --quick' if opts.quick else ''}`.",
        "",
        "| recipe | ranks | AC | backend | seq x batch | planned GiB | measured GiB | error | plan time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['ngpu']} | {r['ac']} | {r['backend']} | "
            f"{r['seq']} x {r['batch']} | {r['planned']:.4f} | {r['measured']:.4f} | "
            f"{100 * r['rel_error']:+.1f}% | {r['plan_s']:.0f} s |"
        )
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"max_abs_rel_error={max(abs(r['rel_error']) for r in rows):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
