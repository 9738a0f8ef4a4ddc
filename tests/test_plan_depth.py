"""A deep model's plan from two shallow traces equals the plan that traces
every block.

Proves: the planner finds the run of alike blocks (ignoring their
depth-scaled initialisation) and DeepSeek's dense first block; torch still
names each forward and backward op's module stack, and each op of the
compiled graphs is told its block from it, ops of no block staying with the
block before them; each block is classed by its place; segment peaks are
extrapolated affinely, ``mid`` blocks left out, and traces whose segments,
graphs or block marks disagree make the planner trace every block; the
report says when a plan came from shallow traces; and, end to end, the debug
Llama (CPU target) and DeepSeek (trn2 target, neuron branch, both
scratchpad modes) deepened to 14 blocks, and the debug GPT-OSS (trn2) to 14
units of two blocks, plan to the byte as they do with ``--every-block``.

Tier: the three planner comparisons are e2e and slow (about 50, 85 and
150 s); the rest fast.
Run: .venv/bin/python -m pytest tests/test_plan_depth.py -q
"""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from conftest import LLAMA_MODULE, REPO
from torchtitan_neuron.memory_accounting.storage_tracker import block_class
from torchtitan_neuron.plan import backend as plan_backend
from torchtitan_neuron.plan import depth


def _config(module: str, name: str):
    from torchtitan_neuron.tracing.cli import checked_config

    opts = argparse.Namespace(module=module, config=name, ngpu=64, target="trn2", json=True)
    return checked_config(opts, [])


def test_block_classes_name_the_ends_of_the_repeated_run():
    # DeepSeek-like: one dense block, then five alike.
    assert [block_class(i, 1, 6) for i in range(6)] == [
        "head0", "first", "second", "mid", "penult", "last"]
    assert [block_class(i, 0, 4) for i in range(4)] == ["first", "second", "penult", "last"]
    # Units of two blocks, the place in the unit after the dot.
    assert [block_class(i, 0, 10, 2) for i in range(10)] == [
        "first.0", "first.1", "second.0", "second.1", "mid.0", "mid.1",
        "penult.0", "penult.1", "last.0", "last.1"]


def test_layer_run_ignores_initialisation_and_finds_the_dense_head():
    llama = _config(LLAMA_MODULE, "simple_fsdp_llama3_8b")
    assert depth.layer_run(llama) == (0, 32, 1)
    deepseek = _config("torchtitan_neuron.experiments.graph_trainer.deepseek_v3",
                       "simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16")
    assert depth.layer_run(deepseek) == (1, 27, 1)
    gpt_oss = _config("torchtitan_neuron.experiments.graph_trainer.gpt_oss",
                      "simple_fsdp_gpt_oss_20b")
    # Sliding-window and full attention alternate: units of two blocks.
    assert depth.layer_run(gpt_oss) == (0, 24, 2)
    assert depth.traced_layers(gpt_oss) == (8, 10)
    assert depth.why_every_block(llama, False, 0) is None
    assert depth.why_every_block(llama, True, 0) == "--every-block"
    assert "--top" in depth.why_every_block(llama, False, 5)
    # A block that builds other modules ends the run.
    layers = llama.model_spec.model.layers
    layers[-1].feed_forward.w1.out_features += 1
    assert depth.layer_run(llama) == (31, 32, 1)
    assert "few enough" in depth.why_every_block(llama, False, 0)


def test_marker_nodes_tell_the_tracker_each_ops_block():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    stacks = [{"a": ("L['self'].layers['0']", None)}, None,
              {"a": ("L['self'].layers['0'].attention", None)},
              {"a": ("L['self'].norm", None)}]
    node = x
    for stack in stacks:
        node = graph.call_function(torch.neg, (node,))
        if stack:
            node.meta["nn_module_stack"] = stack
    # A backward node names its forward node's stack.
    node = graph.call_function(torch.neg, (node,))
    node.meta["fwd_nn_module_stack"] = {"b": ("layers.1", None)}
    graph.output(node)
    assert plan_backend.mark_blocks(graph) == {0, 1}
    calls = [n for n in graph.nodes if n.op == "call_function"]
    assert [n.args for n in calls if n.target is plan_backend.enter_block] == [(0,), (1,)]
    # The untagged op and the norm stay with block 0; the marker of block 1
    # comes right before its op.
    assert calls.index(next(n for n in calls if n.args == (1,))) == len(calls) - 2

    seen = []
    plan_backend._tracking.tracker = type("T", (), {"enter_block": lambda self, i: seen.append(i)})()
    try:
        torch.fx.GraphModule(torch.nn.Module(), graph)(torch.ones(2))
    finally:
        plan_backend._tracking.tracker = None
    assert seen == [0, 1]


def test_torch_names_the_block_of_forward_and_backward_ops():
    """The meta the markers read: Dynamo's ``nn_module_stack`` on forward
    ops, AOTAutograd's ``fwd_nn_module_stack`` on backward ones."""
    from torch._dynamo.backends.common import aot_autograd

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in range(2)})

        def forward(self, x):
            for layer in self.layers.values():
                x = torch.tanh(layer(x))
            return x.sum()

    blocks = []

    def keep(gm, example_inputs):
        from functorch.compile import make_boxed_func

        blocks.append({plan_backend.node_block(n) for n in gm.graph.nodes
                       if n.op == "call_function"} - {None})
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(Net(), backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    compiled(torch.ones(3, 4, requires_grad=True)).backward()
    assert blocks == [{0, 1}, {0, 1}]


def _shallow(blocks: int, slope: int, marks: bool = True) -> dict:
    """A shallow trace's output whose segment peaks grow by ``slope`` bytes per block."""
    layers = blocks
    every = list(range(layers))
    return {
        "layers": layers,
        "state": {"sharded_parameters": 100 * layers},
        "segments": {
            "op": {"1|last": (1000 + slope * layers, {"saved_activations": slope * layers}),
                   "1|None": (5000, {"temporaries": 5000}),
                   "1|mid": (10**9, {}),  # never read
                   "1|mid.1": (10**9, {}),
                   },
            "tensor": {"1|end": (2000 + slope * layers, {"saved_activations": slope * layers})},
            "scratch": {"1|first": (0, 300, 0), "2|None": (1, 200 + layers, 0)},
        },
        "layout": {}, "trace": {"per_graph": [{"aten.mm": 2 * layers}, {"aten.mm": 3 * layers}],
                                "marked_blocks": [every, every] if marks else [every, []],
                                "graphs": 2, "ops": {}},
    }


def test_segment_peaks_extrapolate_affinely_and_mid_blocks_are_left_out():
    tracker, state, trace = depth.extrapolate([_shallow(4, 10), _shallow(5, 10)], 32)
    # At 32 blocks the last block's segment (1000 + 320) is below the
    # block-free one (5000); at 400 it is above it.
    assert (tracker.peak, tracker.peak_by_category) == (5000, {"temporaries": 5000})
    assert depth.extrapolate([_shallow(4, 10), _shallow(5, 10)], 400)[0].peak == 5000 and \
        depth.extrapolate([_shallow(4, 20), _shallow(5, 20)], 400)[0].peak == 9000
    assert tracker.tensor_peak == 2320
    assert tracker.scratchpad_need == {0: 300, 1: 232}
    assert state == {"sharded_parameters": 3200}
    assert trace["ops"] == {"aten.mm": 160}


def test_traces_that_disagree_are_refused():
    a, b = _shallow(4, 10), _shallow(5, 10)
    del b["segments"]["op"]["1|None"]
    assert "op segments" in depth.extrapolate([a, b], 32)
    assert "do not name the block" in depth.extrapolate(
        [_shallow(4, 10, marks=False), _shallow(5, 10)], 32)
    b = _shallow(5, 10)
    b["trace"]["per_graph"].append({})
    assert "numbers of graphs" in depth.extrapolate([_shallow(4, 10), b], 32)


def _plan(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_neuron.plan", "--module", "tests.helpers.deep_recipes",
         "--json", "--hf_assets_path=./tests/assets/tokenizer", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ("--config", "deep_llama3_debugmodel", "--ngpu=2", "--target=cpu",
     "--training.seq_len=1024", "--training.local_batch_size=8"),
    ("--config", "deep_deepseek_v3_debugmodel_tp2_fsdp2", "--ngpu=4", "--target=trn2"),
    ("--config", "deep_gpt_oss_debugmodel", "--ngpu=2", "--target=trn2"),
], ids=["llama-cpu", "deepseek-trn2", "gpt-oss-trn2"])
def test_shallow_traces_plan_a_deep_model_to_the_byte(args):
    shallow, every = _plan(*args), _plan(*args, "--every-block")
    assert shallow["trace"].pop("traced_layers") in ([4, 5], [5, 6], [8, 10])
    assert shallow["trace"].pop("layers") in (14, 28)
    assert "traced_layers" not in every["trace"]
    assert shallow == every


def test_the_report_says_a_plan_came_from_shallow_traces():
    from torchtitan_neuron.plan.report import Plan

    plan = Plan(recipe="r", ngpu=64, target="cpu", layout={}, peak_gib=1.0, capacity_gib=2.0,
                trace={"traced_layers": [4, 5], "layers": 32})
    assert "traced: the first 4 and 5 of 32 blocks, extrapolated" in plan.describe()
    assert "traced:" not in Plan(recipe="r", ngpu=64, target="cpu", layout={}, peak_gib=1.0,
                                 capacity_gib=2.0).describe()
