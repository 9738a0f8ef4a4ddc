"""First step with a cold and a warm compile cache, on `make train`'s run.

    .venv/bin/python scripts/bench_compile_cache.py [--steps 3] [overrides...]

Runs ``./run_train.sh`` (NGPU=2, the default SimpleFSDP recipe, bundled data,
the recipe's own compile backend: inductor on CPU) twice with one fresh
TORCHINDUCTOR_CACHE_DIR, and prints each run's first step (from "Training
starts" to the step-1 line, from rank 0's log timestamps), its second step,
and warm/cold. Takes about 3 minutes here.
"""

import argparse
import sys
import tempfile

from runlog import launch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    opts, overrides = parser.parse_known_args()
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        for run in ("cold", "warm"):
            # NGPU=2, the default SimpleFSDP recipe: `make train`'s run.
            result = launch(
                ["--training.steps", str(opts.steps), "--dataloader.dataset", "c4_test",
                 "--hf_assets_path=./tests/assets/tokenizer", "--metrics.log_freq", "1",
                 *overrides],
                env={"TORCHINDUCTOR_CACHE_DIR": cache})
            if result.returncode != 0 or len(result.steps) < 2:
                print(result.tail())
                return 1
            results[run] = (result.first_step_s(), result.step_times(2)[0])
            print(f"{run}: first step {results[run][0]:.1f} s, second step "
                  f"{results[run][1]:.2f} s", flush=True)
    ratio = results["warm"][0] / results["cold"][0]
    print(f"warm/cold first step: {100 * ratio:.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
