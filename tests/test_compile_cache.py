"""The on-disk compile cache serves a second identical run.

Proves: with torchtitan's selective AC (the default recipes' policy), a model
compiled with inductor is saved to the AOTAutograd cache on the first run and
loaded from it by a second process with the same TORCHINDUCTOR_CACHE_DIR,
instead of being bypassed ("SAC context_fn does not have a cache_hash"); the
same for a SimpleFSDP model whose bucketed blocks gather in bf16 and
reduce-scatter in fp32 (a custom autograd.Function, which torch bypasses by
default); and equal policies share one named, picklable context function. The first-step
times of a real `make train` run, cold and warm, are measured by
`make bench-cache` (scripts/bench_compile_cache.py; docs/benchmarks.md).

Tier: the two compiling processes are e2e, in ``make test-slow``; the
policy check is fast.
Run: .venv/bin/python -m pytest tests/test_compile_cache.py -q
"""

import json
import os
import pickle
import subprocess
import sys

import pytest
from torchtitan.distributed.activation_checkpoint import SelectiveAC

from conftest import REPO


def _counters(cache_dir, helper: str = "compile_sac_block.py", **env) -> dict:
    proc = subprocess.run(
        [sys.executable, f"tests/helpers/{helper}"], cwd=REPO,
        env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), **env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.slow
def test_second_run_loads_the_compiled_selective_ac_graph(tmp_path):
    cold = _counters(tmp_path)
    assert cold.get("autograd_cache_saved") == 1 and "autograd_cache_bypass" not in cold, cold
    warm = _counters(tmp_path)
    assert warm.get("autograd_cache_hit") == 1 and "autograd_cache_miss" not in warm, warm


@pytest.mark.e2e
@pytest.mark.slow
def test_second_run_loads_the_compiled_bf16_gather_bucket(tmp_path):
    """Row `autograd-function-cache`: graphs holding ``_GatherBucket`` (bf16
    gathers, fp32 reduce-scatters) are saved and loaded; with torch's own
    default (forced by its environment variable) they are bypassed."""
    cold = _counters(tmp_path / "on", "compile_bf16_bucket.py")
    assert cold.get("autograd_cache_saved") == 1 and "autograd_cache_bypass" not in cold, cold
    warm = _counters(tmp_path / "on", "compile_bf16_bucket.py")
    assert warm.get("autograd_cache_hit") == 1 and "autograd_cache_miss" not in warm, warm
    default = _counters(tmp_path / "off", "compile_bf16_bucket.py",
                        TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD="0")
    assert default.get("autograd_cache_bypass") == 1, default


def test_equal_policies_share_one_picklable_context_fn(monkeypatch):
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from compile_sac_block import Model

    from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import apply_activation_checkpointing

    fns = []
    for _ in range(2):
        model = Model()
        apply_activation_checkpointing(model, SelectiveAC.Config(), dump_folder="")
        fns += [block.checkpoint_fn.keywords["context_fn"] for block in model.layers.values()]
    assert len({id(fn) for fn in fns}) == 1
    assert len(fns[0].cache_hash) == 64
    assert pickle.loads(pickle.dumps(fns[0])) is fns[0]
    # The hash covers this project's policy code as well as upstream's: an
    # edit to it gives a new hash, so no stale compiled graph is served.
    from torchtitan_neuron.experiments.graph_trainer import activation_checkpoint as ours

    sources = ours.policy_sources()
    assert any("def hash_selective_policies" in source for source in sources)
    monkeypatch.setattr(ours, "policy_sources", lambda: [*sources[:-1], sources[-1] + "#"])
    model = Model()
    apply_activation_checkpointing(model, SelectiveAC.Config(), dump_folder="")
    edited = model.layers["0"].checkpoint_fn.keywords["context_fn"]
    assert len(edited.cache_hash) == 64 and edited.cache_hash != fns[0].cache_hash
