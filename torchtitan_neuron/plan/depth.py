"""Plans of deep models from two shallow traces of the same recipe.

Dynamo and AOTAutograd trace every transformer block of the step, and that
is most of a plan's time (docs/planner.md, "Plan time"). A model's blocks
after the first few are alike, or alike in units of a few (GPT-OSS
alternates two kinds of attention), so the planner traces the recipe twice
with the repeated run cut to ``REDUCED`` units, in two processes at once,
and extrapolates to the recipe's depth.

Why that is exact: each trace records the peak of every segment of the
step, a compiled program's run (or the eager ops after it) and within it the
ops of one block, told by its place (``memory_accounting.storage_tracker.block_class``). The bytes
alive in a segment are its own pattern plus what the other blocks hold (the
saved activations of the blocks before it, the gradients of those after
it, the sharded state), which is affine in the depth; so each segment's
peak is too, and two depths give it at any depth. The units between the
second and the penultimate, whose number grows with the depth, have the
same neighbours as those two and peak below one of them. The two traces
must have the same segments and graphs, or the plan traces every block.

``--every-block`` (or ``--top``, which lists the storages alive at the
peak) traces the whole model instead.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

from torchtitan_neuron.plan.report import Plan
from torchtitan_neuron.plan.sweep import plan_command, start_plan

# Units of the repeated run in the two shallow traces. Four is the fewest
# with a ``second`` and a ``penult`` unit that differ from ``first`` and
# ``last``.
REDUCED = (4, 5)
# Below this many repeated units, tracing all of them costs little more.
MIN_REPEATED = 12
MAX_PERIOD = 4


def _alike(a, b) -> bool:
    """Two block configs that build the same modules: equal but for their
    initialisation (``param_init``, which scales with the block's index)."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            f.name == "param_init" or _alike(getattr(a, f.name), getattr(b, f.name))
            for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_alike, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_alike(a[k], b[k]) for k in a)
    return a == b


def layer_run(config) -> tuple[int, int, int] | None:
    """(head, layers, period): the model's block count, and the run of alike
    units of ``period`` blocks that ends it, after ``head`` blocks that
    differ (DeepSeek's dense first block). The period is the shortest
    (up to ``MAX_PERIOD``) whose run has ``MIN_REPEATED`` units; GPT-OSS
    alternates sliding-window and full attention, period 2. None when the
    model has no list of block configs."""
    layers = getattr(getattr(getattr(config, "model_spec", None), "model", None), "layers", None)
    if not isinstance(layers, list) or not layers:
        return None
    n = len(layers)
    runs = []
    for period in range(1, MAX_PERIOD + 1):
        head = n - period
        while head - period >= 0 and all(
                _alike(layers[head - period + j], layers[head + j]) for j in range(period)):
            head -= period
        if head < 0:
            break
        runs.append((head, n, period))
        if (n - head) // period >= MIN_REPEATED:
            return head, n, period
    return runs[0]


def why_every_block(config, every_block: bool, top: int) -> str | None:
    """Why this plan traces every block, or None when two shallow traces
    serve."""
    if every_block:
        return "--every-block"
    if top:
        return "--top lists the storages alive at the peak of the whole model"
    compile_cfg = config.compile
    if not compile_cfg.enable or "model" not in compile_cfg.components:
        return "the model is not compiled, so its ops carry no block"
    if getattr(config.parallelism, "pipeline_parallel_degree", 1) > 1:
        return "pipeline stages split the blocks"
    run = layer_run(config)
    if run is None:
        return "the model has no list of blocks"
    head, layers, period = run
    if (layers - head) // period < MIN_REPEATED:
        return f"{(layers - head) // period} repeated units are few enough to trace"
    return None


def traced_layers(config) -> tuple[int, int]:
    """The block counts of the two shallow traces."""
    head, _, period = layer_run(config)
    return tuple(head + period * units for units in REDUCED)


def truncate(config, units: int) -> tuple[int, int, int]:
    """Cut the model to its head and ``units`` units of its repeated run;
    returns (head, layers, period) of the cut model."""
    head, _, period = layer_run(config)
    config.model_spec.model.layers = config.model_spec.model.layers[:head + period * units]
    return head, head + period * units, period


def shallow_traces(opts, overrides: list[str]) -> tuple[list[dict], str | None]:
    """The two shallow traces, each in its own process (a fake world and
    compile state of its own), run at once; (results, error)."""
    waits = [(units, start_plan(plan_command(opts, f"--layers-traced={units}", *overrides)))
             for units in REDUCED]
    results, error = [], None
    for units, wait in waits:
        result, why = wait()
        if result is None:
            error = error or f"the {units}-unit trace failed: {why}"
        else:
            results.append(result)
    return results, error


def _affine(v1: int, v2: int, at: int) -> int:
    """The value at ``at`` repeated units of one that is ``v1`` at
    ``REDUCED[0]`` and ``v2`` at ``REDUCED[1]``."""
    return v1 + (v2 - v1) * (at - REDUCED[0])


def _without_mid(peaks: dict) -> dict:
    return {k: v for k, v in peaks.items() if not k.split("|")[1].startswith("mid")}


def extrapolate(shallow: list[dict], repeated: int) -> tuple[SimpleNamespace, dict, dict] | str:
    """(tracker-like peaks, state bytes, trace facts) at ``repeated``
    units of the repeated run, from the two shallow traces; or why not."""
    a, b = shallow
    seg_a, seg_b = a["segments"], b["segments"]
    for level in ("op", "tensor", "scratch"):
        if _without_mid(seg_a[level]).keys() != _without_mid(seg_b[level]).keys():
            return f"the two shallow traces differ in their {level} segments"
    if len(a["trace"]["per_graph"]) != len(b["trace"]["per_graph"]):
        return "the two shallow traces compiled different numbers of graphs"
    for shallow_trace in (a, b):
        every = list(range(shallow_trace["layers"]))
        # The forward and the backward graph must each tell every block's ops.
        if sum(marked == every for marked in shallow_trace["trace"]["marked_blocks"]) < 2:
            return ("the compiled graphs do not name the block of each op "
                    "(torch.fx node meta nn_module_stack / fwd_nn_module_stack)")

    def level_peak(level: str) -> tuple[int, dict]:
        best = (0, {})
        for key, (bytes_a, cats_a) in _without_mid(seg_a[level]).items():
            bytes_b, cats_b = seg_b[level][key]
            total = _affine(bytes_a, bytes_b, repeated)
            if total > best[0]:
                cats = {c: _affine(cats_a.get(c, 0), cats_b.get(c, 0), repeated)
                        for c in cats_a.keys() | cats_b.keys()}
                best = (total, cats)
        return best

    peak, peak_by_category = level_peak("op")
    tensor_peak, tensor_by_category = level_peak("tensor")
    need: dict[int, int] = {}
    large: dict[int, int] = {}
    for key, (index, need_a, large_a) in _without_mid(seg_a["scratch"]).items():
        index_b, need_b, large_b = seg_b["scratch"][key]
        if index_b != index:
            return "the two shallow traces ran their programs in a different order"
        need[index] = max(need.get(index, 0), _affine(need_a, need_b, repeated))
        large[index] = max(large.get(index, 0), _affine(large_a, large_b, repeated))
    tracker = SimpleNamespace(peak=peak, peak_by_category=peak_by_category,
                              tensor_peak=tensor_peak, tensor_peak_by_category=tensor_by_category,
                              scratchpad_need=need, scratchpad_large=large)
    state = {k: _affine(a["state"][k], b["state"][k], repeated) for k in a["state"]}
    ops: Counter = Counter()
    for graph_a, graph_b in zip(a["trace"]["per_graph"], b["trace"]["per_graph"]):
        for op in graph_a.keys() | graph_b.keys():
            ops[op] += _affine(graph_a.get(op, 0), graph_b.get(op, 0), repeated)
    trace = {k: v for k, v in a["trace"].items() if k not in ("per_graph", "marked_blocks")}
    trace["ops"] = dict(sorted((op, n) for op, n in ops.items() if n))
    return tracker, state, trace


def shallow_plan(opts, overrides: list[str], config) -> tuple[Plan | None, str]:
    """The plan of ``config`` from two shallow traces; (None, why) when it
    cannot be made that way, and the caller traces every block."""
    from torchtitan_neuron.plan.core import assemble

    head, layers, period = layer_run(config)
    shallow, error = shallow_traces(opts, overrides)
    if error:
        return None, error
    result = extrapolate(shallow, (layers - head) // period)
    if isinstance(result, str):
        return None, result
    tracker, state, trace = result
    trace["traced_layers"] = list(traced_layers(config))
    trace["layers"] = layers
    return assemble(tracker, state, recipe=opts.config, ngpu=opts.ngpu, target=opts.target,
                    layout=shallow[0]["layout"], trace=trace, largest=[]), ""
