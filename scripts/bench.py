"""SimpleFSDP jit against the alternatives, side by side, on this machine.

    .venv/bin/python scripts/bench.py [--models tiny,medium,deepseek]
        [--cells simplefsdp:2,fsdp2:2] [--launches 3] [--steps 12]
        [--threads 1] [--out docs] [trainer overrides...]

For each model (the Llama 3 debug model, the medium Llama of
scripts/bench_recipes.py, the DeepSeek-V3 debug model), with the same seed,
data (bundled c4_test), dtype (fp32), sequence length and global batch, and
1 thread per rank, it launches ``./run_train.sh`` as a user would:

- ``simplefsdp``: this project's SimpleFSDP jit recipe, 2 ranks (FSDP2);
- ``fsdp2``: torchtitan's eager Trainer with ``fully_shard``, 2 ranks;
- ``aot_fx_trace``: upstream's GraphTrainer in its default mode, with its
  default passes, 2 ranks;
- ``aot_fx_trace_no_dedup`` (DeepSeek): the same less upstream's
  ``deduplicate_fsdp_unshard_chains_pass``, without which ``aot_fx_trace``
  fails on the fp32 DeepSeek model (docs/benchmarks.md), 2 ranks;
- ``simplefsdp`` on 1 rank (nothing to shard) and on 4 ranks: scaling at a
  fixed global batch (the local batch shrinks as ranks grow);
- on the debug model, ``simplefsdp_no_bucketing`` (one gather per parameter,
  ``--compile.no-bucketing``), ``simplefsdp_bucketing`` (upstream's
  ``transformer_block_bucketing`` inductor pass on top) and
  ``simplefsdp_aot_eager`` (the aot_eager backend instead of inductor): what
  each buys; ``simplefsdp_overlap`` (``--compile.overlap_collectives``,
  inductor's compute/communication reordering), ``simplefsdp_no_prefetch``
  (``--compile.no-prefetch``, each gather where the block starts),
  ``simplefsdp_no_ac`` (``activation-checkpoint:none``, nothing
  recomputed) and ``simplefsdp_no_comm`` on request (``--cells``);
- ``simplefsdp_no_comm:N``: N independent 1-rank runs at once, each at the
  N-rank local batch. Each process does what one rank of the N-rank run
  computes (and the whole optimizer step, where a rank does 1/N of it),
  with every core busy and no communication: the ceiling of the N-rank
  cell's MFU on this machine (``mfu_no_comm_vs_one_rank``).

Each cell runs ``--launches`` times, a model's cells round by round (each
cell's first launch, then each cell's second, ...), so a drift in the
machine's speed moves them alike. Launch 1 of a cell starts from an empty
compile cache (cold first step), its later ones reuse it (warm). A launch reports the
median step time over steps 3..N (rank 0's log timestamps), the median
tokens/s per rank and MFU from the step lines, the peak of the step line's
per-rank memory figure, and the per-rank sharded state (parameters,
gradients, optimizer state). MFU is against the 1-thread fp32 matmul peak
(2048^3 ``torch.mm``, median of 7), read at the start of the run (the ranks
are given it as ``TORCHTITAN_NEURON_CPU_PEAK_FLOPS``) and again at the end:
the higher reading is the peak, and the report rescales the ranks' MFU to it.
A process left running on the machine lowers a reading; when the two differ
by more than 10%, the report says so.

Writes ``<out>/bench.md`` (the tables) and ``<out>/bench.png`` (the plot),
and prints ``key=value`` lines per model: ``simplefsdp_vs_fsdp2_tokens_per_s_ratio``,
``simplefsdp_vs_aot_fx_trace_tokens_per_s_ratio`` (``failed`` when that cell
failed), ``simplefsdp_vs_aot_fx_trace_no_dedup_tokens_per_s_ratio`` (when
that cell ran), ``mfu_vs_matmul_peak``, ``mfu_vs_one_rank`` (2-rank MFU over the same
model's 1-rank MFU), ``mfu_no_comm_vs_one_rank`` (the same for the
``simplefsdp_no_comm:2`` cell, when it ran) and ``warm_vs_cold_first_step``;
with the ``*_no_reshard:2`` cells (``--parallelism.fsdp_reshard_after_forward
never`` in each), ``no_reshard_simplefsdp_vs_fsdp2_tokens_per_s_ratio`` and
``no_reshard_simplefsdp_vs_aot_fx_trace_tokens_per_s_ratio``.
"""

import argparse
import contextlib
import datetime
import os
import platform as host
import re
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from runlog import REPO, Run, launch  # noqa: E402

GT = "torchtitan_neuron.experiments.graph_trainer"
BENCH = "scripts.bench_recipes"
NO_DEDUP = "deduplicate_fsdp_unshard_chains_pass"
NO_COMM = "simplefsdp_no_comm"
NEVER_RESHARD = ["--parallelism.fsdp_reshard_after_forward", "never"]
# The mode of each cell: which recipe of the model, and what it adds.
MODES = {
    "simplefsdp": ("simplefsdp", []),
    "simplefsdp_no_bucketing": ("simplefsdp", ["--compile.no-bucketing"]),
    "simplefsdp_bucketing": ("simplefsdp", ["--compile.passes", "transformer_block_bucketing"]),
    "simplefsdp_aot_eager": ("simplefsdp", ["--compile.backend", "aot_eager"]),
    "simplefsdp_overlap": ("simplefsdp", ["--compile.overlap_collectives"]),
    "simplefsdp_no_prefetch": ("simplefsdp", ["--compile.no-prefetch"]),
    # A subcommand (activation-checkpoint:...) goes last on the command line.
    "simplefsdp_no_ac": ("simplefsdp", ["activation-checkpoint:none"]),
    # torchtitan's eager selective policy: every second matmul recomputed.
    "simplefsdp_eager_sac": ("simplefsdp", ["--compile.memory_policy", "eager"]),
    # Its ranks are independent 1-rank processes (launch_cell).
    NO_COMM: ("simplefsdp", []),
    "fsdp2": ("fsdp2", []),
    "aot_fx_trace": ("fx", []),
    # Upstream's default mode less one pass, which merges an expert weight's
    # fp32 gather into its bf16 copy on fp32 DeepSeek (docs/benchmarks.md).
    "aot_fx_trace_no_dedup": ("fx", ["--compile.disable_passes", NO_DEDUP]),
    # Gathered parameters kept for backward (no re-gather), in each of the three.
    "simplefsdp_no_reshard": ("simplefsdp", NEVER_RESHARD),
    "fsdp2_no_reshard": ("fsdp2", NEVER_RESHARD),
    "aot_fx_trace_no_reshard": ("fx", NEVER_RESHARD),
}
_STATE = re.compile(r"Per-rank sharded state: parameters ([\d.]+) MiB, gradients "
                    r"([\d.]+) MiB, optimizer state ([\d.]+) MiB")
_BACKEND = re.compile(r"compile backend (\w+)")
_AC = re.compile(r"Applied (\w+) activation checkpointing")
# torchtitan logs the policy's class name; AttentionSavingSAC is the recipe's
# SelectiveAC saving CPU attention (torchtitan_neuron.experiments.graph_trainer.activation_checkpoint).
_AC_NAMES = {"FullAC": "full", "SelectiveAC": "selective", "AttentionSavingSAC": "selective"}


@dataclass
class Model:
    title: str
    seq_len: int
    global_batch: int
    simplefsdp: tuple[str, str]
    fsdp2: tuple[str, str]
    fx: tuple[str, str]
    cells: list[tuple[str, int]]
    extra: list[str] = field(default_factory=list)


# (mode, ranks): side by side at 2 ranks; scaling at 1, 2 and 4 ranks; and
# on the tiny model, what the bucketing pass and the compile backend buy.
SIDE_BY_SIDE = [("simplefsdp", 2), ("fsdp2", 2), ("aot_fx_trace", 2)]
SCALING = [("simplefsdp", 1), ("simplefsdp", 4)]
VARIANTS = [("simplefsdp_no_bucketing", 2), ("simplefsdp_bucketing", 2),
            ("simplefsdp_aot_eager", 2)]

MODELS = {
    "tiny": Model("Llama 3 debug (6.2 M)", 512, 8,
                  (f"{GT}.llama3", "simple_fsdp_llama3_debugmodel"),
                  ("torchtitan_neuron.models.llama3", "llama3_debugmodel_neuron"),
                  (BENCH, "graph_trainer_llama3_debugmodel_cpu"),
                  SIDE_BY_SIDE + SCALING + VARIANTS),
    "medium": Model("Llama 3 medium (58 M)", 512, 4,
                    (BENCH, "simple_fsdp_llama3_medium"),
                    (BENCH, "llama3_medium_fsdp2"),
                    (BENCH, "graph_trainer_llama3_medium"),
                    SIDE_BY_SIDE),
    "deepseek": Model("DeepSeek-V3 debug (MoE)", 256, 4,
                      (f"{GT}.deepseek_v3", "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2"),
                      ("torchtitan_neuron.models.deepseek_v3",
                       "deepseek_v3_debugmodel_neuron_tp2_fsdp2"),
                      (BENCH, "graph_trainer_deepseek_v3_debugmodel_cpu"),
                      SIDE_BY_SIDE + SCALING[:1] + [("aot_fx_trace_no_dedup", 2)],
                      ["--parallelism.tensor_parallel_degree", "1"]),
}


@dataclass
class Cell:
    model: str
    mode: str
    ranks: int
    launches: list[Run] = field(default_factory=list)
    error: str = ""

    def ok(self) -> list[Run]:
        return [r for r in self.launches if r.returncode == 0 and r.steps]

    def median(self, attribute: str, first: int = 3) -> float:
        return statistics.median(r.median(attribute, first) for r in self.ok())

    def step_s(self) -> list[float]:
        return [statistics.median(r.step_times(3)) for r in self.ok()]

    def memory_gib(self) -> float:
        return max(s.memory_gib for r in self.ok() for s in r.steps)

    def state_mib(self) -> tuple[float, float, float] | None:
        match = _STATE.search(self.ok()[0].output)
        return tuple(float(x) for x in match.groups()) if match else None

    def backend(self) -> str:
        # By the recipe the mode runs, so a peer's variants are labelled as it is.
        recipe, args = MODES[self.mode]
        if recipe == "fsdp2":
            return "eager"
        if recipe == "fx":
            return "aot_fx_trace (aot_eager)" + (f" without {NO_DEDUP}" if NO_DEDUP in args else "")
        match = _BACKEND.search(self.ok()[0].output)
        backend = "aot_eager" if self.mode.endswith("aot_eager") else (match[1] if match else "?")
        if self.mode == "simplefsdp_no_bucketing":
            return f"jit ({backend}), per-parameter gathers"
        if self.mode == "simplefsdp_overlap":
            return f"jit ({backend}), collectives reordered"
        if self.mode == "simplefsdp_no_prefetch":
            return f"jit ({backend}), not prefetched"
        if self.mode == NO_COMM:
            return f"jit ({backend}), {self.ranks} independent 1-rank processes at once"
        return f"jit ({backend})" + (" + inductor bucketing" if "bucketing" in self.mode else "")

    def ac(self) -> str:
        if MODES[self.mode][0] == "fx":
            # Its memory policy is a graph pass, not a module wrapper.
            return "selective (graph)"
        match = _AC.search(self.ok()[0].output)
        return _AC_NAMES.get(match[1], match[1]) if match else "none"

    def cold_warm(self) -> tuple[float, float | None]:
        if self.mode == NO_COMM:
            # Its processes compile side by side: no cold/warm pair to read.
            return float("nan"), None
        firsts = [r.first_step_s() for r in self.ok()]
        if self.launches[0] not in self.ok():
            return float("nan"), None
        return firsts[0], (statistics.median(firsts[1:]) if len(firsts) > 1 else None)


def matmul_peak_flops() -> float:
    import torch

    from torchtitan_neuron.devices.cpu import measure_matmul_flops

    torch.set_num_threads(1)
    return measure_matmul_flops(torch.float32, n=2048, repeats=7)


@dataclass
class Peak:
    """The matmul peak of a run: read at its start (the figure the ranks were
    given) and at its end; the higher reading is the peak."""
    start: float
    end: float | None = None

    @property
    def flops(self) -> float:
        return max(self.start, self.end or 0.0)

    @property
    def scale(self) -> float:
        """Multiplies an MFU the ranks computed against ``start``."""
        return self.start / self.flops

    def describe(self) -> str:
        text = f"fp32 matmul peak {self.flops / 1e9:.1f} GFLOP/s on 1 thread"
        if self.end is None:
            return text + " (read at the start)"
        text += f" (read {self.start / 1e9:.1f} at the start, {self.end / 1e9:.1f} at the end"
        low = min(self.start, self.end) / self.flops
        if low < 0.9:
            text += (f"; the lower reading is {low:.0%} of the higher: something else was "
                     f"running on the machine during it, or the machine's speed changed")
        return text + ")"


def launch_cell(cell: Cell, model: Model, n: int, steps: int, peak: float,
                overrides: list[str], threads: int, tmp: str) -> None:
    """Launch ``cell`` once more (its launch ``n``, from 0), with its compile
    cache in ``tmp``: empty at launch 0 (cold), its own earlier launches'
    after (warm). A failed launch sets ``cell.error``."""
    recipe, mode_args = MODES[cell.mode]
    module, config = getattr(model, recipe)
    subcommands = [a for a in mode_args if a.startswith("activation-checkpoint:")]
    args = ["--dataloader.dataset", "c4_test", "--hf_assets_path=./tests/assets/tokenizer",
            "--metrics.log_freq", "1", "--debug.seed", "0",
            "--training.mixed_precision_param", "float32",
            "--training.steps", str(steps), "--training.seq_len", str(model.seq_len),
            # The no-communication cell's processes are each one rank of the
            # N-rank run, so their global batch is that rank's share.
            "--training.global_batch_size",
            str(model.global_batch // cell.ranks if cell.mode == NO_COMM else model.global_batch),
            "--training.local_batch_size", str(model.global_batch // cell.ranks),
            *model.extra, *(a for a in mode_args if a not in subcommands), *overrides,
            *subcommands]
    env = {"OMP_NUM_THREADS": str(threads), "TORCHTITAN_NEURON_CPU_PEAK_FLOPS": f"{peak:.6e}",
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "compile-cache")}
    # The no-communication cell: its ranks as 1-rank processes, started together.
    copies, ngpu = (cell.ranks, 1) if cell.mode == NO_COMM else (1, cell.ranks)
    with ThreadPoolExecutor(copies) as pool:
        runs = list(pool.map(
            lambda k: launch(args, ngpu=ngpu, module=module, config=config, env=env,
                             dump_folder=Path(tmp) / f"out{n}-{k}"), range(copies)))
    for run in runs:
        cell.launches.append(run)
        if run.returncode != 0 or not run.steps:
            lines = [l for l in run.output.splitlines() if "Error" in l or "error" in l]
            cell.error = (lines[-1] if lines else run.tail(300)).strip()[:300]
            print(f"{cell.model} {cell.mode} x{cell.ranks} launch {n + 1}: FAILED "
                  f"(exit {run.returncode}): {cell.error}", flush=True)
            return
        print(f"{cell.model} {cell.mode} x{cell.ranks} launch {n + 1}: first step "
              f"{run.first_step_s():.1f} s, "
              f"step {statistics.median(run.step_times(3)):.3f} s, "
              f"tps/rank {run.median('tps', 3):.0f}, "
              f"mfu {run.median('mfu_pct', 3):.2f}%, "
              f"memory {max(s.memory_gib for s in run.steps):.2f} GiB, "
              f"loss {run.steps[-1].loss:.4f}", flush=True)


def run_model(cells: list[Cell], launches: int, launch_one) -> None:
    """Launch each of one model's cells ``launches`` times, round by round: every
    cell's first launch, then every cell's second, and so on, so a drift in the
    machine's speed during the run moves every cell alike instead of the cells
    that happened to run late. A cell that failed is not launched again.
    ``launch_one(cell, n)`` launches a cell once."""
    for n in range(launches):
        for cell in cells:
            if not cell.error:
                launch_one(cell, n)


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def table(cells: list[Cell], models: dict[str, Model], mfu_scale: float = 1.0) -> list[str]:
    """The rows of bench.md; ``mfu_scale`` converts the ranks' MFU to the
    peak the report uses (``Peak.scale``)."""
    rows = ["| model | mode | ranks | compile | AC | step (s), median [min, max] | "
            "tokens/s per rank | MFU vs matmul peak | peak memory per rank (GiB) | "
            "params / grads / optimizer per rank (MiB) | first step cold / warm (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if not c.ok() or c.error:
            rows.append(f"| {models[c.model].title} | {c.mode} | {c.ranks} | | | failed: "
                        f"`{c.error}` | | | | | |")
            continue
        steps = c.step_s()
        state = c.state_mib()
        cold, warm = c.cold_warm()
        rows.append(
            f"| {models[c.model].title} | {c.mode} | {c.ranks} | {c.backend()} | {c.ac()} | "
            f"{statistics.median(steps):.3f} [{min(steps):.3f}, {max(steps):.3f}] | "
            f"{c.median('tps'):.0f} | {c.median('mfu_pct') * mfu_scale:.1f}% | "
            f"{c.memory_gib():.2f} | "
            + (" / ".join(f"{x:.2f}" for x in state) if state else "n/a")
            + f" | {_fmt(cold, '.1f')} / {_fmt(warm, '.1f')} |")
    return rows


def summary(cells: list[Cell], mfu_scale: float = 1.0) -> list[str]:
    lines = []
    by = {(c.model, c.mode, c.ranks): c for c in cells if c.ok() and not c.error}
    failed = {(c.model, c.mode, c.ranks) for c in cells if not c.ok() or c.error}
    for model in dict.fromkeys(c.model for c in cells):
        simple, fsdp2 = by.get((model, "simplefsdp", 2)), by.get((model, "fsdp2", 2))
        fx, one = by.get((model, "aot_fx_trace", 2)), by.get((model, "simplefsdp", 1))
        parts = [f"model={model}"]
        if simple and fsdp2:
            parts.append("simplefsdp_vs_fsdp2_tokens_per_s_ratio="
                         f"{simple.median('tps') / fsdp2.median('tps'):.3f}")
        if simple and fx:
            parts.append("simplefsdp_vs_aot_fx_trace_tokens_per_s_ratio="
                         f"{simple.median('tps') / fx.median('tps'):.3f}")
        elif (model, "aot_fx_trace", 2) in failed:
            parts.append("simplefsdp_vs_aot_fx_trace_tokens_per_s_ratio=failed")
        no_dedup = by.get((model, "aot_fx_trace_no_dedup", 2))
        if simple and no_dedup:
            parts.append("simplefsdp_vs_aot_fx_trace_no_dedup_tokens_per_s_ratio="
                         f"{simple.median('tps') / no_dedup.median('tps'):.3f}")
        if simple:
            parts.append(f"mfu_vs_matmul_peak={simple.median('mfu_pct') * mfu_scale / 100:.3f}")
        if simple and one:
            # The same model's 1-rank MFU, at the global batch on one process.
            parts.append("mfu_vs_one_rank="
                         f"{simple.median('mfu_pct') / one.median('mfu_pct'):.3f}")
        no_comm = by.get((model, NO_COMM, 2))
        if no_comm and one:
            # What the 2-rank cell's compute reaches with both cores busy and
            # no communication, against the same 1-rank MFU.
            parts.append("mfu_no_comm_vs_one_rank="
                         f"{no_comm.median('mfu_pct') / one.median('mfu_pct'):.3f}")
        if simple:
            cold, warm = simple.cold_warm()
            if warm is not None:
                parts.append(f"warm_vs_cold_first_step={warm / cold:.3f}")
        # The same three with the gathered parameters kept for backward.
        kept = by.get((model, "simplefsdp_no_reshard", 2))
        for peer in ("fsdp2", "aot_fx_trace"):
            other = by.get((model, f"{peer}_no_reshard", 2))
            if kept and other:
                parts.append(f"no_reshard_simplefsdp_vs_{peer}_tokens_per_s_ratio="
                             f"{kept.median('tps') / other.median('tps'):.3f}")
        lines.append(" ".join(parts))
    return lines


def plot(cells: list[Cell], models: dict[str, Model], path: Path, title: str):
    """Tokens/s per rank for each cell, one panel per model, each bar labelled
    with its tokens/s and step time (medians of the launches); the figure, or
    None when no cell ran or matplotlib is missing (then bench.md alone)."""
    good = [c for c in cells if c.ok() and not c.error]
    if not good:
        return None
    figures = {model: [(c.mode, c.ranks, (c.median("tps"), statistics.median(c.step_s()))
                        if c in good else None) for c in cells if c.model == model]
               for model in dict.fromkeys(c.model for c in cells)}
    try:
        return bars(figures, {m: models[m].title for m in figures}, path, title)
    except ImportError as e:
        # A benchmark is tens of minutes of measurements: keep going without the plot.
        print(f"{path} not written: {e}", file=sys.stderr)
        return None


_COLORS = {"simplefsdp": "tab:blue", "fsdp2": "tab:orange", "aot_fx_trace": "tab:green",
           "simplefsdp_bucketing": "tab:purple", "simplefsdp_aot_eager": "tab:brown",
           "simplefsdp_no_bucketing": "tab:cyan"}


def bars(figures: dict[str, list[tuple[str, int, tuple[float, float] | None]]],
         titles: dict[str, str], path: Path, title: str):
    """Draw ``{model: [(mode, ranks, (tokens/s per rank, step s) or None
    when it failed)]}`` into ``path``: horizontal bars, one panel per model,
    each on its own scale (the models' throughputs differ tenfold)."""
    from plot_run import agg_figure

    rows = [len(cells) for cells in figures.values()]
    fig = agg_figure(figsize=(10, 0.4 * sum(rows) + 0.9 * len(rows) + 0.8),
                     layout="constrained")
    axes = fig.subplots(len(rows), 1, squeeze=False, height_ratios=rows)[:, 0]
    for ax, (model, cells) in zip(axes, figures.items()):
        y = range(len(cells))
        ax.set_yticks(y, [f"{mode}, {ranks} rank{'s' if ranks > 1 else ''}"
                          for mode, ranks, _ in cells])
        top = max((f[0] for _, _, f in cells if f), default=1.0)
        for i, (mode, _, measured) in zip(y, cells):
            if measured is None:
                ax.text(0, i, " failed", va="center", color="tab:red")
                continue
            tps, step_s = measured
            ax.barh(i, tps, color=_COLORS.get(mode, "tab:gray"))
            ax.text(tps + top * 0.01, i, f"{tps:.0f} tokens/s, {step_s:.2f} s/step",
                    va="center", fontsize=9)
        ax.set_xlim(0, top * 1.35)  # room for the labels right of the bars
        ax.invert_yaxis()  # the first cell on top, as in bench.md
        ax.set_title(titles[model], loc="left", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("tokens/s per rank (median of launches)")
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=100)
    return fig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,medium,deepseek")
    parser.add_argument("--cells", default=None,
                        help="mode:ranks list, e.g. simplefsdp:2,fsdp2:2 (default: all)")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--out", default=str(REPO / "docs"))
    opts, overrides = parser.parse_known_args()
    names = opts.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    wanted = None
    if opts.cells:
        wanted = [(m, int(r)) for m, r in (c.split(":") for c in opts.cells.split(","))]
        bad = [m for m, _ in wanted if m not in MODES]
        if bad:
            parser.error(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    if opts.steps < 12:
        parser.error("--steps must be at least 12 (steps 1-2 warm up, 3.. are timed)")

    peak = Peak(matmul_peak_flops())
    print(f"matmul_peak_gflops={peak.start / 1e9:.1f} (fp32, 1 thread, 2048^3, at the start)",
          flush=True)
    started = datetime.datetime.now()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [Cell(name, mode, ranks) for name in names
             for mode, ranks in wanted or MODELS[name].cells]
    with contextlib.ExitStack() as stack:
        # Each cell's compile cache, kept across its launches.
        caches = {id(c): stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-"))
                  for c in cells}

        def launch_one(cell: Cell, n: int) -> None:
            launch_cell(cell, MODELS[cell.model], n, opts.steps, peak.start, overrides,
                        opts.threads, caches[id(cell)])
            # Written after every launch: a long run stopped part-way keeps what it measured.
            write_report([c for c in cells if c.launches], out, started, peak, opts)

        for name in names:
            run_model([c for c in cells if c.model == name], opts.launches, launch_one)
    peak.end = matmul_peak_flops()
    print(f"matmul_peak_gflops={peak.end / 1e9:.1f} (fp32, 1 thread, 2048^3, at the end)")
    rows, lines = write_report(cells, out, started, peak, opts)
    print()
    print("\n".join(rows))
    print()
    print("\n".join(lines))
    print(f"wrote {out / 'bench.md'} and {out / 'bench.png'}")
    # A baseline that fails is a row of the table; this project's cells must run.
    return 0 if all(c.ok() and not c.error for c in cells if c.mode.startswith("simplefsdp")) else 1


def ranks_allocator(environ=os.environ) -> str:
    """What run_train.sh's launcher gives every cell's ranks
    (``torchtitan_neuron.devices.cpu_allocator``)."""
    from torchtitan_neuron.devices.cpu_allocator import rank_environment

    preload = rank_environment(environ).get("LD_PRELOAD", environ.get("LD_PRELOAD", ""))
    return "jemalloc" if "jemalloc" in preload else "glibc malloc"


def cpu_description() -> str:
    """The CPU's model name and its widest vector units, which set the matmul
    peak: it has differed by 2x between machines here."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return host.processor() or host.machine()
    name = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = set((re.search(r"^flags\s*:\s*(.+)$", info, re.M) or [None, ""])[1].split())
    units = [u for u in ("avx2", "avx512f", "amx_tile") if u in flags]
    return ", ".join([name[1].strip() if name else host.machine(), *units])


def write_report(cells: list[Cell], out: Path, started: datetime.datetime, peak: Peak,
                 opts) -> tuple[list[str], list[str]]:
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    rows, lines = table(cells, MODELS, peak.scale), summary(cells, peak.scale)
    allocator = ranks_allocator()
    machine = (f"{os.cpu_count()} cores ({cpu_description()}), "
               f"{peak.describe()}, every rank on {allocator}")
    (out / "bench.md").write_text(
        f"# Benchmark: SimpleFSDP jit against the alternatives\n\n"
        f"Measured {started:%Y-%m-%d %H:%M} on {machine}; {opts.launches} launches per "
        f"cell, {opts.steps} steps each (median over steps 3..{opts.steps}), fp32, "
        f"{opts.threads} thread(s) per rank, c4_test, seed 0; {minutes:.0f} minutes in all. "
        f"Command: `{' '.join(['scripts/bench.py', *sys.argv[1:]])}`.\n\n"
        + "\n".join(rows) + "\n\n```\n" + "\n".join(lines) + "\n```\n")
    plot(cells, MODELS, out / "bench.png",
         f"torchtitan_neuron bench, {started:%Y-%m-%d}, {os.cpu_count()} cores, fp32 matmul "
         f"peak {peak.flops / 1e9:.1f} GFLOP/s on 1 thread, every rank on {allocator}")
    return rows, lines


if __name__ == "__main__":
    sys.exit(main())
