"""The rehearsal runs the neuron branch without Trainium and checks what it
would hand to the Neuron compiler.

Proves: the debug SimpleFSDP Llama recipe at 2 ranks is ``ready`` on the
neuron branch, and its run goes through that branch's code paths (device and
process group ``neuron``, NeuronCore counting, the NEFF cache of the host, the
step line's memory figure read after ``torch.neuron.synchronize()``, the
``neuron`` compile backend resolved to the stand-in, SDPA on the fused op);
the model graphs handed to the ``neuron`` backend hold one all-gather and
one reduce-scatter per block (bucketing), and the host's last rank, traced
beside rank 0, hands the compiler the same programs, so the host compiles
each once; the DeepSeek debug SimpleFSDP
recipe at 4 ranks as TP2 x EP2 (its all-to-alls over ``ep`` counted), the context-parallel debug recipe at 4 ranks (its key
and value gathers over ``cp`` counted apart from FSDP's) and an eager recipe
are ``ready``, and so is one rank of 128 (two trn2 hosts); a recipe whose model calls ``.item()`` in forward is ``not
ready`` naming that file and line; a bad recipe exits 2 through
``COMM_MODE=rehearse ./run_train.sh``. Unit tests check the graph checks on
hand-traced graphs, the verdict, and the neuron device module and NEFF cache
with a stand-in ``torch.neuron``. A rehearsal renames PrivateUse1, which
torch allows once per process, so every rehearsal runs in a subprocess.

Tier: the llama debug rehearsal and the bad-recipe launch are e2e (make
test); the other rehearsals are e2e and slow (make test-slow); the rest fast.
Run: .venv/bin/python -m pytest tests/test_rehearse.py -q
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conftest import LLAMA_MODULE, REPO
from torchtitan_neuron import devices
from torchtitan_neuron.rehearse.checks import check_graph
from torchtitan_neuron.tracing.neuron_device import StandInNeuronModule
from torchtitan_neuron.rehearse.report import COMPLEX_ENV, Report

DEEPSEEK_MODULE = "torchtitan_neuron.experiments.graph_trainer.deepseek_v3"


def _rehearse(module: str, config: str, ngpu: int, *extra: str, timeout: int = 900,
              host: bool = False) -> tuple[int, dict | None, str]:
    """One rehearsal; ``host`` also traces the host's last rank (the default
    of the command line), which the tests of other findings leave out."""
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_neuron.rehearse", "--module", module,
         "--config", config, f"--ngpu={ngpu}", "--json", *extra,
         *([] if host else ["--one-rank"])],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    return proc.returncode, json.loads(lines[-1]) if lines else None, proc.stderr


# ---------------------------------------------------------------------------
# Rehearsals (subprocesses)


@pytest.mark.e2e
def test_debug_llama_is_ready_and_runs_the_neuron_branch():
    code, report, err = _rehearse(LLAMA_MODULE, "simple_fsdp_llama3_debugmodel", 2, host=True)
    assert report is not None, err[-3000:]
    assert code == 0 and report["ready"], report["reasons"]
    notes = report["notes"]
    assert notes["platform"] == "neuron (device neuron, process group neuron)"
    assert notes["NeuronCores on this host"] == 64
    # One NEFF cache for the host's ranks (devices.host_neff_cache).
    assert notes["NEFF cache"] == os.environ.get(devices.NEFF_CACHE_ENV, devices.DEFAULT_NEFF_CACHE)
    # Rank 1, the host's last, traced beside rank 0: the same programs.
    programs = {g["name"]: g["program"] for g in report["graphs"]}
    assert report["host_peer"]["rank"] == 1 and report["host_peer"]["programs"] == programs
    n = len(set(programs.values()))
    assert report["host_programs"] == (
        f"{len(programs)} programs on rank 0, the same {len(programs)} on rank 1 (the host's "
        f"last): the host's 2 ranks compile {n} distinct programs (with the NEFF cache shared "
        f"per host, {n} compiles where a cache per rank would run {2 * len(programs)})")
    assert "every read after torch.neuron.synchronize()" in notes["memory figure"]
    assert "'neuron' -> the rehearsal's stand-in" in notes["compile"]
    assert report["compile_backend"] == "neuron"
    # The SimpleFSDP graphs gather parameters and reduce-scatter gradients,
    # and attention reaches the fused op TorchNeuron implements.
    assert report["collectives"]["all_gather_into_tensor"]["count"] > 0
    assert report["collectives"]["reduce_scatter_tensor"]["count"] > 0
    # The backend receives the bucketed collectives: the model's forward graph
    # gathers the 6 blocks' buckets and the 3 parameters outside the blocks (9;
    # per parameter it would be one per tensor), its backward reduce-scatters 8
    # (tests/test_bucketing.py).
    by_kind = {kind: [g["collectives"] for g in report["graphs"]
                      if g["name"].split(".")[1] == kind] for kind in ("forward", "backward")}
    assert max(c.get("all_gather_into_tensor", 0) for c in by_kind["forward"]) == 9
    assert max(c.get("reduce_scatter_tensor", 0) for c in by_kind["backward"]) == 8
    # FSDP alone: every compiled collective is over the fsdp group.
    assert report["collectives_by_mesh"]
    assert all(k.endswith(" over fsdp") for k in report["collectives_by_mesh"]), \
        report["collectives_by_mesh"]
    assert "aten._scaled_dot_product_fused_attention_overrideable" in report["ops"]
    assert "aten._scaled_dot_product_fused_attention_overrideable_backward" in report["ops"]
    assert report["graph_breaks"] == [] and report["recompiles"] == []
    assert {g["name"].split(".")[1] for g in report["graphs"]} >= {"forward", "backward"}
    assert "float32" in report["dtypes"]


@pytest.mark.e2e
def test_lora_recipe_reduces_only_adapters_and_its_validation_is_traced():
    code, report, err = _rehearse(LLAMA_MODULE, "simple_fsdp_llama3_debugmodel_lora", 2)
    assert report is not None, err[-3000:]
    assert code == 0 and report["ready"], report["reasons"]
    graphs = {g["name"]: g["collectives"] for g in report["graphs"]}
    # Each block's adapters are a bucket of their own: 6 reduce-scatters, and
    # none for the frozen base, embeddings, norm or lm_head.
    assert [c.get("reduce_scatter_tensor", 0) for name, c in graphs.items()
            if name.endswith(".backward") and c] == [6]
    # The validator's batch after step 2: the model's graph again with grad
    # mode off (it gathers as the training forward does) and the loss's.
    assert report["notes"]["validation"] == ("one batch traced after step 2 (eval mode, no "
                                             "grad): 2 more graphs compiled")
    inference = [c for name, c in graphs.items() if name.endswith(".inference")]
    assert {"all_gather_into_tensor": 15} in inference
    assert report["recompiles"] == [] and report["graph_breaks"] == []


@pytest.mark.e2e
@pytest.mark.slow
def test_context_parallel_recipe_is_ready_and_gathers_keys_over_cp():
    code, report, err = _rehearse(LLAMA_MODULE, "simple_fsdp_llama3_debugmodel_cp2", 4)
    assert report is not None, err[-3000:]
    assert code == 0 and report["ready"], report["reasons"]
    by_mesh = report["collectives_by_mesh"]
    # Each of the 6 layers gathers its keys and values over cp in forward
    # (again where AC recomputes), and reduce-scatters their gradients once.
    assert by_mesh["reduce_scatter_tensor over cp"] == 12, by_mesh
    assert by_mesh["all_gather_into_tensor over cp"] >= 12, by_mesh
    assert by_mesh["reduce_scatter_tensor over fsdp"] > 0, by_mesh


@pytest.mark.e2e
@pytest.mark.slow
def test_a_rank_of_two_nodes_is_ready():
    # --ngpu 128 on trn2: two hosts of 64 NeuronCores; rank 0's is one of them.
    code, report, err = _rehearse(LLAMA_MODULE, "simple_fsdp_llama3_debugmodel", 128,
                                  "--training.global_batch_size", "512")
    assert report is not None, err[-3000:]
    assert code == 0 and report["ready"], report["reasons"]
    assert report["notes"]["nodes"] == "2: rank 0's host is one of 2, with 64 of the 128 ranks"
    assert report["notes"]["NeuronCores on this host"] == 64


@pytest.mark.e2e
@pytest.mark.slow
def test_ep_recipe_is_ready_with_its_all_to_alls_over_ep():
    # The DeepSeek debug recipe as TP2 x EP2 x FSDP2: each of its 5 MoE layers
    # exchanges token counts, dispatches and combines by all-to-all over ep in
    # forward (3 each), and sends the gradients back the other way in backward
    # (2 each); the split sizes come from plan-ep-splits.
    code, report, err = _rehearse(
        DEEPSEEK_MODULE, "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2", 4,
        "--parallelism.expert_parallel_degree", "2")
    assert report is not None, err[-3000:]
    assert code == 0 and report["ready"], report["reasons"]
    by_mesh = report["collectives_by_mesh"]
    assert by_mesh["all_to_all_single over ep"] == 25, by_mesh
    assert by_mesh["all_gather_into_tensor over efsdp"] > 0, by_mesh
    assert by_mesh["all_gather_into_tensor over fsdp"] > 0, by_mesh


@pytest.mark.e2e
@pytest.mark.slow
def test_eager_recipe_gets_the_op_by_op_report():
    code, report, err = _rehearse("torchtitan_neuron.models.qwen3",
                                  "qwen3_debugmodel_tp2_fsdp2_sac", 4)
    assert report is not None, err[-3000:]
    assert code == 0 and report["ready"], report["reasons"]
    assert report["graphs"] == [] and report["compile_backend"] == "off"
    eager = report["eager"]
    assert eager["devices"].get("neuron", 0) > 0 and "cuda" not in eager["devices"]
    assert sum(e["count"] for e in eager["collectives"].values()) > 0


@pytest.mark.e2e
@pytest.mark.slow
def test_item_in_forward_is_not_ready_naming_file_and_line():
    helper = REPO / "tests" / "helpers" / "item_in_forward.py"
    line = next(i for i, text in enumerate(helper.read_text().splitlines(), 1)
                if ".item()" in text and "scale =" in text)
    code, report, err = _rehearse("tests.helpers.item_in_forward",
                                  "simple_fsdp_llama3_debugmodel_item", 2)
    assert report is not None, err[-3000:]
    assert code == 1 and not report["ready"]
    found = [(Path(b["file"]).resolve(), b["line"]) for b in report["graph_breaks"]]
    found += [(Path(h["file"]).resolve(), h["line"]) for h in report["host_syncs"]
              if h["file"]]
    assert (helper.resolve(), line) in found, report["reasons"]
    assert any(f"item_in_forward.py:{line}" in r for r in report["reasons"])


@pytest.mark.e2e
def test_bad_recipe_exits_2_with_one_message_through_the_launcher():
    env = {**os.environ, "COMM_MODE": "rehearse", "NGPU": "2", "MODULE": LLAMA_MODULE,
           "CONFIG": "no_such_recipe", "PYTHON": sys.executable}
    proc = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == 2
    errors = [l for l in proc.stderr.splitlines() if l.startswith("Error:")]
    assert len(errors) == 1 and "no_such_recipe" in errors[0]
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------
# Graph checks on hand-traced graphs (CPU, this process)


def _aten_graph(f, *args, dynamic=False):
    """The ATen forward graph AOTAutograd hands a backend for ``f``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True,
                                    capture_dynamic_output_shape_ops=True):
        torch.compile(f, backend=aot_autograd(fw_compiler=keep), dynamic=dynamic,
                      fullgraph=True)(*args)
    return graphs[0]


def test_host_sync_and_data_dependent_shape_are_found_with_their_line():
    def f(x):
        count = x.long().sum().item()
        torch._check(count >= 0)
        return torch.nonzero(x).sum() + x.new_ones(count).sum()

    facts = check_graph(_aten_graph(f, torch.ones(4), dynamic=True), "g.forward")
    assert {h["op"] for h in facts.host_syncs} == {"aten._local_scalar_dense", "aten.nonzero"}
    line = f.__code__.co_firstlineno + 1
    assert {"file": __file__, "line": line} in [
        {"file": h["file"], "line": h["line"]} for h in facts.host_syncs]
    kinds = {d["kind"] for d in facts.dynamic_shapes}
    assert kinds == {"data-dependent", "symbolic"}


def test_dtypes_and_complex_ops_are_counted():
    def f(x):
        c = torch.view_as_complex(x.reshape(2, 2, 2))
        return torch.view_as_real(c * c).double()

    facts = check_graph(make_fx(f)(torch.ones(8)), "g.forward")
    assert facts.complex_ops and "complex64" in facts.dtypes
    assert "float64" in facts.dtypes and not facts.host_syncs


def test_host_tensors_are_flagged_except_scalars():
    facts = check_graph(make_fx(lambda x: x * torch.tensor(2.0) + 1)(torch.ones(3)), "g")
    # The input and the product are 1-d CPU tensors: flagged (a neuron rank
    # would hand the compiler device tensors); the 0-dim constant is allowed.
    flagged = {d["node"] for d in facts.foreign_devices}
    assert "x_1" in flagged and all(d["device"] == "cpu" for d in facts.foreign_devices)
    assert not any(n.startswith("_tensor_constant") for n in flagged)


# ---------------------------------------------------------------------------
# Verdict and report


def test_verdict_fails_on_each_blocking_finding_and_warns_on_the_rest():
    assert Report("r", 2, "trn2").ready
    where = {"file": "m.py", "line": 7}
    for field, item in [
        ("graph_breaks", {**where, "reason": "item"}),
        ("recompiles", {**where, "graph": "graph3"}),
        ("dynamic_shapes", {**where, "graph": "g", "kind": "symbolic", "shape": "[s0]"}),
        ("host_syncs", {**where, "graph": "g", "op": "aten.nonzero"}),
        ("foreign_devices", {**where, "graph": "g", "op": "aten.mm", "device": "cpu"}),
    ]:
        report = Report("r", 2, "trn2")
        getattr(report, field).append(item)
        assert not report.ready and "m.py:7" in report.reasons()[0], field
    report = Report("r", 2, "trn2")
    report.complex_ops["aten.mul"] = 2
    report.dtypes["float64"] = 1
    assert report.ready
    assert any(COMPLEX_ENV in w for w in report.warnings())
    assert any("float64" in w for w in report.warnings())
    keys = {"ready", "reasons", "graph_breaks", "recompiles", "dynamic_shapes", "dtypes",
            "complex_ops", "collectives", "ops", "warnings"}
    assert keys <= set(report.to_json())


# ---------------------------------------------------------------------------
# The neuron branch of torchtitan_neuron/devices/neuron.py with a stand-in torch.neuron


@pytest.fixture
def stand_in_neuron(monkeypatch):
    module = StandInNeuronModule("trn2")
    monkeypatch.setattr(torch, "neuron", module, raising=False)
    return module


def test_neuron_memory_is_read_after_synchronize(stand_in_neuron):
    device_module = devices.neuron.NeuronDeviceModule()
    device_module.reset_peak_memory_stats()
    assert device_module.memory_stats()["reserved_bytes.all.peak"] == 0
    assert stand_in_neuron.reads == [("reset_peak_memory_stats", True),
                                     ("memory_stats", True)]
    # Everything else is torch.neuron's own.
    assert device_module.get_device_name().startswith("NeuronCore")


def test_neuroncores_are_counted_from_torch_neuron(stand_in_neuron):
    assert devices.device_count("neuron") == 64


def test_the_ranks_of_a_host_share_one_neff_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "64")
    monkeypatch.setenv(devices.NEFF_CACHE_ENV, str(tmp_path))
    assert devices.host_neff_cache() == str(tmp_path)
    monkeypatch.delenv(devices.NEFF_CACHE_ENV)
    assert devices.host_neff_cache() == devices.DEFAULT_NEFF_CACHE
    assert os.environ[devices.NEFF_CACHE_ENV] == devices.DEFAULT_NEFF_CACHE
    # Inductor's stays per rank: its key leaves the process group's name out.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert devices.per_rank_compile_cache() == str(tmp_path / "rank3-of-64")
    monkeypatch.delenv("RANK")
    assert devices.host_neff_cache() is None


def test_programs_per_host_count_identical_graphs_once():
    def report(rank, programs):
        r = Report(recipe="r", ngpu=64, target="trn2", rank=rank, host_ranks=64)
        r.graphs = [{"name": k, "program": v} for k, v in programs.items()]
        return r

    same = {"graph0.forward": "a", "graph0.backward": "b", "graph1.forward": "c"}
    r = report(0, same)
    assert r.host_programs() == ""  # no peer traced
    r.add_host_peer(63, {"graphs": [{"name": k, "program": v} for k, v in same.items()],
                         "reasons": []})
    assert r.host_programs() == (
        "3 programs on rank 0, the same 3 on rank 63 (the host's last): the host's 64 ranks "
        "compile 3 distinct programs (with the NEFF cache shared per host, 3 compiles where "
        "a cache per rank would run 192)")
    other = dict(same, **{"graph1.forward": "d"})
    r = report(0, same)
    r.pp = 2
    r.add_host_peer(63, {"graphs": [{"name": k, "program": v} for k, v in other.items()],
                         "reasons": ["graph break at m.py:3: x"]})
    assert r.host_programs() == (
        "3 programs on rank 0; rank 63 (the host's last) (another pipeline stage) differs in 1 "
        "(graph1.forward): at least 4 distinct programs on the host, ranks between them not traced")
    # What only the other rank hit makes the host not ready.
    assert r.reasons() == ["rank 63: graph break at m.py:3: x"] and not r.ready
    r = report(0, same)
    r.add_host_peer(63, {"error": "MemoryError"})
    assert r.host_programs() == "rank 63's trace did not finish: MemoryError"