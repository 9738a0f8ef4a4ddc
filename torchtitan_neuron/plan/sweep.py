"""``--sweep``: plans over TP x AC at the recipe's global batch (its EP and
CP degrees held, and shown), each in its own process (each needs its own
fake world and compile state), and the
smallest change that fits, in the tutorial's order."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from torchtitan_neuron.plan.report import Plan

SWEEP_TP = (1, 2, 4, 8)
SWEEP_AC = ("selective", "full")
_AC_PREFIX = "activation-checkpoint:"


def _layout_args(tp: int, ac: str, global_batch: int,
                 local_batch: int | None = None) -> list[str]:
    args = [f"--parallelism.tensor_parallel_degree={tp}",
            "--parallelism.data_parallel_shard_degree=-1",
            f"--training.global_batch_size={global_batch}"]
    if local_batch is not None:
        args.append(f"--training.local_batch_size={local_batch}")
    # tyro: the AC subcommand comes after every flag.
    return args + [f"{_AC_PREFIX}{ac}"]


def plan_command(opts, *args: str) -> list[str]:
    """``python -m torchtitan_neuron.plan`` for the recipe, ranks and target
    of ``opts``, then ``args``: how the sweep's cells and the shallow traces
    (plan/depth.py) are launched, each in its own process."""
    return [sys.executable, "-m", "torchtitan_neuron.plan", "--module", opts.module,
            "--config", opts.config, f"--ngpu={opts.ngpu}", f"--target={opts.target}", *args]


def start_plan(cmd: list[str]):
    """``cmd`` (a planner command printing one JSON line) started in its own
    process, its output to files so it never waits on a full pipe; returns
    a function that waits for it: (the JSON, None) or (None, its last error
    line)."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err)

    def wait() -> tuple[dict | None, str | None]:
        code = proc.wait()
        out.seek(0)
        err.seek(0)
        lines = [l for l in out.read().splitlines() if l.startswith("{")]
        last = [l for l in err.read().splitlines() if l.strip()][-1:] or ["no output"]
        out.close()
        err.close()
        if code != 0 or not lines:
            return None, last[0][-300:]
        return json.loads(lines[-1]), None

    return wait


def _plan_in_subprocess(opts, overrides: list[str], extra: list[str]) -> dict:
    """One plan in a subprocess; its JSON, or ``{"error": last line}``."""
    user = [a for a in overrides if not a.startswith(_AC_PREFIX)]
    cmd = plan_command(opts, "--json", *user, *extra)
    if opts.capacity_gib is not None:
        cmd.insert(cmd.index("--json"), f"--capacity-gib={opts.capacity_gib}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = [l for l in proc.stderr.splitlines() if l.strip()][-1:] or ["no output"]
        return {"error": last[0][-200:]}
    return json.loads(lines[-1])


def sweep(opts, overrides: list[str], base: Plan) -> list[str]:
    """Table over TP x AC at the recipe's global batch, and the smallest change
    that fits when the recipe as given does not."""
    # Expert, context and pipeline parallel degrees (the recipe's, or the flags') are
    # held in every cell and shown beside TP.
    held = [dim for dim in ("ep", "cp", "pp") if dim in base.layout]
    rows, results = _table(opts, overrides, base.layout["global_batch"], held)
    if base.fits:
        rows.append(f"{opts.config} fits as given ({base.peak_gib:.2f} GiB of {base.capacity_gib:.1f}).")
    else:
        rows.append(_smallest_change(opts, overrides, base, results))
    return rows


def _table(opts, overrides: list[str], gb: int,
           held: list[str] = ()) -> tuple[list[str], dict]:
    extra = "".join(f" {dim:>3}" for dim in held)
    rows = [f"{'tp':>3}{extra} {'dp_shard':>8} {'ac':>9} {'accum':>5} {'peak GiB':>9} "
            f"{'capacity':>8}  verdict"]
    results = {}
    for tp in SWEEP_TP:
        if opts.ngpu % tp:
            continue
        for ac in SWEEP_AC:
            r = _plan_in_subprocess(opts, overrides, _layout_args(tp, ac, gb))
            results[(tp, ac)] = r
            if "error" in r:
                rows.append(f"{tp:>3}{' ' * len(extra)} {'':>8} {ac:>9} {'':>5} {'':>9} "
                            f"{'':>8}  refused: {r['error']}")
                continue
            lay = r["layout"]
            degrees = "".join(f" {lay.get(dim, 1):>3}" for dim in held)
            rows.append(
                f"{tp:>3}{degrees} {lay['dp_shard']:>8} {ac:>9} {lay['grad_accum']:>5} "
                f"{r['peak_gib']:>9.2f} {r['capacity_gib']:>8.1f}  "
                f"{'fits' if r['fits'] else 'OOM'}"
            )
    return rows, results


def _smallest_change(opts, overrides: list[str], base: Plan, results: dict) -> str:
    """The tutorial's order: the full-AC variant, then tensor parallelism,
    then a smaller batch last (the global batch kept by accumulation)."""
    gb = base.layout["global_batch"]
    tp0 = base.layout["tp"]
    candidates = [(tp0, "full")] + [(tp, "full") for tp in SWEEP_TP if tp > tp0 and opts.ngpu % tp == 0]
    for tp, ac in candidates:
        r = results.get((tp, ac)) or _plan_in_subprocess(opts, overrides, _layout_args(tp, ac, gb))
        if r.get("fits"):
            return ("Smallest change that fits: " + " ".join(_layout_args(tp, ac, gb))
                    + f" ({r['peak_gib']:.2f} GiB)")
    tp_max = candidates[-1][0]
    batch = base.layout["local_batch"] // 2
    while batch >= 1:
        r = _plan_in_subprocess(opts, overrides, _layout_args(tp_max, "full", gb, batch))
        if r.get("fits"):
            return ("Smallest change that fits: " + " ".join(_layout_args(tp_max, "full", gb, batch))
                    + f" ({r['peak_gib']:.2f} GiB; the global batch is kept by accumulation)")
        batch //= 2
    return "No layout in the sweep fits: more ranks (--ngpu) or a larger device is needed."
