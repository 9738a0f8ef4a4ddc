"""The pipeline's measured bubble against its schedule's theoretical one.

    make bench-pipeline      (or: .venv/bin/python scripts/bench_pipeline.py [--steps 6])

Launches of ``./run_train.sh`` with the SimpleFSDP Llama debug model on the
bundled data, fp32 parameters, ``--debug.seed 0``, the recipe's own AC policy
(selective, every matmul saved: ``--compile.memory_policy default``), ``--compile.backend aot_eager``, sequence
length 2048, one thread per rank (``OMP_NUM_THREADS=1``, so a rank is one
core):

- PP1: 1 rank runs the whole model over ``m`` sequences (local batch ``m``);
- PP2: 2 ranks, one stage each, torch's ``1F1B`` over the same ``m``
  sequences in ``m`` microbatches of one (``LOG_RANK=1``: the last stage
  prints the loss).

for ``m`` in 2, 4 and 8. Each pair trains the same model on the same data (the
step-1 losses must agree within 1e-5 relative, or no figure is printed).

With p stages that split the work evenly and free communication, p ranks
would take ``T1 / p`` for what one rank does in ``T1``; the bubble is the
share of the p ranks' time that is idle:

    measured bubble = 1 - T1 / (p x Tpp)

1F1B's theoretical bubble is ``(p - 1) / (m + p - 1)``. The measured one
also holds what the theory leaves out: the send and receive between stages,
and the stages' imbalance (the first holds the embedding, the last the
output projection and the loss).
"""

import argparse
import statistics
import sys

from runlog import launch  # noqa: E402

LLAMA = ("torchtitan_neuron.experiments.graph_trainer.llama3", "simple_fsdp_llama3_debugmodel")
MICROBATCHES = (2, 4, 8)
SEQ = 2048


def run(ngpu: int, m: int, steps: int) -> dict:
    module, config = LLAMA
    flags = ["--training.local_batch_size", str(m), "--training.global_batch_size", str(m),
             "--training.seq_len", str(SEQ)]
    env = {"OMP_NUM_THREADS": "1"}
    if ngpu > 1:
        flags += ["--parallelism.pipeline_parallel_degree", str(ngpu),
                  "--parallelism.pipeline_parallel_schedule", "1F1B",
                  "--parallelism.data_parallel_shard_degree", "1"]
        env["LOG_RANK"] = str(ngpu - 1)
    result = launch(
        ["--training.steps", str(steps), "--dataloader.dataset", "c4_test",
         "--hf_assets_path=./tests/assets/tokenizer", "--compile.backend", "aot_eager",
         # Selective AC saving every matmul, the policy docs/parallelisms.md quotes.
         "--compile.memory_policy", "default",
         "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
         "--debug.seed", "0", *flags],
        ngpu=ngpu, module=module, config=config, env=env, timeout=1800)
    if result.returncode != 0 or len(result.steps) < steps:
        raise SystemExit(f"PP{ngpu} m={m} failed:\n{result.tail()}")
    return {"step_s": statistics.median(result.step_times(3)), "loss1": result.steps[0].loss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    opts = parser.parse_args()
    p, rows, unequal = 2, [], []
    for m in MICROBATCHES:
        one, pp = run(1, m, opts.steps), run(p, m, opts.steps)
        print(f"m={m}: PP1 step {one['step_s']:.3f} s (loss {one['loss1']:.5f}), PP{p} step "
              f"{pp['step_s']:.3f} s (loss {pp['loss1']:.5f})", flush=True)
        if abs(pp["loss1"] - one["loss1"]) > 1e-5 * abs(one["loss1"]):
            unequal.append(m)
        rows.append((m, one, pp))
    print(f"\nLlama debug, seq {SEQ}, PP{p} (1F1B, microbatches of 1) against 1 rank; "
          "AC: selective, every matmul saved; aot_eager; fp32; one thread per rank\n")
    print("| microbatches m | PP1 step (s) | PP2 step (s) | step-1 loss | speedup | "
          "measured bubble | 1F1B theoretical (p-1)/(m+p-1) |")
    print("|---|---|---|---|---|---|---|")
    for m, one, pp in rows:
        theory = (p - 1) / (m + p - 1)
        if m in unequal:
            print(f"| {m} | {one['step_s']:.3f} | {pp['step_s']:.3f} | {one['loss1']:.5f} / "
                  f"{pp['loss1']:.5f} | not comparable | not comparable | {theory:.3f} |")
            continue
        bubble = 1 - one["step_s"] / (p * pp["step_s"])
        print(f"| {m} | {one['step_s']:.3f} | {pp['step_s']:.3f} | {one['loss1']:.5f} | "
              f"{one['step_s'] / pp['step_s']:.2f}x | {bubble:.3f} | {theory:.3f} |")
    if unequal:
        print(f"\nNo bubble for m in {unequal}: the step-1 losses differ by more than 1e-5 "
              "relative, so the two runs do not train the same model on the same data.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
