"""``--compile.prefetch`` (on by default): the FX pass that issues each
block's gather while the block before it computes, and waits on each
gradient reduce-scatter only when the next one is issued
(torchtitan_neuron/experiments/graph_trainer/prefetch.py).

Proves:

- on hand-built graphs of the shape inductor's post-grad graphs have (flat
  shard, all-gather, wait, compute), each parameter gather after the first
  moves up to just after the previous gather's wait, with the ops that build
  its flat input and nothing else; its wait stays before its first use;
- a gather whose input is computed (an activation's gather) is left alone;
- each reduce-scatter's wait, with the ops that only carry its result to the
  outputs, moves to just before the next reduce-scatter; a wait whose result
  is used by compute before then is left alone;
- the pass only reorders: every node is kept, and the graph lints;
- it is on by default, installs inductor's hook only for inductor,
  and keys inductor's cache by this file (``uuid``);
- upstream's hook and ops exist as the pass uses them (drift);
- the debug recipe trained with and without it gives equal losses, and its
  log says what moved: tests/test_reference.py (slow tier), which runs
  ``make train``'s command both ways.

Tier: fast (unit).
Run: .venv/bin/python -m pytest tests/test_prefetch.py -q
"""

import torch
import torch.fx

from torchtitan_neuron.experiments.graph_trainer.prefetch import (
    ALL_GATHER,
    REDUCE_SCATTER,
    WAIT,
    PrefetchPass,
    defer_reduce_scatter_waits,
    enable_prefetch,
    prefetch_gathers,
)

aten = torch.ops.aten


def _forward_graph(blocks: int, activation_gather: bool = False):
    """Per block: cat of the block's shard -> all-gather -> wait -> mm with
    the running activation. With ``activation_gather``, the last block's
    gather gathers the activation instead (as sequence parallelism does)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    shards = [g.placeholder(f"shard{i}") for i in range(blocks)]
    names = {}
    for i, shard in enumerate(shards):
        src = x if activation_gather and i == blocks - 1 else shard
        flat = g.call_function(aten.cat.default, ([src],))
        gather = g.call_function(ALL_GATHER, (flat, 2, "0"))
        wait = g.call_function(WAIT, (gather,))
        x = g.call_function(aten.mm.default, (x, wait))
        names[i] = (flat, gather, wait, x)
    g.output(x)
    return g, names


def _order(g):
    return {n: i for i, n in enumerate(g.nodes)}


def test_each_gather_moves_up_to_the_previous_wait_with_its_input():
    g, n = _forward_graph(3)
    before = list(g.nodes)
    assert prefetch_gathers(g) == 2
    g.lint()
    assert sorted(map(str, g.nodes)) == sorted(map(str, before))
    pos = _order(g)
    for i in (1, 2):
        flat, gather, wait, mm = n[i]
        prev_wait, prev_mm = n[i - 1][2], n[i - 1][3]
        # Issued right after the previous wait, before the previous block's compute...
        assert pos[flat] == pos[prev_wait] + 1 and pos[gather] == pos[flat] + 1
        assert pos[gather] < pos[prev_mm]
        # ...and waited on where it was, just before its own block computes.
        assert pos[prev_mm] < pos[wait] < pos[mm]
    # The first gather has nothing to overlap with: left in place.
    assert pos[n[0][1]] == pos[n[0][0]] + 1


def test_a_gather_of_a_computed_tensor_is_left_alone():
    g, n = _forward_graph(3, activation_gather=True)
    assert prefetch_gathers(g) == 1
    pos = _order(g)
    flat, gather, wait, mm = n[2]
    assert pos[flat] > pos[n[1][3]]  # still after the mm it depends on
    assert pos[gather] == pos[flat] + 1


def _backward_graph(blocks: int, early_use: bool = False):
    """Per block: mm (the gradient) -> reduce-scatter -> wait -> view, the
    views returned. With ``early_use``, block 0's gradient shard feeds the
    next block's compute."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    outs, names = [], {}
    for i in range(blocks):
        grad = g.call_function(aten.mm.default, (x, x))
        scatter = g.call_function(REDUCE_SCATTER, (grad, "sum", 2, "0"))
        wait = g.call_function(WAIT, (scatter,))
        rewait = g.call_function(WAIT, (wait,))  # as torch's autograd gather emits
        view = g.call_function(aten.view.default, (rewait, [-1]))
        if early_use and i == 0:
            x = g.call_function(aten.add.Tensor, (x, view))
        outs.append(view)
        names[i] = (grad, scatter, wait, rewait, view)
    g.output(tuple(outs))
    return g, names


def test_each_reduce_scatter_wait_moves_to_the_next_scatter():
    g, n = _backward_graph(3)
    assert defer_reduce_scatter_waits(g) == 2
    g.lint()
    pos = _order(g)
    for i in (0, 1):
        _, scatter, wait, rewait, view = n[i]
        next_grad, next_scatter = n[i + 1][0], n[i + 1][1]
        # The next block's gradient is computed while this scatter runs.
        assert pos[scatter] < pos[next_grad] < pos[wait] < pos[rewait] < pos[view] < pos[next_scatter]
    # The last has no next scatter: left in place.
    _, scatter, wait, _, _ = n[2]
    assert pos[wait] == pos[scatter] + 1


def test_a_wait_whose_result_feeds_compute_is_left_alone():
    g, n = _backward_graph(3, early_use=True)
    assert defer_reduce_scatter_waits(g) == 1
    pos = _order(g)
    assert pos[n[0][2]] == pos[n[0][1]] + 1  # block 0's wait: its shard is used at once
    assert pos[n[1][2]] > pos[n[2][0]]       # block 1's moved


def test_the_pass_reorders_only_and_keys_the_cache_by_its_source():
    g, _ = _forward_graph(4)
    text = sorted(str(n.target) for n in g.nodes)
    PrefetchPass()(g)
    assert sorted(str(n.target) for n in g.nodes) == text
    assert PrefetchPass().uuid() == PrefetchPass().uuid() and PrefetchPass().uuid()


def test_flag_on_by_default_and_installed_only_for_inductor():
    import torch._inductor.config as inductor_config
    from torchtitan.config import ConfigManager

    def parse(*overrides):
        return ConfigManager().parse_args(
            ["--module", "torchtitan_neuron.experiments.graph_trainer.llama3",
             "--config", "simple_fsdp_llama3_8b", *overrides])

    assert parse().compile.prefetch
    assert not parse("--compile.no-prefetch").compile.prefetch
    with inductor_config.patch(post_grad_custom_post_pass=None):
        for backend in ("neuron", "aot_eager"):
            assert not enable_prefetch(backend)
            assert inductor_config.post_grad_custom_post_pass is None
        assert enable_prefetch("inductor")
        assert isinstance(inductor_config.post_grad_custom_post_pass, PrefetchPass)


def test_upstream_hook_and_ops_are_the_ones_the_pass_uses():
    """Drift: inductor still runs ``post_grad_custom_post_pass`` over the
    post-grad graphs and keys its FX graph cache with the pass's uuid, and
    the functional collectives keep their names and their one tensor
    argument."""
    import inspect

    import torch._inductor.codecache as codecache
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes import post_grad

    assert hasattr(inductor_config, "post_grad_custom_post_pass")
    assert "config.post_grad_custom_post_pass" in inspect.getsource(post_grad.post_grad_passes)
    assert "post_grad_custom_post_pass" in inspect.getsource(codecache)
    # A collective's one tensor input comes first; a wait takes the
    # collective's result.
    for op in (ALL_GATHER, REDUCE_SCATTER, WAIT):
        args = op._schema.arguments
        assert str(args[0].type) == "Tensor" and not any(
            str(a.type).startswith("Tensor") for a in args[1:]), op._schema
