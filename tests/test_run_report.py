"""The pieces of a clean first run, without launching one.

Proves: the first step's compile is announced, beats at the set interval and
is timed, cold or warm from inductor's cache counters or the NEFF cache
folder, on rank 0 only; the run record passes torchtitan's metrics on to the
run's own loggers and the summary is built from what they received (with the
trn2 planner command for a CPU twin); each known upstream warning is hidden
on its platforms, shown with TORCHTITAN_NEURON_SHOW_ALL_WARNINGS=1, and its
text is still in the upstream file that emits it; every Trainium recipe's CPU
twin exists. The whole run is test_first_run.py.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_run_report.py -q
"""

import logging
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchtitan_neuron import cpu_twins, run_report
from torchtitan_neuron.devices import known_warnings


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def lines():
    handler = _Lines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler.lines
    root.removeHandler(handler)
    root.setLevel(level)


def test_compile_progress_announces_beats_and_times(monkeypatch, lines, tmp_path):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(run_report.HEARTBEAT_ENV, "0.05")
    with run_report.CompileProgress("inductor", str(tmp_path), None) as progress:
        counters["inductor"]["fxgraph_cache_miss"] += 3
        time.sleep(0.3)
    assert "this happens on the first step only (compile cache: " + str(tmp_path) in lines[0]
    beats = [line for line in lines if line.startswith("Step 1 still compiling")]
    assert 2 <= len(beats) <= 6, lines
    assert progress.seconds >= 0.3
    assert progress.cache_state == "cold cache: 3 graphs compiled"
    assert lines[-1].startswith("Step 1 compiled and ran in 0.3 s (cold cache")

    with run_report.CompileProgress("inductor", None, None) as warm:
        counters["aot_autograd"]["autograd_cache_hit"] += 2
    assert warm.cache_state == "warm cache: 2 graphs reused"
    with run_report.CompileProgress("aot_eager", None, None) as none:
        pass
    assert none.cache_state == "no on-disk cache for the 'aot_eager' backend"


def test_compile_progress_reads_the_neff_cache_and_is_quiet_off_rank0(monkeypatch, lines,
                                                                      tmp_path):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(run_report.HEARTBEAT_ENV, "0.01")
    with run_report.CompileProgress("neuron", None, str(tmp_path)) as cold:
        (tmp_path / "graph.neff").write_bytes(b"x")
        time.sleep(0.05)
    assert cold.cache_state == "cold NEFF cache"
    with run_report.CompileProgress("neuron", None, str(tmp_path)) as warm:
        pass
    assert warm.cache_state == "warm NEFF cache"
    assert lines == []


def _metrics(loss, seconds, tps, gib):
    return {"loss_metrics/global_avg_loss": loss, "time_metrics/end_to_end(s)": seconds,
            "throughput(tps)": tps, "memory/max_reserved(GiB)": gib, "grad_norm": 1.0}


def test_summary_is_built_from_the_logged_metrics(monkeypatch, tmp_path):
    received = []
    inner = SimpleNamespace(log=lambda m, s: received.append(s), close=lambda: None)
    record = run_report.RunRecord(inner)
    for step, (loss, sec, tps, gib) in enumerate(
            [(8.0, 40.0, 30, 1.0), (7.5, 1.0, 1000, 1.2), (7.0, 3.0, 900, 1.1)], 1):
        record.log(_metrics(loss, sec, tps, gib), step)
    assert received == [1, 2, 3]
    monkeypatch.setattr(sys, "argv", ["train", "--module", cpu_twins.LLAMA,
                                      "--config", "simple_fsdp_llama3_debugmodel_fullac"])
    config = SimpleNamespace(
        dump_folder=str(tmp_path), checkpoint=SimpleNamespace(enable=True, folder="checkpoint"),
        debug=SimpleNamespace(enable_structured_logging=False))
    progress = SimpleNamespace(seconds=40.0, cache_state="cold cache: 5 graphs compiled")
    summary = run_report.summarize(config, record, progress, "cpu")
    assert (summary["steps_run"], summary["loss_first"], summary["loss_last"]) == (3, 8.0, 7.0)
    assert summary["median_step_time_s"] == 2.0 and summary["median_tokens_per_s_per_rank"] == 950
    assert summary["peak_memory_gib_rank0"] == 1.2
    assert summary["checkpoints"] == str(tmp_path / "checkpoint")
    assert summary["trn2_plan_command"].endswith(
        "--config simple_fsdp_llama3_8b_fullac --ngpu 64 --target trn2")
    path = run_report.write_summary(config, summary)
    text = run_report.describe(summary)
    assert "8.00000 -> 7.00000" in text and "2.000 s, 950 tokens/s per rank" in text
    assert f"this summary         {path}" in text and "tensorboard          off" in text
    # Off CPU the run is not a rehearsal: no planner command.
    assert "trn2_plan_command" not in run_report.summarize(config, record, progress, "cuda")


def _site(relative: str) -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / relative


@pytest.mark.parametrize("known", known_warnings.KNOWN, ids=lambda k: k.name)
def test_each_known_warning_is_still_upstream(known):
    """A filter whose text upstream no longer prints would hide nothing;
    a message that changed must be looked at again."""
    # Whitespace normalised and adjacent string literals joined.
    source = " ".join(_site(known.upstream).read_text().split()).replace('" "', "")
    for literal in known.literals or (known.text,):
        assert literal in source, f"{known.name}: {literal!r} not in {known.upstream}"


def test_known_warnings_are_hidden_on_their_platforms_only(monkeypatch):
    records = _Lines()
    loggers = {k.source for k in known_warnings.KNOWN if k.source != "warnings"}
    for name in loggers:
        logging.getLogger(name).addHandler(records)
    try:
        for show_all, platform_name in ((False, "cpu"), (False, "neuron"), (True, "cpu")):
            monkeypatch.setattr(known_warnings, "_hidden", None)
            if show_all:
                monkeypatch.setenv(known_warnings.SHOW_ALL_ENV, "1")
            records.lines.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hidden = known_warnings.install(platform_name)
                for known in known_warnings.KNOWN:
                    if known.source == "warnings":
                        warnings.warn(f"DTensor random operators {known.text}", UserWarning)
                    else:
                        logging.getLogger(known.source).warning(f"x {known.text} y")
            shown = records.lines + [str(w.message) for w in caught]
            expected = [] if show_all else [k for k in known_warnings.KNOWN
                                            if platform_name in k.platforms]
            assert hidden == expected
            for known in known_warnings.KNOWN:
                assert any(known.text in s for s in shown) == (known not in expected), known.name
            for name in loggers:
                logging.getLogger(name).filters.clear()
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(records)
    assert "TORCHTITAN_NEURON_SHOW_ALL_WARNINGS=1 shows them" in known_warnings.describe(
        list(known_warnings.KNOWN), "cpu")


@pytest.mark.parametrize("key", list(cpu_twins.TWINS), ids=lambda k: k[1])
def test_every_trainium_recipe_has_a_cpu_twin_that_exists(key):
    import importlib

    module, big = key
    twin, ranks = cpu_twins.TWINS[key]
    registry = importlib.import_module(f"{module}.config_registry")
    assert callable(getattr(registry, big)) and callable(getattr(registry, twin))
    assert ranks in (2, 4)
