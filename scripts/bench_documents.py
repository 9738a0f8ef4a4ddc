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
import re
import statistics
import sys

from runlog import launch  # noqa: E402

RECIPES = [
    ("llama3 debug, FSDP2", "torchtitan_neuron.experiments.graph_trainer.llama3",
     "simple_fsdp_llama3_debugmodel", 2),
    ("deepseek_v3 debug, TP2 x FSDP2", "torchtitan_neuron.experiments.graph_trainer.deepseek_v3",
     "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2", 4),
]


def run(module: str, config: str, ngpu: int, mask: str, steps: int,
        overrides: list[str]) -> dict:
    result = launch(
        ["--training.steps", str(steps),
         "--dataloader.dataset", "c4_test", "--hf_assets_path=./tests/assets/tokenizer",
         "--compile.backend", "aot_eager", "--metrics.log_freq", "1",
         "--debug.seed", "0", "--model.attn_mask_type", mask, *overrides],
        ngpu=ngpu, module=module, config=config,
        env={"TORCHTITAN_NEURON_MEASURE_MEMORY_STEP": "2"})
    peak = re.search(r"measured_peak_gib=([\d.]+)", result.output)
    if result.returncode != 0 or not peak:
        raise SystemExit(f"{config} {mask} failed:\n{result.tail()}")
    return {"step_s": statistics.median(result.step_times(3)), "peak_gib": float(peak[1]),
            "loss": result.steps[-1].loss}


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
