"""Prefetch each block's gather, and let each gradient reduce-scatter run
under the next block's backward: an FX pass over the forward and backward
graphs inductor compiles (on by default; ``--compile.no-prefetch`` turns it
off).

In the graphs as traced, a block's bucketed all-gather
(``bucketing.py``) is issued where the block starts and waited on at once,
and a reduce-scatter of its gradient is waited on as soon as it is issued:
every collective is exposed. The pass moves:

- each all-gather whose inputs are parameter shards (no matmul or collective
  among its inputs since the previous gather), together with the padding,
  concatenation and cast that build its flat input, up to just after the
  previous all-gather's wait: block k+1's gather runs while block k
  computes. Its wait stays where it was, just before block k+1 first uses
  it, so at most one further bucket is held at a time;
- each reduce-scatter's wait, with the ops that only carry its result to the
  graph outputs, down to just before the next reduce-scatter is issued.

Only the order of the graph changes, never what it computes, and every rank
reorders its identical graph identically, so all ranks issue their
collectives in one order. It is applied through inductor's own hook,
``torch._inductor.config.post_grad_custom_post_pass``, a ``CustomGraphPass``
whose ``uuid`` keys inductor's FX graph cache; other backends (``neuron``,
``aot_eager``) schedule the graphs they receive themselves and do not get
it (docs/benchmarks.md).
"""

from __future__ import annotations

import logging

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

logger = logging.getLogger(__name__)

_c10d = torch.ops._c10d_functional
ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
WAIT = _c10d.wait_tensor.default
COLLECTIVES = frozenset({ALL_GATHER, REDUCE_SCATTER, _c10d.all_reduce.default,
                         _c10d.all_to_all_single.default})
# Ops a gather's flat input may not be built from: it would move compute.
_COMPUTE = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                      torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default})


def _wait_of(node: torch.fx.Node) -> torch.fx.Node | None:
    waits = [u for u in node.users if u.target is WAIT]
    return waits[0] if len(waits) == 1 else None


def _ancestors_after(node: torch.fx.Node, position: dict, start: int) -> list[torch.fx.Node]:
    """``node``'s ancestors placed after ``start``, ``node`` included, in
    graph order."""
    seen, stack = {node}, [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen and position[arg] > start:
                seen.add(arg)
                stack.append(arg)
    return sorted(seen, key=position.__getitem__)


def _descendants(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user.op != "output" and user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def prefetch_gathers(graph: torch.fx.Graph) -> int:
    """Move each parameter all-gather up to just after the previous gather's
    wait. Returns the gathers moved."""
    moved, previous_wait = 0, None
    for gather in [n for n in graph.nodes if n.target is ALL_GATHER]:
        wait = _wait_of(gather)
        if wait is None:
            previous_wait = None
            continue
        if previous_wait is not None:
            position = {n: i for i, n in enumerate(graph.nodes)}
            start = position[previous_wait]
            if position[gather] > start + 1:
                chain = _ancestors_after(gather, position, start)
                if not any(n.target in _COMPUTE or n.target in COLLECTIVES or n.target is WAIT
                           for n in chain[:-1]):
                    cursor = previous_wait
                    for n in chain:
                        cursor.append(n)
                        cursor = n
                    moved += 1
        previous_wait = wait
    return moved


def defer_reduce_scatter_waits(graph: torch.fx.Graph) -> int:
    """Move each reduce-scatter's wait, and the ops that only carry its
    result to the outputs, down to just before the next reduce-scatter.
    Returns the waits moved."""
    scatters = [n for n in graph.nodes if n.target is REDUCE_SCATTER]
    moved = 0
    for scatter, following in zip(scatters, scatters[1:]):
        wait = _wait_of(scatter)
        if wait is None:
            continue
        position = {n: i for i, n in enumerate(graph.nodes)}
        carried = _descendants(wait)
        # A wait on the waited result (a second wait_tensor) moves with it.
        if any(n.target in COLLECTIVES or (n.target is WAIT and n.args[0] not in carried)
               for n in carried - {wait}):
            continue
        # Only down: what moves lies before the next scatter, and so do its
        # other inputs, which come before it.
        if any(position[n] > position[following] for n in carried):
            continue
        for n in sorted(carried, key=position.__getitem__):
            following.prepend(n)
        moved += 1
    return moved


class PrefetchPass(CustomGraphPass):
    """``post_grad_custom_post_pass``: prefetch gathers, defer reduce-scatter
    waits, in every graph inductor compiles."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        gathers = prefetch_gathers(graph)
        waits = defer_reduce_scatter_waits(graph)
        if gathers or waits:
            graph.lint()
            logger.info(f"Prefetch: {gathers} gathers prefetched, {waits} reduce-scatter "
                        "waits deferred in one graph (--compile.no-prefetch: as traced)")

    def uuid(self):
        return get_hash_for_files((__file__,))


def enable_prefetch(backend: str) -> bool:
    """Install the pass for ``backend`` ``inductor``; other backends never
    run inductor's post-grad passes. Returns whether it was installed."""
    if backend != "inductor":
        return False
    import torch._inductor.config as inductor_config

    inductor_config.post_grad_custom_post_pass = PrefetchPass()
    return True
