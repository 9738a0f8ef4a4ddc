"""The benchmark's reading of a run: step lines, timings, ratios.

Proves, on a log written the way torchtitan writes it (ANSI colours, the
thousands separator in tps): scripts/runlog.py reads each step's time, loss,
memory, tokens/s and MFU, the first step from "Training starts", and the
step times; scripts/bench.py turns launches into the median of per-launch
medians, the cold/warm first step, the sharded state, and the ratio lines
(SimpleFSDP over FSDP2 tokens/s, MFU as a fraction of the matmul peak, the
peak the higher of its readings at the start and the end),
and bench.png: one panel per model, a bar per cell labelled with spaces
intact, its tokens/s and step time, a failed cell said so.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_bench.py -q
"""

import datetime

import pytest

import bench  # scripts/, on sys.path through conftest
import runlog
from runlog import Run, strip_ansi

_LINE = ("[rank0]:[titan] {stamp} - root - INFO - \x1b[31mstep: {step:2}  "
         "\x1b[32mloss: {loss:.5f}  \x1b[38;2;180;60;0mgrad_norm:  0.5000  "
         "\x1b[38;2;54;234;195mmemory:  {mem:.2f}GiB(9.00%)  \x1b[34mtps: {tps:,}  "
         "\x1b[36mtflops: 0.02  \x1b[35mmfu: {mfu:.2f}%\x1b[39m")
_START = datetime.datetime(2026, 11, 30, 10, 0, 0)


def _stamp(seconds: float) -> str:
    t = _START + datetime.timedelta(seconds=seconds)
    return f"{t:%Y-%m-%d %H:%M:%S},{t.microsecond // 1000:03d}"


def _log(first_step_s: float, step_s: list[float], tps: list[int], mfu: float,
         state: str = "", loss: float = 8.0) -> Run:
    lines = [f"[rank0]:[titan] {_stamp(0)} - root - INFO - Training starts at step 1"]
    t = first_step_s
    for n, dt in enumerate([0.0, *step_s], start=1):
        t += dt
        lines.append(_LINE.format(stamp=_stamp(t), step=n, loss=loss - n / 10,
                                  mem=1.0 + n / 100, tps=tps[n - 1], mfu=mfu))
    if state:
        lines.append(f"[rank0]:[titan] {_stamp(t + 0.1)} - root - INFO - {state}")
    return Run(0, strip_ansi("\n".join(lines)), 1.0)


def test_runlog_reads_step_lines_and_times():
    run = _log(12.5, [2.0, 1.0, 1.5, 1.25], [900, 1100, 1200, 1300, 1250], 21.5)
    assert [s.step for s in run.steps] == [1, 2, 3, 4, 5]
    assert run.steps[2].tps == 1200 and run.steps[0].memory_gib == 1.01
    assert run.steps[4].loss == pytest.approx(7.5)
    assert run.first_step_s() == pytest.approx(12.5)
    assert run.step_times(3) == pytest.approx([1.0, 1.5, 1.25])
    assert run.median("tps", 3) == 1250
    assert run.median("mfu_pct", 3) == 21.5


def test_cells_take_the_median_of_launches_and_print_the_ratios():
    state = "Per-rank sharded state: parameters 11.76 MiB, gradients 11.76 MiB, optimizer state 23.51 MiB"
    simple = bench.Cell("tiny", "simplefsdp", 2, "selective", [
        _log(90.0, [1.0, 1.0, 1.0], [1000, 1000, 1000, 1000], 30.0, state),  # cold
        _log(10.0, [1.2, 1.2, 1.2], [900, 900, 900, 900], 27.0, state),
        _log(12.0, [0.8, 0.8, 0.8], [1100, 1100, 1100, 1100], 33.0, state),
    ])
    fsdp2 = bench.Cell("tiny", "fsdp2", 2, "selective", [
        _log(5.0, [1.25, 1.25, 1.25], [800, 800, 800, 800], 24.0, state)])
    assert simple.step_s() == pytest.approx([1.0, 1.2, 0.8])
    assert simple.median("tps") == 1000
    assert simple.cold_warm() == pytest.approx((90.0, 11.0))
    assert simple.state_mib() == (11.76, 11.76, 23.51)
    assert simple.memory_gib() == pytest.approx(1.04)
    assert simple.first_loss() == pytest.approx(7.9)
    [line], refusals = bench.summary([simple, fsdp2])
    assert line == ("model=tiny ac=selective simplefsdp_vs_fsdp2_tokens_per_s_ratio=1.250 "
                    "simplefsdp_vs_fsdp2_memory_ratio=1.000 fastest_peer=fsdp2 "
                    "simplefsdp_vs_fastest_peer=1.250 "
                    "mfu_vs_matmul_peak=0.300 warm_vs_cold_first_step=0.122") and not refusals
    one = bench.Cell("tiny", "simplefsdp", 1, "selective", [
        _log(5.0, [0.5, 0.5, 0.5], [2000, 2000, 2000, 2000], 40.0, state)])
    compiled = bench.Cell("tiny", "fsdp2_compiled", 2, "selective", [
        _log(5.0, [0.8, 0.8, 0.8], [1250, 1250, 1250, 1250], 35.0, state)])
    [line], _ = bench.summary([simple, fsdp2, one, compiled])
    assert line == ("model=tiny ac=selective simplefsdp_vs_fsdp2_tokens_per_s_ratio=1.250 "
                    "simplefsdp_vs_fsdp2_memory_ratio=1.000 "
                    "simplefsdp_vs_fsdp2_compiled_tokens_per_s_ratio=0.800 "
                    "simplefsdp_vs_fsdp2_compiled_memory_ratio=1.000 "
                    "fastest_peer=fsdp2_compiled simplefsdp_vs_fastest_peer=0.800 "
                    "mfu_vs_matmul_peak=0.300 mfu_vs_one_rank=0.750 "
                    "warm_vs_cold_first_step=0.122")
    # No ratio between cells that do not do the same work: another step-1
    # loss (another model or other data), another policy, or aot_fx_trace's
    # selective graph policy, which recomputes CPU attention.
    other_data = bench.Cell("tiny", "fsdp2", 2, "selective", [
        _log(5.0, [1.25] * 3, [800] * 4, 24.0, state, loss=8.001)])
    fx = bench.Cell("tiny", "aot_fx_trace", 2, "selective", [
        _log(5.0, [1.25] * 3, [800] * 4, 24.0, state)])
    [line], refusals = bench.summary([simple, other_data, fx])
    assert ("simplefsdp_vs_fsdp2_tokens_per_s_ratio=refused "
            "simplefsdp_vs_aot_fx_trace_tokens_per_s_ratio=refused") in line
    assert "fastest_peer" not in line
    assert refusals == [
        "tiny, AC selective: no ratio against fsdp2: step-1 losses 7.90000 and 7.90100 "
        "differ by more than 1e-05 relative",
        "tiny, AC selective: no ratio against aot_fx_trace: aot_fx_trace's selective policy "
        "recomputes CPU attention, the others save it"]
    assert bench.comparable(simple, bench.Cell("tiny", "fsdp2", 2, "full", fsdp2.launches)) \
        == "AC selective against full"
    # Under full AC aot_fx_trace does the same work: a ratio, on its own line.
    full = [bench.Cell("tiny", mode, 2, "full", [_log(5.0, [1.0] * 3, [tps] * 4, 30.0, state)])
            for mode, tps in (("simplefsdp", 1100), ("aot_fx_trace", 1000))]
    lines, refusals = bench.summary([simple, fsdp2, *full])
    assert lines[1].startswith("model=tiny ac=full simplefsdp_vs_aot_fx_trace_tokens_per_s_ratio="
                               "1.100 ") and not refusals
    no_comm = bench.Cell("tiny", "simplefsdp_no_comm", 2, "selective", [
        _log(9.0, [0.9] * 3, [1100] * 4, 38.0, state),
        _log(9.5, [0.9] * 3, [1100] * 4, 36.0, state)])
    assert bench.summary([simple, one, no_comm])[0][0].endswith(
        "mfu_vs_one_rank=0.750 mfu_no_comm_vs_one_rank=0.925 warm_vs_cold_first_step=0.122")
    # The bound: the no-communication pair's step plus the collectives' CPU time.
    assert "bound_step_s=1.000 step_vs_bound=1.000" in bench.summary(
        [simple, no_comm], comm_cpu_s={"tiny": 0.1})[0][0]
    # The three kept-gathers cells give their own pair of ratios.
    kept = {mode: bench.Cell("tiny", f"{mode}_no_reshard", 2, "selective", [
        _log(5.0, [1.0] * 3, [tps] * 4, 30.0, state)])
        for mode, tps in (("simplefsdp", 1200), ("fsdp2", 1000))}
    assert bench.summary([simple, *kept.values()])[0][0].endswith(
        "no_reshard_simplefsdp_vs_fsdp2_tokens_per_s_ratio=1.200")
    assert bench.MODES["fsdp2_no_reshard"] == (
        "fsdp2", ["--parallelism.fsdp_reshard_after_forward", "never"])
    # Its processes compile side by side: no cold/warm pair.
    assert "| n/a / n/a |" in bench.table([no_comm], bench.MODELS)[2]
    broken = bench.Cell("tiny", "aot_fx_trace", 2, "full", [Run(1, "RuntimeError: boom", 1.0)],
                        error="RuntimeError: boom")
    assert "simplefsdp_vs_aot_fx_trace_tokens_per_s_ratio=failed" in bench.summary(
        [*full[:1], broken])[0][0]
    assert bench.MODES["aot_fx_trace_no_dedup"] == (
        "fx", ["--compile.disable_passes", "deduplicate_fsdp_unshard_chains_pass"])
    assert ("aot_fx_trace_no_dedup", 2, "full") in bench.MODELS["deepseek"].cells
    # Every model runs every peer under both policies, and the bound's pair.
    for model in bench.MODELS.values():
        for ac in bench.POLICIES:
            assert {m for m, r, a in model.cells if r == 2 and a == ac} >= {
                "simplefsdp", "fsdp2", "fsdp2_compiled"}
        assert (bench.NO_COMM, 2, "selective") in model.cells
    # A peer's variants are labelled by the recipe they run, not read from its log.
    labels = {mode: bench.Cell("tiny", mode, 2, "full").backend() for mode in (
        "fsdp2", "fsdp2_compiled", "fsdp2_no_reshard", "aot_fx_trace", "aot_fx_trace_no_dedup")}
    assert labels == {
        "fsdp2": "eager", "fsdp2_compiled": "per block (inductor)", "fsdp2_no_reshard": "eager",
        "aot_fx_trace": "aot_fx_trace (aot_eager)",
        "aot_fx_trace_no_dedup":
            "aot_fx_trace (aot_eager) without deduplicate_fsdp_unshard_chains_pass"}
    assert bench.Cell("tiny", "aot_fx_trace", 2, "selective").ac_label() \
        == "selective (graph, CPU attention recomputed)"
    # The AC column names the policy as the recipe's config does.
    for logged, shown in (("AttentionSavingSAC", "selective"), ("SelectiveAC", "selective"),
                          ("FullAC", "full")):
        run = _log(5.0, [1.0] * 3, [800] * 4, 30.0,
                   f"Applied {logged} activation checkpointing to the model")
        assert bench.Cell("tiny", "simplefsdp", 2, "full", [run]).ac_label() == shown
    assert bench.Cell("tiny", "simplefsdp", 2, "none",
                      [_log(5.0, [1.0] * 3, [800] * 4, 30.0)]).ac_label() == "none"
    rows = bench.table([simple, fsdp2], bench.MODELS)
    assert ("| 7.90000 | 1.000 [0.800, 1.200] | 1000 | 1.04 | 30.0% | 11.76 / 11.76 / 23.51 "
            "| 90.0 / 11.0 |") in rows[2]
    failed = bench.Cell("tiny", "aot_fx_trace", 2, "full", [Run(1, "RuntimeError: boom", 1.0)],
                        error="RuntimeError: boom")
    assert "failed: `RuntimeError: boom`" in bench.table([failed], bench.MODELS)[2]


def test_mfu_is_against_the_higher_of_the_two_peak_readings():
    """A peak read while something else ran is low and would put MFU above
    100%: the report takes the higher of the start and end readings, rescales
    the ranks' MFU (computed against the start reading) to it, and says when
    the readings disagree."""
    simple = bench.Cell("tiny", "simplefsdp", 2, "selective",
                        [_log(90.0, [1.0] * 3, [1000] * 4, 120.0)])
    one = bench.Cell("tiny", "simplefsdp", 1, "selective",
                     [_log(9.0, [1.0] * 3, [2000] * 4, 150.0)])
    peak = bench.Peak(start=50e9)
    assert peak.scale == 1.0 and peak.describe().endswith("(read at the start)")
    peak.end = 100e9
    assert peak.flops == 100e9 and peak.scale == 0.5
    [line], _ = bench.summary([simple, one], peak.scale)
    # Against the peak the ranks were given, against the higher one; the
    # ratio of two MFUs of one run does not move.
    assert "mfu_vs_matmul_peak=0.600 mfu_vs_one_rank=0.800" in line
    assert "| 1000 | 1.04 | 60.0% |" in bench.table([simple], bench.MODELS, peak.scale)[2]
    assert peak.describe() == (
        "fp32 matmul peak 100.0 GFLOP/s on 1 thread (read 50.0 at the start, 100.0 at the "
        "end; the lower reading is 50% of the higher: something else was running on the "
        "machine during it, or the machine's speed changed)")
    # Readings within 10% of each other: no warning, the higher one is used.
    steady = bench.Peak(start=100e9, end=95e9)
    assert steady.scale == 1.0 and steady.describe() == (
        "fp32 matmul peak 100.0 GFLOP/s on 1 thread (read 100.0 at the start, 95.0 at the end)")


def test_plot_draws_a_panel_per_model_with_readable_labels(tmp_path):
    cells = [
        bench.Cell("tiny", "simplefsdp", 2, "full",
                   [_log(10.0, [1.0, 1.0, 1.0], [1000] * 4, 30.0)]),
        bench.Cell("tiny", "aot_fx_trace", 2, "full", [Run(1, "RuntimeError: boom", 1.0)],
                   error="RuntimeError: boom"),
        bench.Cell("medium", "fsdp2", 1, "selective",
                   [_log(5.0, [2.0, 2.0, 2.0], [200] * 4, 20.0)]),
    ]
    title = "torchtitan_neuron bench, 2 cores, fp32 matmul peak 116.2 GFLOP/s on 1 thread"
    fig = bench.plot(cells, bench.MODELS, tmp_path / "bench.png", title)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.get_suptitle() == title
    tiny, medium = fig.axes
    assert (tiny.get_title(loc="left"), medium.get_title(loc="left")) == (
        "Llama 3 debug (6.2 M)", "Llama 3 medium (58 M)")
    assert [t.get_text() for t in tiny.get_yticklabels()] == [
        "simplefsdp [AC full], 2 ranks", "aot_fx_trace [AC full], 2 ranks"]
    assert [t.get_text() for t in tiny.texts] == ["1000 tokens/s, 1.00 s/step", " failed"]
    assert [t.get_text() for t in medium.get_yticklabels()] == ["fsdp2 [AC selective], 1 rank"]
    assert [t.get_text() for t in medium.texts] == ["200 tokens/s, 2.00 s/step"]


@pytest.mark.parametrize("name", ["tiny", "deepseek"])
def test_ceiling_counts_every_matmul_of_the_model(name):
    """scripts/bench_ceiling.py times the model's forward and backward
    matmuls: 6 x tokens x weights FLOPs for every linear layer, and for the
    routed experts the tokens top-k routing gives each, on average."""
    import torch

    import bench_ceiling
    from torchtitan.config import ConfigManager

    shapes, tokens = bench_ceiling.model_gemms(name, ranks=2)
    model = bench.MODELS[name]
    assert tokens == model.global_batch // 2 * model.seq_len
    config = ConfigManager().parse_args(["--module", model.simplefsdp[0],
                                         "--config", model.simplefsdp[1]])
    with torch.device("meta"):
        built = config.model_spec.model.build()
    dense = sum(m.weight.numel() for m in built.modules() if isinstance(m, torch.nn.Linear))
    expected = 6 * tokens * dense
    for pname, p in built.named_parameters():
        if p.dim() == 3 and "experts" in pname:
            experts = p.shape[0]
            top_k = next(m for n, m in built.named_modules()
                         if pname.startswith(n + ".") and hasattr(m, "router")).router.top_k
            expected += 6 * (tokens * top_k // experts) * p.numel()
    assert sum(2 * m * k * n * c for m, k, n, c in shapes) == expected
    assert (name == "deepseek") == (expected > 6 * tokens * dense)


@pytest.mark.parametrize("overrides", [[], ["--training.steps", "3"]])
@pytest.mark.parametrize("mode,ac", [("simplefsdp_no_ac", "none"), ("fsdp2_compiled", "full"),
                                     ("simplefsdp", "selective")])
def test_the_cells_ac_subcommand_ends_the_command_line(monkeypatch, tmp_path, overrides,
                                                        mode, ac):
    # tyro reads everything after ``activation-checkpoint:...`` as that
    # subcommand's options, so the cell's policy must come after the trainer
    # flags, the user's overrides and the dump folder.
    seen = []

    def fake_run_command(argv, env, **options):
        seen.append(argv)
        return Run(0, "", 1.0)

    # runlog.launch() builds the real command line; only running it is faked.
    monkeypatch.setattr(runlog, "run_command", fake_run_command)
    cell = bench.Cell("tiny", mode, 2, ac)
    bench.launch_cell(cell, bench.MODELS["tiny"], 0, 4, 1e9, overrides, 1, str(tmp_path))
    assert seen and seen[0][-1] == f"activation-checkpoint:{ac}", seen
    assert sum(a.startswith("activation-checkpoint:") for a in seen[0]) == 1
    assert overrides == seen[0][-1 - len(overrides):-1]
    assert seen[0][1].startswith("--dump_folder="), seen


@pytest.mark.parametrize("ac,policy", [("full", "full"), ("selective", "eager")])
def test_aot_fx_trace_takes_the_policy_as_its_graph_memory_policy(monkeypatch, tmp_path,
                                                                   ac, policy):
    seen = []
    monkeypatch.setattr(runlog, "run_command",
                        lambda argv, env, **options: seen.append(argv) or Run(0, "", 1.0))
    bench.launch_cell(bench.Cell("tiny", "aot_fx_trace", 2, ac), bench.MODELS["tiny"], 0, 4,
                      1e9, [], 1, str(tmp_path))
    argv = seen[0]
    assert argv[argv.index("--compile.memory_policy") + 1] == policy
    assert not any(a.startswith("activation-checkpoint:") for a in argv)


def test_cells_name_mode_ranks_and_policy():
    import argparse

    parser = argparse.ArgumentParser()
    assert bench.parse_cell("fsdp2:2:full", parser) == ("fsdp2", 2, "full")
    assert bench.parse_cell("simplefsdp:4", parser) == ("simplefsdp", 4, "selective")
    assert bench.parse_cell("simplefsdp_no_ac:2", parser) == ("simplefsdp_no_ac", 2, "none")
    for bad in ("fsdp3:2", "fsdp2:2:most", "aot_fx_trace:2:none"):
        with pytest.raises(SystemExit):
            bench.parse_cell(bad, parser)


def test_the_no_comm_cell_starts_its_ranks_as_one_rank_processes_at_once(monkeypatch, tmp_path):
    # simplefsdp_no_comm:2 is two 1-rank runs at the 2-rank local batch (and
    # no gradient accumulation), running together (each waits for the other
    # to have started).
    import threading

    started = threading.Barrier(2, timeout=10)
    seen = []

    def fake_run_command(argv, env, **options):
        started.wait()
        seen.append((argv, env["NGPU"]))
        return _log(9.0, [0.9] * 3, [1100] * 4, 38.0)

    monkeypatch.setattr(runlog, "run_command", fake_run_command)
    cell = bench.Cell("tiny", "simplefsdp_no_comm", 2, "selective")
    bench.launch_cell(cell, bench.MODELS["tiny"], 0, 12, 1e9, [], 1, str(tmp_path))
    assert [ngpu for _, ngpu in seen] == ["1", "1"]
    for argv, _ in seen:
        assert argv[argv.index("--training.local_batch_size") + 1] == "4"
        assert argv[argv.index("--training.global_batch_size") + 1] == "4"
    assert len({argv[1] for argv, _ in seen}) == 2, "each process its own dump folder"
    assert len(cell.launches) == 2


def test_a_models_cells_run_round_by_round_each_with_its_own_cache(monkeypatch, tmp_path):
    """Every cell's first launch, then every cell's second: a drift in the
    machine's speed moves all cells alike. Each cell keeps its compile cache
    across its launches (cold, then warm) and no other cell shares it; a cell
    that failed is not launched again."""
    order = []

    def fake_run_command(argv, env, **options):
        order.append((env["CONFIG"], env["TORCHINDUCTOR_CACHE_DIR"]))
        if "graph_trainer" in order[-1][0]:
            return Run(1, "RuntimeError: boom", 1.0)
        return _log(9.0, [0.9] * 3, [1100] * 4, 38.0)

    monkeypatch.setattr(runlog, "run_command", fake_run_command)
    cells = [bench.Cell("tiny", m, 2, "full") for m in ("simplefsdp", "aot_fx_trace", "fsdp2")]
    caches = {id(c): str(tmp_path / c.mode) for c in cells}
    bench.run_model(cells, 3, lambda cell, n: bench.launch_cell(
        cell, bench.MODELS["tiny"], n, 12, 1e9, [], 1, caches[id(cell)]))
    simple, fx, fsdp2 = (bench.MODELS["tiny"].simplefsdp[1], bench.MODELS["tiny"].fx[1],
                         bench.MODELS["tiny"].fsdp2[1])
    assert [config for config, _ in order] == [simple, fx, fsdp2, simple, fsdp2, simple, fsdp2]
    for config in (simple, fsdp2):
        assert len({cache for c, cache in order if c == config}) == 1
    assert len({cache for _, cache in order}) == 3
    assert [len(c.launches) for c in cells] == [3, 1, 3] and cells[1].error


def test_ceiling_times_the_update_of_all_parameters_and_of_one_shard():
    """scripts/bench_ceiling.py's update timing covers every parameter of the
    bench model (the debug Llama: 6.2 M), and times a step of the sizes given."""
    import bench_ceiling

    assert round(sum(bench_ceiling.model_numels("tiny")) / 1e6, 1) == 6.2
    assert bench_ceiling.update_seconds([4096, 10], repeats=1) > 0


def test_ceiling_buckets_are_the_models_blocks_and_the_other_parameters():
    """scripts/bench_ceiling.py gathers one bucket per transformer block and
    one per parameter outside the blocks, and together they are the model."""
    import bench_ceiling

    buckets = bench_ceiling.model_buckets("tiny")
    assert sum(buckets) == sum(bench_ceiling.model_numels("tiny"))
    # The debug Llama: 6 blocks, then embeddings, final norm and output.
    assert len(buckets) == 6 + 3


@pytest.mark.e2e
def test_ceiling_times_the_collectives_on_two_gloo_processes():
    """Both processes report the CPU and wall time of the step's collectives."""
    import bench_ceiling

    results = bench_ceiling.collectives_seconds([4096, 1000], ranks=2, repeats=2)
    assert len(results) == 2
    assert all(cpu >= 0 and wall > 0 for cpu, wall in results), results
