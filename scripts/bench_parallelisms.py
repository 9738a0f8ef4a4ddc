"""Expert against tensor parallelism, and context parallelism's memory, at equal work.

    make bench-parallel      (or: .venv/bin/python scripts/bench_parallelisms.py [--steps 8])

Two groups of launches of ``./run_train.sh`` on the bundled data, fp32
parameters, ``--debug.seed 0``, the recipe's own AC policy (selective, saving
every matmul: ``--compile.memory_policy default``), ``--compile.backend aot_eager`` (the compiled step's graphs run
op by op, so the tensor tracker sees every allocation):

- the SimpleFSDP DeepSeek debug model on 4 ranks, global batch 8: TP2 x FSDP2,
  EP2 x FSDP4 and TP2 x EP2 x FSDP2;
- the SimpleFSDP Llama debug model on 2 ranks at sequence length 2048,
  global batch 2 (the same sequences): FSDP2 with one sequence per rank, and
  CP2 with each rank holding half of both.

Per cell it prints the median step time over steps 3..N (rank 0's log
timestamps), tokens/s per rank, rank 0's measured peak tensor memory at step 2
(``TORCHTITAN_NEURON_MEASURE_MEMORY_STEP``) and the step-1 loss. Within a
group a ratio is printed only when every cell's step-1 loss equals the first
cell's within 1e-5 relative (the same model and data); otherwise the script
says which cell differs and exits 1.
"""

import argparse
import re
import statistics
import sys

from runlog import launch  # noqa: E402

DEEPSEEK = ("torchtitan_neuron.experiments.graph_trainer.deepseek_v3",
            "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2")
LLAMA = ("torchtitan_neuron.experiments.graph_trainer.llama3", "simple_fsdp_llama3_debugmodel")
GROUPS = {
    "DeepSeek debug, 4 ranks, global batch 8, seq 256": (DEEPSEEK, 4, [
        "--training.global_batch_size", "8", "--training.local_batch_size", "2"], [
        ("TP2 x FSDP2", ["--parallelism.tensor_parallel_degree", "2"]),
        ("EP2 x FSDP4", ["--parallelism.tensor_parallel_degree", "1",
                         "--parallelism.expert_parallel_degree", "2"]),
        ("TP2 x EP2 x FSDP2", ["--parallelism.tensor_parallel_degree", "2",
                               "--parallelism.expert_parallel_degree", "2"]),
    ]),
    "Llama debug, 2 ranks, global batch 2, seq 2048": (LLAMA, 2, [
        "--training.seq_len", "2048", "--training.global_batch_size", "2"], [
        ("FSDP2 (CP1)", ["--training.local_batch_size", "1"]),
        ("CP2", ["--training.local_batch_size", "2",
                 "--parallelism.context_parallel_degree", "2"]),
    ]),
}


def run(recipe, ngpu: int, flags: list[str], steps: int) -> dict:
    module, config = recipe
    result = launch(
        ["--training.steps", str(steps), "--dataloader.dataset", "c4_test",
         "--hf_assets_path=./tests/assets/tokenizer", "--compile.backend", "aot_eager",
         # Selective AC saving every matmul, the policy docs/parallelisms.md quotes.
         "--compile.memory_policy", "default",
         "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
         "--debug.seed", "0", *flags],
        ngpu=ngpu, module=module, config=config,
        env={"TORCHTITAN_NEURON_MEASURE_MEMORY_STEP": "2"}, timeout=1800)
    peak = re.search(r"measured_peak_gib=([\d.]+)", result.output)
    if result.returncode != 0 or not peak or len(result.steps) < steps:
        raise SystemExit(f"{config} {' '.join(flags)} failed:\n{result.tail()}")
    tps = [s.tps for s in result.steps[2:] if s.tps is not None]
    return {"step_s": statistics.median(result.step_times(3)), "tps": statistics.median(tps),
            "peak_gib": float(peak[1]), "loss1": result.steps[0].loss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    opts = parser.parse_args()
    unequal = False
    for title, (recipe, ngpu, common, cells) in GROUPS.items():
        results = []
        for name, flags in cells:
            r = run(recipe, ngpu, [*common, *flags], opts.steps)
            results.append((name, r))
            print(f"{title} | {name}: step {r['step_s']:.3f} s, {r['tps']:.0f} tokens/s per "
                  f"rank, peak {r['peak_gib'] * 1024:.1f} MiB, step-1 loss {r['loss1']:.5f}",
                  flush=True)
        ref_name, ref = results[0]
        bad = [n for n, r in results if abs(r["loss1"] - ref["loss1"]) > 1e-5 * abs(ref["loss1"])]
        print(f"\n{title} (AC: selective, every matmul saved; aot_eager; fp32)\n")
        print(f"| layout | step (s) | tokens/s per rank | peak tensor memory, rank 0 (MiB) "
              f"| step-1 loss | tokens/s vs {ref_name} | memory vs {ref_name} |")
        print("|---|---|---|---|---|---|---|")
        for name, r in results:
            ratios = ("| not comparable | not comparable |" if bad else
                      f"| {r['tps'] / ref['tps']:.2f} | {r['peak_gib'] / ref['peak_gib']:.2f} |")
            print(f"| {name} | {r['step_s']:.3f} | {r['tps']:.0f} | {r['peak_gib'] * 1024:.1f} "
                  f"| {r['loss1']:.5f} {ratios}")
        if bad:
            unequal = True
            print(f"\nNo ratio: the step-1 loss of {', '.join(bad)} differs from {ref_name}'s "
                  "by more than 1e-5 relative, so the cells do not train the same model on "
                  "the same data.")
        print(flush=True)
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main())
