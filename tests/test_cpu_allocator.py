"""The CPU ranks' allocator: jemalloc where installed, chosen before the ranks start.

Proves: ``rank_environment`` preloads the jemalloc it finds with freed memory
kept (a user's ``LD_PRELOAD`` and ``MALLOC_CONF`` win, ``system`` preloads
nothing, a missing jemalloc under ``auto`` falls back silently); asking for
jemalloc where there is none, or for an unknown allocator, stops with the
variable, the value and the fix; and a process started with that environment
really runs on jemalloc, as its memory map shows (skipped where the host has
no jemalloc). That ``make train``'s ranks get it is checked in
test_first_run.py.

Tier: unit, in ``make test-fast``.
Run: .venv/bin/python -m pytest tests/test_cpu_allocator.py -q
"""

import os
import subprocess
import sys

import pytest

from torchtitan_neuron.devices import cpu_allocator
from torchtitan_neuron.devices.cpu_allocator import (
    ALLOCATOR_ENV,
    JEMALLOC_CONF,
    find_jemalloc,
    rank_environment,
)


@pytest.fixture
def libdir(tmp_path):
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    return [str(tmp_path / "none"), str(tmp_path)]


def test_auto_preloads_jemalloc_with_freed_memory_kept(libdir):
    env = rank_environment({}, dirs=libdir)
    assert env == {"LD_PRELOAD": os.path.join(libdir[1], "libjemalloc.so.2"),
                   "MALLOC_CONF": JEMALLOC_CONF}
    assert "dirty_decay_ms:-1" in JEMALLOC_CONF and "muzzy_decay_ms:-1" in JEMALLOC_CONF
    assert rank_environment({ALLOCATOR_ENV: "JEMALLOC"}, dirs=libdir) == env


def test_the_users_own_settings_win(libdir):
    assert rank_environment({"MALLOC_CONF": "narenas:1"}, dirs=libdir)["MALLOC_CONF"] \
        == "narenas:1"
    assert rank_environment({"LD_PRELOAD": "/opt/libtcmalloc.so"}, dirs=libdir) == {}
    assert rank_environment({ALLOCATOR_ENV: "system"}, dirs=libdir) == {}


def test_without_jemalloc_auto_runs_on_the_c_library(tmp_path):
    assert rank_environment({}, dirs=[str(tmp_path)]) == {}


def test_asking_for_a_missing_or_unknown_allocator_says_how_to_fix_it(tmp_path):
    with pytest.raises(ValueError) as missing:
        rank_environment({ALLOCATOR_ENV: "jemalloc"}, dirs=[str(tmp_path)])
    text = str(missing.value)
    assert f"{ALLOCATOR_ENV}=jemalloc" in text and str(tmp_path) in text
    assert "apt install libjemalloc2" in text and f"{ALLOCATOR_ENV}=auto" in text
    with pytest.raises(ValueError) as unknown:
        rank_environment({ALLOCATOR_ENV: "tcmalloc"})
    assert "'tcmalloc' is not an allocator: use auto, jemalloc, system" in str(unknown.value)


def _loaded_in_child(env: dict) -> str:
    code = "from torchtitan_neuron.devices import cpu_allocator; print(cpu_allocator.loaded())"
    child = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", code], env={**child, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(find_jemalloc() is None, reason="no jemalloc on this host")
def test_a_process_started_with_that_environment_runs_on_jemalloc():
    assert _loaded_in_child(rank_environment({})) == "jemalloc"
    assert _loaded_in_child(rank_environment({ALLOCATOR_ENV: "system"})) == "glibc malloc"


def test_the_rank_log_names_the_allocator_and_the_switch(monkeypatch):
    monkeypatch.setattr(cpu_allocator, "loaded", lambda: "glibc malloc")
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    assert "apt install libjemalloc2" in cpu_allocator.describe()
    monkeypatch.setenv(ALLOCATOR_ENV, "system")
    assert cpu_allocator.describe() == f"allocator glibc malloc ({ALLOCATOR_ENV}=system)"
    monkeypatch.setattr(cpu_allocator, "loaded", lambda: "jemalloc")
    monkeypatch.setenv("MALLOC_CONF", JEMALLOC_CONF)
    assert cpu_allocator.describe().startswith(f"allocator jemalloc (MALLOC_CONF={JEMALLOC_CONF};")


def test_the_allocator_hands_back_free_memory_and_the_step_peak_reads_it():
    """ProcessPeak, the allocator's side of a measured step: free blocks go
    back to the system as the step starts, so what a step allocates and
    frees raises the peak resident set by its size."""
    import torch

    from torchtitan_neuron import devices
    from torchtitan_neuron.trainer import ProcessPeak

    devices.install()  # this host: cpu
    assert cpu_allocator.release_free_memory()
    peak = ProcessPeak.start()
    assert peak is not None
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written
    del block
    line = peak.describe(tensors_at_start=0)
    found = dict(kv.split("=") for kv in line.split(": ", 1)[1].split())
    grew = float(found["process_peak_gib"]) - float(found["resident_at_start_gib"])
    assert 60 / 1024 < grew < 80 / 1024, line
