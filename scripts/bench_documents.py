"""Cost of block-causal attention: step time and peak memory against causal.

    .venv/bin/python scripts/bench_documents.py [--steps 10] [overrides...]

For each tiny recipe (the SimpleFSDP Llama rehearsal on 2 ranks, the SimpleFSDP
DeepSeek debug model at TP2 x FSDP2 on 4 ranks), runs ``./run_train.sh`` with
``--model.attn_mask_type causal`` and ``block_causal`` on the bundled data,
with ``--compile.backend aot_eager`` (the same graphs op by op, so the tensor
tracker sees every allocation). It prints, per run, the median step time over
steps 3..N (from rank 0's log timestamps), rank 0's measured peak tensor
memory at step 2 (``TORCHTITAN_NEURON_MEASURE_MEMORY_STEP``), and its loss at
the last step, then block_causal/causal ratios as a markdown table.
"""

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) .*step:\s+(\d+)\s+loss:\s+(\S+)")
_PEAK = re.compile(r"measured_peak_gib=([\d.]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

RECIPES = [
    ("llama3 debug, FSDP2", "torchtitan_neuron.experiments.graph_trainer.llama3",
     "simple_fsdp_llama3_debugmodel", 2),
    ("deepseek_v3 debug, TP2 x FSDP2", "torchtitan_neuron.experiments.graph_trainer.deepseek_v3",
     "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2", 4),
]


def run(module: str, config: str, ngpu: int, mask: str, steps: int,
        overrides: list[str]) -> dict:
    env = dict(os.environ, NGPU=str(ngpu), MODULE=module, CONFIG=config,
               PYTHON=os.environ.get("PYTHON", sys.executable),
               TORCHTITAN_NEURON_MEASURE_MEMORY_STEP="2")
    proc = subprocess.run(
        ["./run_train.sh", "--training.steps", str(steps),
         "--dataloader.dataset", "c4_test", "--hf_assets_path=./tests/assets/tokenizer",
         "--compile.backend", "aot_eager", "--metrics.log_freq", "1",
         "--debug.seed", "0", "--model.attn_mask_type", mask, *overrides],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{config} {mask} failed:\n{proc.stdout[-3000:]}")
    output = _ANSI.sub("", proc.stdout)
    stamps, losses = {}, {}
    for match in _STAMP.finditer(output):
        step = int(match[2])
        stamps[step] = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")
        losses[step] = float(match[3])
    times = [(stamps[s] - stamps[s - 1]).total_seconds() for s in range(3, steps + 1)]
    peak = _PEAK.search(output)
    return {"step_s": statistics.median(times), "peak_gib": float(peak[1]),
            "loss": losses[steps]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    opts, overrides = parser.parse_known_args()
    rows = []
    for name, module, config, ngpu in RECIPES:
        results = {}
        for mask in ("causal", "block_causal"):
            results[mask] = run(module, config, ngpu, mask, opts.steps, overrides)
            r = results[mask]
            print(f"{config} {mask}: step {r['step_s']:.3f} s, peak {r['peak_gib']:.4f} GiB, "
                  f"loss at step {opts.steps} {r['loss']:.4f}", flush=True)
        c, b = results["causal"], results["block_causal"]
        rows.append(f"| {name} ({ngpu} ranks) | {c['step_s']:.3f} | {b['step_s']:.3f} | "
                    f"{b['step_s'] / c['step_s']:.2f} | {c['peak_gib'] * 1024:.1f} | "
                    f"{b['peak_gib'] * 1024:.1f} | {b['peak_gib'] / c['peak_gib']:.3f} |")
    print()
    print("| recipe | causal step (s) | block_causal step (s) | ratio | "
          "causal peak (MiB) | block_causal peak (MiB) | ratio |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
