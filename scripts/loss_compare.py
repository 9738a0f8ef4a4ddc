#!/usr/bin/env python3
"""Run two training configurations and compare their per-step losses.

Each side is a launch of ./run_train.sh: ``NAME=value`` words set its
environment (NGPU, MODULE, CONFIG, ...), the other words are trainer flags,
added after the common ones. Example, SimpleFSDP on 1 rank against TP2 x FSDP2
on 4, fp32, same seed and data:

    python scripts/loss_compare.py --steps 10 \\
        --a "NGPU=1" \\
        --b "NGPU=4 --parallelism.tensor_parallel_degree 2" \\
        -- --training.global_batch_size 4

Prints both loss columns, their relative difference per step, and
``max_rel_diff=<x>``; exits 0 when it is within ``--rtol``, 1 when it is not,
2 when a run fails or prints fewer steps than asked for.

The common flags pin what parity needs: c4_test, the bundled tokenizer, fp32
parameters (``--training.mixed_precision_param float32``), ``--debug.seed``,
aot_eager and logging every step. Anything after ``--`` is added to both.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from runlog import precise_losses, run_command  # noqa: E402

_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def common_flags(steps: int, seed: int, seq_len: int, local_batch: int) -> list[str]:
    return [
        "--dataloader.dataset", "c4_test",
        "--hf_assets_path=./tests/assets/tokenizer",
        "--compile.backend", "aot_eager",
        "--training.mixed_precision_param", "float32",
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(local_batch),
        "--training.steps", str(steps),
        "--metrics.log_freq", "1",
        "--debug.seed", str(seed),
    ]


def split_side(spec: str) -> tuple[dict[str, str], list[str]]:
    env, args = {}, []
    for word in shlex.split(spec):
        if _ENV.match(word) and not args:
            key, value = word.split("=", 1)
            env[key] = value
        else:
            args.append(word)
    return env, args


def run_side(spec: str, common: list[str], dump_folder: Path, log: Path) -> dict[int, float]:
    env, args = split_side(spec)
    full_env = dict(os.environ, PYTHON=os.environ.get("PYTHON", sys.executable))
    full_env.update(env)
    run = run_command(["./run_train.sh", f"--dump_folder={dump_folder}", *common, *args],
                      full_env, log=log)
    if run.returncode != 0:
        tail = "\n".join(run.output.splitlines()[-25:])
        raise RuntimeError(f"run '{spec}' exited with {run.returncode} (log: {log}):\n{tail}")
    # The summary's losses at full precision where the run wrote one (the
    # step line rounds to 5 decimals).
    return precise_losses(dump_folder) or {s.step: s.loss for s in run.steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="first side: env words, then flags")
    parser.add_argument("--b", required=True, help="second side: env words, then flags")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--local-batch", type=int, default=2)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--concurrent", action="store_true",
                        help="launch both sides at once (a machine with cores to spare, "
                             "or one whose launches spend time waiting)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for both runs' outputs and logs (default: a temporary one)")
    parser.add_argument("extra", nargs="*", help="flags for both sides (after --)")
    opts = parser.parse_args(argv)

    common = common_flags(opts.steps, opts.seed, opts.seq_len, opts.local_batch) + opts.extra
    out = opts.out or Path(tempfile.mkdtemp(prefix="loss_compare_"))
    out.mkdir(parents=True, exist_ok=True)
    sides = (("a", opts.a), ("b", opts.b))
    with ThreadPoolExecutor(max_workers=2 if opts.concurrent else 1) as pool:
        futures = [pool.submit(run_side, spec, common, out / name, out / f"{name}.log")
                   for name, spec in sides]
        try:
            a, b = [future.result() for future in futures]
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 2
    missing = [s for s in range(1, opts.steps + 1) if s not in a or s not in b]
    if missing:
        print(f"steps missing from a run's output: {missing} (logs in {out})", file=sys.stderr)
        return 2

    print(f"a: {opts.a}\nb: {opts.b}")
    print(f"{'step':>4}  {'loss a':>10}  {'loss b':>10}  {'rel diff':>9}")
    worst = 0.0
    for step in range(1, opts.steps + 1):
        rel = abs(a[step] - b[step]) / max(abs(a[step]), 1e-12)
        worst = max(worst, rel)
        print(f"{step:>4}  {a[step]:>10.5f}  {b[step]:>10.5f}  {rel:>9.2e}")
    ok = worst <= opts.rtol
    print(f"max_rel_diff={worst:.3e} rtol={opts.rtol:g} {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
