"""SimpleFSDP jit against the alternatives, at equal work, on this machine.

    .venv/bin/python scripts/bench.py [--models tiny,medium,deepseek]
        [--ac full,selective] [--cells simplefsdp:2:full,fsdp2:2:full]
        [--launches 3] [--steps 12] [--threads 1] [--out docs] [trainer overrides...]

For each model (the Llama 3 debug model, the medium Llama of
scripts/bench_recipes.py, the DeepSeek-V3 debug model), with the same seed,
initial weights (drawn per parameter whatever the layout), batches (the
layout-invariant loader on bundled c4_test), dtype (fp32), sequence length and
global batch, and 1 thread per rank, it launches ``./run_train.sh`` as a user
would, on 2 ranks, under each AC policy (``--ac``): full AC, and the recipes'
selective AC (torchtitan's SelectiveAC, every second matmul recomputed, CPU
attention saved):

- ``simplefsdp``: this project's SimpleFSDP jit recipe;
- ``fsdp2``: torchtitan's Trainer with ``fully_shard``, eager;
- ``fsdp2_compiled``: the same with torchtitan's per-block ``torch.compile``
  (``--compile.enable``, inductor, model and loss);
- ``aot_fx_trace``: upstream's GraphTrainer in its default mode and passes,
  its AC the graph policy of the same name (``--compile.memory_policy full``
  or ``eager``; its save list has no CPU attention kernel, so under
  selective AC it recomputes attention and no ratio is printed against it);
  on DeepSeek ``aot_fx_trace_no_dedup``, the same less
  ``deduplicate_fsdp_unshard_chains_pass`` (docs/benchmarks.md);
- ``simplefsdp_no_comm:2``: 2 independent 1-rank runs at once, each at the
  2-rank local batch: the 2-rank step's compute with both cores busy and no
  communication. With the collectives' CPU time per step, measured in the
  same invocation (scripts/bench_ceiling.py), it bounds the 2-rank step
  (``step_vs_bound``);
- ``simplefsdp`` on 1 and 4 ranks (scaling at a fixed global batch); on the
  debug model ``simplefsdp_no_bucketing``, ``simplefsdp_bucketing`` (upstream's
  inductor bucketing pass on top) and ``simplefsdp_aot_eager``; on request
  (``--cells mode:ranks[:ac]``) ``simplefsdp_overlap``,
  ``simplefsdp_no_prefetch``, ``simplefsdp_no_ac``, ``simplefsdp_save_matmuls``
  (``--compile.memory_policy default``) and the ``*_no_reshard`` cells.

Each cell runs ``--launches`` times, a model's cells round by round, so a
drift in the machine's speed moves them alike. Launch 1 of a cell starts from
an empty compile cache (cold), its later ones reuse it (warm). A launch
reports the median step time over steps 3..N (rank 0's log timestamps), the
median tokens/s per rank and MFU from the step lines, its step-1 loss, the
peak of the step line's memory figure over steps 3..N (the rank's peak
resident set, median over warm launches), and the per-rank sharded state.
MFU is against the 1-thread fp32 matmul peak (2048^3 ``torch.mm``, median of
7), read at the start and at the end; the higher reading is the peak.

A ratio compares two cells only at equal work: the same AC policy, and
step-1 losses within 1e-5 relative (the same model on the same data);
otherwise the line says ``refused`` and the reason follows the ratios.

Writes ``<out>/bench.md`` (the table) and ``<out>/bench.png``, and prints a
``key=value`` line per model and policy: ``simplefsdp_vs_<peer>_tokens_per_s_ratio``
and ``simplefsdp_vs_<peer>_memory_ratio`` for each peer, ``fastest_peer`` and
``simplefsdp_vs_fastest_peer``, ``mfu_vs_matmul_peak``, ``mfu_vs_one_rank``,
``mfu_no_comm_vs_one_rank``, ``bound_step_s`` and ``step_vs_bound``,
``warm_vs_cold_first_step``.
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
    # Its cells run with no AC (Cell.ac "none").
    "simplefsdp_no_ac": ("simplefsdp", []),
    # graph_trainer's aot_fx_trace default policy in jit mode: every matmul saved.
    "simplefsdp_save_matmuls": ("simplefsdp", ["--compile.memory_policy", "default"]),
    # Its ranks are independent 1-rank processes (launch_cell).
    NO_COMM: ("simplefsdp", []),
    "fsdp2": ("fsdp2", []),
    # torchtitan's FSDP2 with its per-block torch.compile (model and loss).
    "fsdp2_compiled": ("fsdp2", ["--compile.enable", "--compile.backend", "inductor"]),
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
    cells: list[tuple[str, int, str]]
    extra: list[str] = field(default_factory=list)


# AC policies every peer runs under: full AC (nothing but each block's input
# saved: the comparison free of any save list), and the recipes' selective AC
# (torchtitan's SelectiveAC, every second matmul recomputed, CPU attention
# saved) applied to every peer that takes a module policy.
POLICIES = ("full", "selective")
PEERS = ("fsdp2", "fsdp2_compiled", "aot_fx_trace")
# (mode, ranks, AC): side by side at 2 ranks under each policy; the bound of the
# 2-rank step (its no-communication pair); scaling at 1 and 4 ranks; and on the
# tiny model, what the bucketing pass and the compile backend buy.
SIDE_BY_SIDE = [(mode, 2, ac) for ac in POLICIES for mode in ("simplefsdp", *PEERS)]
BOUND = [(NO_COMM, 2, "selective")]
SCALING = [("simplefsdp", 1, "selective"), ("simplefsdp", 4, "selective")]
VARIANTS = [("simplefsdp_no_bucketing", 2, "selective"), ("simplefsdp_bucketing", 2, "selective"),
            ("simplefsdp_aot_eager", 2, "selective")]

MODELS = {
    "tiny": Model("Llama 3 debug (6.2 M)", 512, 8,
                  (f"{GT}.llama3", "simple_fsdp_llama3_debugmodel"),
                  (BENCH, "llama3_debugmodel_fsdp2"),
                  (BENCH, "graph_trainer_llama3_debugmodel_cpu"),
                  SIDE_BY_SIDE + BOUND + SCALING + VARIANTS),
    "medium": Model("Llama 3 medium (58 M)", 512, 4,
                    (BENCH, "simple_fsdp_llama3_medium"),
                    (BENCH, "llama3_medium_fsdp2"),
                    (BENCH, "graph_trainer_llama3_medium"),
                    SIDE_BY_SIDE + BOUND),
    "deepseek": Model("DeepSeek-V3 debug (MoE)", 256, 4,
                      (f"{GT}.deepseek_v3", "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2"),
                      (BENCH, "deepseek_v3_debugmodel_fsdp2"),
                      (BENCH, "graph_trainer_deepseek_v3_debugmodel_cpu"),
                      [c for c in SIDE_BY_SIDE if c[0] != "aot_fx_trace"]
                      + [("aot_fx_trace_no_dedup", 2, ac) for ac in POLICIES]
                      + BOUND + SCALING[:1],
                      ["--parallelism.tensor_parallel_degree", "1"]),
}


@dataclass
class Cell:
    model: str
    mode: str
    ranks: int
    ac: str  # "full", "selective" or "none"
    launches: list[Run] = field(default_factory=list)
    error: str = ""

    @property
    def key(self) -> tuple[str, str, int, str]:
        return self.model, self.mode, self.ranks, self.ac

    def ok(self) -> list[Run]:
        return [r for r in self.launches if r.returncode == 0 and r.steps]

    def median(self, attribute: str, first: int = 3) -> float:
        return statistics.median(r.median(attribute, first) for r in self.ok())

    def step_s(self) -> list[float]:
        return [statistics.median(r.step_times(3)) for r in self.ok()]

    def memory_gib(self) -> float:
        """The step line's memory figure (the rank's peak resident set, reset
        at every log step) over the timed steps, median over the warm launches:
        a cold launch keeps what compiling took resident."""
        runs = self.ok()[1:] if self.mode != NO_COMM and len(self.ok()) > 1 else self.ok()
        return statistics.median(max(s.memory_gib for s in r.steps[2:] or r.steps)
                                 for r in runs)

    def first_loss(self) -> float:
        """The step-1 loss (every launch of a cell prints the same one)."""
        return self.ok()[0].steps[0].loss

    def state_mib(self) -> tuple[float, float, float] | None:
        match = _STATE.search(self.ok()[0].output)
        return tuple(float(x) for x in match.groups()) if match else None

    def backend(self) -> str:
        # By the recipe the mode runs, so a peer's variants are labelled as it is.
        recipe, args = MODES[self.mode]
        if recipe == "fsdp2":
            return "per block (inductor)" if "--compile.enable" in args else "eager"
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

    def ac_label(self) -> str:
        """The policy the launch logged (graph policies are named by flag)."""
        if MODES[self.mode][0] == "fx":
            # Its memory policy is a graph pass over upstream's save list,
            # which has no CPU attention kernel.
            return {"full": "full (graph)",
                    "selective": "selective (graph, CPU attention recomputed)"}[self.ac]
        if self.mode == "simplefsdp_save_matmuls":
            return "selective, every matmul saved"
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


# The largest relative difference of step-1 losses between cells a ratio
# compares: beyond it they do not train the same model on the same data.
SAME_LOSS = 1e-5


def comparable(a: Cell, b: Cell) -> str:
    """Why ``a`` and ``b`` are not the same work ("" when they are)."""
    if a.ac != b.ac:
        return f"AC {a.ac} against {b.ac}"
    if a.ac == "selective" and "fx" in (MODES[a.mode][0], MODES[b.mode][0]):
        return "aot_fx_trace's selective policy recomputes CPU attention, the others save it"
    la, lb = a.first_loss(), b.first_loss()
    if abs(la - lb) > SAME_LOSS * max(abs(la), abs(lb)):
        return f"step-1 losses {la:.5f} and {lb:.5f} differ by more than {SAME_LOSS:g} relative"
    return ""


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
    if recipe == "fx":
        # Upstream's graph policies: full recompute, or torchtitan's alternation.
        mode_args = [*mode_args, "--compile.memory_policy",
                     "full" if cell.ac == "full" else "eager"]
        subcommands = []
    else:
        # A subcommand goes last on the command line.
        subcommands = [f"activation-checkpoint:{cell.ac}"]
    args = ["--dataloader.dataset", "c4_test", "--hf_assets_path=./tests/assets/tokenizer",
            "--metrics.log_freq", "1", "--debug.seed", "0",
            "--training.mixed_precision_param", "float32",
            "--training.steps", str(steps), "--training.seq_len", str(model.seq_len),
            # The no-communication cell's processes are each one rank of the
            # N-rank run, so their global batch is that rank's share.
            "--training.global_batch_size",
            str(model.global_batch // cell.ranks if cell.mode == NO_COMM else model.global_batch),
            "--training.local_batch_size", str(model.global_batch // cell.ranks),
            *model.extra, *mode_args, *overrides, *subcommands]
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
            print(f"{cell.model} {cell.mode} x{cell.ranks} AC {cell.ac} launch {n + 1}: FAILED "
                  f"(exit {run.returncode}): {cell.error}", flush=True)
            return
        print(f"{cell.model} {cell.mode} x{cell.ranks} AC {cell.ac} launch {n + 1}: first step "
              f"{run.first_step_s():.1f} s, "
              f"step {statistics.median(run.step_times(3)):.3f} s, "
              f"tps/rank {run.median('tps', 3):.0f}, "
              f"mfu {run.median('mfu_pct', 3):.2f}%, "
              f"memory {max(s.memory_gib for s in run.steps):.2f} GiB, "
              f"loss {run.steps[0].loss:.5f} at step 1, {run.steps[-1].loss:.5f} at the last",
              flush=True)


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
    rows = ["| model | mode | ranks | compile | AC | step-1 loss | step (s), median [min, max] | "
            "tokens/s per rank | peak resident memory per rank, warm (GiB) | MFU vs matmul peak | "
            "params / grads / optimizer per rank (MiB) | first step cold / warm (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if not c.ok() or c.error:
            rows.append(f"| {models[c.model].title} | {c.mode} | {c.ranks} | | {c.ac} | | failed: "
                        f"`{c.error}` | | | | | |")
            continue
        steps = c.step_s()
        state = c.state_mib()
        cold, warm = c.cold_warm()
        rows.append(
            f"| {models[c.model].title} | {c.mode} | {c.ranks} | {c.backend()} | {c.ac_label()} | "
            f"{c.first_loss():.5f} | "
            f"{statistics.median(steps):.3f} [{min(steps):.3f}, {max(steps):.3f}] | "
            f"{c.median('tps'):.0f} | {c.memory_gib():.2f} | "
            f"{c.median('mfu_pct') * mfu_scale:.1f}% | "
            + (" / ".join(f"{x:.2f}" for x in state) if state else "n/a")
            + f" | {_fmt(cold, '.1f')} / {_fmt(warm, '.1f')} |")
    return rows


def summary(cells: list[Cell], mfu_scale: float = 1.0,
            comm_cpu_s: dict[str, float] | None = None) -> tuple[list[str], list[str]]:
    """The ``key=value`` lines, one per model and AC policy, and the reasons
    for every ratio refused. A ratio compares SimpleFSDP's 2-rank cell with
    a peer's only at equal work (``comparable``); ``comm_cpu_s`` is each
    model's collectives' CPU time per step, measured in the same invocation
    (bench_ceiling.collectives_seconds), for the bound of the 2-rank step."""
    lines, refusals = [], []
    by = {c.key: c for c in cells if c.ok() and not c.error}
    failed = {c.key for c in cells if not c.ok() or c.error}
    for model in dict.fromkeys(c.model for c in cells):
        for ac in dict.fromkeys(c.ac for c in cells if c.model == model):
            simple = by.get((model, "simplefsdp", 2, ac))
            parts = [f"model={model}", f"ac={ac}"]
            fastest = None
            for peer in [m for m in MODES if MODES[m][0] != "simplefsdp" and "reshard" not in m]:
                other = by.get((model, peer, 2, ac))
                if (model, peer, 2, ac) in failed:
                    parts.append(f"simplefsdp_vs_{peer}_tokens_per_s_ratio=failed")
                if not (simple and other):
                    continue
                why = comparable(simple, other)
                if why:
                    parts.append(f"simplefsdp_vs_{peer}_tokens_per_s_ratio=refused")
                    refusals.append(f"{model}, AC {ac}: no ratio against {peer}: {why}")
                    continue
                tps = other.median("tps")
                parts.append(f"simplefsdp_vs_{peer}_tokens_per_s_ratio="
                             f"{simple.median('tps') / tps:.3f}")
                parts.append(f"simplefsdp_vs_{peer}_memory_ratio="
                             f"{simple.memory_gib() / other.memory_gib():.3f}")
                if fastest is None or tps > fastest.median("tps"):
                    fastest = other
            if fastest is not None:
                parts.append(f"fastest_peer={fastest.mode} simplefsdp_vs_fastest_peer="
                             f"{simple.median('tps') / fastest.median('tps'):.3f}")
            one = by.get((model, "simplefsdp", 1, ac))
            if simple:
                parts.append(f"mfu_vs_matmul_peak={simple.median('mfu_pct') * mfu_scale / 100:.3f}")
            if simple and one:
                # The same model's 1-rank MFU, at the global batch on one process.
                parts.append("mfu_vs_one_rank="
                             f"{simple.median('mfu_pct') / one.median('mfu_pct'):.3f}")
            no_comm = by.get((model, NO_COMM, 2, ac))
            if no_comm and one:
                parts.append("mfu_no_comm_vs_one_rank="
                             f"{no_comm.median('mfu_pct') / one.median('mfu_pct'):.3f}")
            if simple and no_comm and comm_cpu_s and model in comm_cpu_s:
                # The 2-rank step's bound: its compute with both cores busy and
                # no communication, plus the CPU its collectives take.
                bound = statistics.median(no_comm.step_s()) + comm_cpu_s[model]
                parts.append(f"bound_step_s={bound:.3f} step_vs_bound="
                             f"{statistics.median(simple.step_s()) / bound:.3f}")
            if simple:
                cold, warm = simple.cold_warm()
                if warm is not None:
                    parts.append(f"warm_vs_cold_first_step={warm / cold:.3f}")
            # The same with the gathered parameters kept for backward.
            kept = by.get((model, "simplefsdp_no_reshard", 2, ac))
            for peer in ("fsdp2", "aot_fx_trace"):
                other = by.get((model, f"{peer}_no_reshard", 2, ac))
                if kept and other and not comparable(kept, other):
                    parts.append(f"no_reshard_simplefsdp_vs_{peer}_tokens_per_s_ratio="
                                 f"{kept.median('tps') / other.median('tps'):.3f}")
            if len(parts) > 2:
                lines.append(" ".join(parts))
    return lines, refusals


def plot(cells: list[Cell], models: dict[str, Model], path: Path, title: str):
    """Tokens/s per rank for each cell, one panel per model, each bar labelled
    with its tokens/s and step time (medians of the launches); the figure, or
    None when no cell ran or matplotlib is missing (then bench.md alone)."""
    good = [c for c in cells if c.ok() and not c.error]
    if not good:
        return None
    figures = {model: [(f"{c.mode} [AC {c.ac}]", c.ranks,
                        (c.median("tps"), statistics.median(c.step_s()))
                        if c in good else None) for c in cells if c.model == model]
               for model in dict.fromkeys(c.model for c in cells)}
    try:
        return bars(figures, {m: models[m].title for m in figures}, path, title)
    except ImportError as e:
        # A benchmark is tens of minutes of measurements: keep going without the plot.
        print(f"{path} not written: {e}", file=sys.stderr)
        return None


_COLORS = {"simplefsdp": "tab:blue", "fsdp2": "tab:orange", "fsdp2_compiled": "tab:red",
           "aot_fx_trace": "tab:green",
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
            ax.barh(i, tps, color=_COLORS.get(mode.split(" ")[0], "tab:gray"))
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
                        help="mode:ranks[:ac] list, e.g. simplefsdp:2:full,fsdp2:2:full "
                             "(ac full, selective or none; default selective; "
                             "default: every model's own cells)")
    parser.add_argument("--ac", default=",".join(POLICIES),
                        help="the AC policies of the default cells (full,selective)")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--repeats", type=int, default=7,
                        help="repeats of the collectives' timing for the bound")
    parser.add_argument("--out", default=str(REPO / "docs"))
    opts, overrides = parser.parse_known_args()
    names = opts.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    policies = opts.ac.split(",")
    if set(policies) - set(POLICIES):
        parser.error(f"unknown --ac {opts.ac!r}; choose from {', '.join(POLICIES)}")
    wanted = None
    if opts.cells:
        wanted = [parse_cell(c, parser) for c in opts.cells.split(",")]
    if opts.steps < 12:
        parser.error("--steps must be at least 12 (steps 1-2 warm up, 3.. are timed)")

    peak = Peak(matmul_peak_flops())
    print(f"matmul_peak_gflops={peak.start / 1e9:.1f} (fp32, 1 thread, 2048^3, at the start)",
          flush=True)
    started = datetime.datetime.now()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [Cell(name, mode, ranks, ac) for name in names
             for mode, ranks, ac in wanted or MODELS[name].cells
             if wanted or ac not in POLICIES or ac in policies]
    comm_cpu_s: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        # Each cell's compile cache, kept across its launches.
        caches = {id(c): stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-"))
                  for c in cells}

        def launch_one(cell: Cell, n: int) -> None:
            launch_cell(cell, MODELS[cell.model], n, opts.steps, peak.start, overrides,
                        opts.threads, caches[id(cell)])
            # Written after every launch: a long run stopped part-way keeps what it measured.
            write_report([c for c in cells if c.launches], out, started, peak, opts,
                         comm_cpu_s)

        for name in names:
            run_model([c for c in cells if c.model == name], opts.launches, launch_one)
            if any(c.mode == NO_COMM and c.model == name for c in cells):
                comm_cpu_s[name] = collectives_cpu_s(name, opts.repeats)
                print(f"model={name} comm_cpu_s={comm_cpu_s[name]:.3f} (one step's "
                      "collectives, 2 gloo ranks, mean over ranks of the median)", flush=True)
    peak.end = matmul_peak_flops()
    print(f"matmul_peak_gflops={peak.end / 1e9:.1f} (fp32, 1 thread, 2048^3, at the end)")
    rows, lines, refusals = write_report(cells, out, started, peak, opts, comm_cpu_s)
    print()
    print("\n".join(rows))
    print()
    print("\n".join(lines + refusals))
    print(f"wrote {out / 'bench.md'} and {out / 'bench.png'}")
    # A baseline that fails is a row of the table; this project's cells must run.
    return 0 if all(c.ok() and not c.error for c in cells if c.mode.startswith("simplefsdp")) else 1


def parse_cell(text: str, parser) -> tuple[str, int, str]:
    """``mode:ranks[:ac]`` as a cell of the bench."""
    mode, ranks, *ac = text.split(":")
    if mode not in MODES:
        parser.error(f"unknown mode {mode!r} in --cells; choose from {', '.join(MODES)}")
    ac = "none" if mode == "simplefsdp_no_ac" else (ac[0] if ac else "selective")
    if ac not in (*POLICIES, "none"):
        parser.error(f"unknown AC {ac!r} in --cells {text}; choose from full, selective, none")
    if ac == "none" and MODES[mode][0] == "fx":
        parser.error(f"--cells {text}: aot_fx_trace has no policy without AC here")
    return mode, int(ranks), ac


def collectives_cpu_s(name: str, repeats: int) -> float:
    """CPU seconds per rank of one step's collectives of the bucketed
    SimpleFSDP recipe on 2 gloo ranks (scripts/bench_ceiling.py)."""
    from bench_ceiling import collectives_seconds, model_buckets

    return statistics.mean(c for c, _ in collectives_seconds(model_buckets(name), 2, repeats))


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
                 opts, comm_cpu_s: dict[str, float] | None = None
                 ) -> tuple[list[str], list[str], list[str]]:
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    rows = table(cells, MODELS, peak.scale)
    lines, refusals = summary(cells, peak.scale, comm_cpu_s)
    allocator = ranks_allocator()
    machine = (f"{os.cpu_count()} cores ({cpu_description()}), "
               f"{peak.describe()}, every rank on {allocator}")
    (out / "bench.md").write_text(
        f"# Benchmark: SimpleFSDP jit against the alternatives\n\n"
        f"Measured {started:%Y-%m-%d %H:%M} on {machine}; {opts.launches} launches per "
        f"cell, {opts.steps} steps each (median over steps 3..{opts.steps}), fp32, "
        f"{opts.threads} thread(s) per rank, c4_test, seed 0; {minutes:.0f} minutes in all. "
        f"Command: `{' '.join(['scripts/bench.py', *sys.argv[1:]])}`.\n\n"
        f"AC: full recomputes each block from its input; selective is torchtitan's "
        f"SelectiveAC (every second matmul recomputed) with CPU attention saved, in every "
        f"cell but aot_fx_trace's, whose graph policy recomputes CPU attention. A ratio "
        f"compares cells of one policy whose step-1 losses agree within {SAME_LOSS:g} "
        f"relative; the lines after the ratios say why any was refused.\n\n"
        + "\n".join(rows) + "\n\n```\n" + "\n".join(lines + refusals) + "\n```\n")
    plot(cells, MODELS, out / "bench.png",
         f"torchtitan_neuron bench, {started:%Y-%m-%d}, {os.cpu_count()} cores, fp32 matmul "
         f"peak {peak.flops / 1e9:.1f} GFLOP/s on 1 thread, every rank on {allocator}")
    return rows, lines, refusals


if __name__ == "__main__":
    sys.exit(main())
