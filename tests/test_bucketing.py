"""SimpleFSDP bucketing: one all-gather and one reduce-scatter per block.

Proves, on gloo ranks with a two-block model compiled by Dynamo and
AOTAutograd (the path every backend, ``neuron`` included, receives):

- the forward graph holds one all-gather per block instead of one per
  parameter, the backward graph one re-gather per block (parameters are
  still resharded after forward) and one reduce-scatter per block instead of
  one per gradient;
- a size bound (``bucket_mib``) cuts a block into several buckets, three
  here, with three gathers, re-gathers and reduce-scatters per block;
- outputs and every parameter's gradient equal the per-parameter gathers'
  to 1e-6 in fp32, with no AC and with full AC per block, on FSDP2 with a
  parameter whose 3 rows do not split evenly over 2 ranks (padded), and on
  TP2 x FSDP2 with column- and row-wise TP weights beside a plain one;
- without ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``
  Dynamo refuses the bucketed block under AC (the upstream behaviour the
  ``simple-fsdp-bucketing`` row of docs/upstream-workarounds.md rests on).

The losses of real recipes trained with and without bucketing are compared
at the end of this file (DeepSeek's bucketed EP and TP x EP runs are checked
against 1 rank in test_deepseek.py).

Tier: e2e; the 2-rank FSDP test in ``make test`` (14 s on the 2-core
machine), the 4-rank TP x FSDP test (36 s) and the real recipes in
``make test-slow``.
Run: .venv/bin/python -m pytest tests/test_bucketing.py -q
"""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from conftest import BF16

pytestmark = pytest.mark.e2e

AG = "all_gather_into_tensor"
RS = "reduce_scatter_tensor"
BLOCKS = 2


class Block(nn.Module):
    def __init__(self, odd_rows: int) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=True)
        self.b = nn.Linear(8, 8, bias=False)
        self.odd = nn.Parameter(torch.randn(odd_rows, 8))

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x))) + self.odd.sum(0)


class Toy(nn.Module):
    def __init__(self, odd_rows: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(odd_rows) for i in range(BLOCKS)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def _counting_backend(counts: dict):
    """The ``aot_eager`` backend (AOTAutograd with the min-cut partitioner,
    as inductor and ``neuron`` get), counting collectives per graph."""
    import functools

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.debugging import aot_eager

    def compiler(kind):
        def compile_fn(gm, _inputs):
            for node in gm.graph.nodes:
                name = getattr(node.target, "__name__", "")
                for op in (AG, RS):
                    if name.startswith(op):
                        counts[f"{kind}_{op}"] = counts.get(f"{kind}_{op}", 0) + 1
            return make_boxed_func(gm)
        return compile_fn

    return functools.partial(aot_eager, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))


def _build(dims, tp: bool, ac, bucket, odd_rows: int,
           param_dtype: str = "float32", reshard: bool = True):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

    from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import reshard_after_forward
    from torchtitan_neuron.experiments.graph_trainer.bucketing import bucket_blocks

    torch.manual_seed(0)
    model = Toy(odd_rows)
    if tp:
        for block in model.layers.values():
            parallelize_module(block, dims.get_mesh("tp"),
                               {"a": ColwiseParallel(), "b": RowwiseParallel()})
    if ac == "selective":
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model, SelectiveAC.Config(), "")
    elif ac:
        for name, block in list(model.layers.items()):
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    training = SimpleNamespace(mixed_precision_param=param_dtype,
                               mixed_precision_reduce="float32")
    model = apply_simple_fsdp(model, parallel_dims=dims, training=training)
    reshard_after_forward(model, reshard)
    if not reshard:
        # What parallelize does for --parallelism.fsdp_reshard_after_forward
        # never: gathers before each block's AC region, bucketed or not.
        assert bucket_blocks(model, getattr(torch, param_dtype), torch.float32,
                             None if not bucket else bucket_mib_default(),
                             reshard_after_forward=False)[0] == (BLOCKS if bucket or ac else 0)
        return model
    if bucket == "split":
        # A bound of 80 fp32 elements: [a.weight (64), a.bias (8)], [b.weight
        # (64)], [odd (its padded rows)] per block.
        assert bucket_blocks(model, getattr(torch, param_dtype), torch.float32,
                             bucket_mib=80 * 4 / 2**20) == (BLOCKS, 4 * BLOCKS, 3 * BLOCKS)
    elif bucket:
        assert bucket_blocks(model, getattr(torch, param_dtype),
                             torch.float32) == (BLOCKS, 4 * BLOCKS, BLOCKS)
    return model


def _step(model, x, counts):
    out = torch.compile(model, backend=_counting_backend(counts), fullgraph=True)(x)
    out.square().sum().backward()
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    return out.detach(), grads


def _worker(rank: int, world: int, port: int, tp: bool, odd_rows: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torchtitan.distributed.parallel_dims import ParallelDims

        from torchtitan_neuron import devices

        devices.install()  # a CPU device mesh
        dims = ParallelDims(dp_replicate=1, dp_shard=world // (2 if tp else 1), cp=1,
                            tp=2 if tp else 1, pp=1, ep=1, world_size=world,
                            spmd_backend="partial_dtensor")
        dims.build_mesh()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank // (2 if tp else 1)))
        out = {}
        for ac in (False, True):
            runs = {}
            for bucket in (False, True) if tp else (False, True, "split"):
                torch._dynamo.reset()
                counts: dict = {}
                model = _build(dims, tp, ac, bucket, odd_rows)
                runs[bucket] = (*_step(model, x, counts), counts)
            (o0, g0, c0), (o1, g1, c1) = runs[False], runs[True]
            out[ac] = dict(
                out_diff=(o0 - o1).abs().max().item(),
                grad_diff={n: (g0[n] - g1[n]).abs().max().item() for n in g0},
                before=c0, after=c1)
            if "split" in runs:
                o2, g2, c2 = runs["split"]
                out[ac].update(split_out_diff=(o0 - o2).abs().max().item(),
                               split_grad_diff=max((g0[n] - g2[n]).abs().max().item()
                                                   for n in g0),
                               split=c2)
        if not tp:
            # Upstream Dynamo refuses the hand-off under AC without the flag.
            torch._dynamo.reset()
            model = _build(dims, tp, True, True, odd_rows)
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = False
            try:
                _step(model, x, {})
                out["without_flag"] = "ran"
            except Exception as exc:  # noqa: BLE001 - the message is the check
                out["without_flag"] = f"{type(exc).__name__}: {exc}"
            finally:
                torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        results[rank] = out
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tp: bool, odd_rows: int) -> dict:
    from runlog import free_port

    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, free_port(), tp, odd_rows, results), nprocs=world)
    assert len(results) == world
    return dict(results)


def _check(results: dict):
    params = 4 * BLOCKS
    for rank, out in results.items():
        for ac in (False, True):
            r = out[ac]
            assert r["out_diff"] <= 1e-6, (rank, ac, r)
            assert max(r["grad_diff"].values()) <= 1e-6, (rank, ac, r["grad_diff"])
            assert len(r["grad_diff"]) == params
            # Before: one gather per parameter in forward and one
            # reduce-scatter per gradient; the partitioner re-gathers most
            # in backward and saves a few tiny ones (biases). After: one of
            # each per block, and the re-gather of every block kept (reshard
            # after forward).
            before = r["before"]
            assert before[f"fw_{AG}"] == params and before[f"bw_{RS}"] == params, before
            assert BLOCKS < before[f"bw_{AG}"] <= params, before
            assert r["after"] == {f"fw_{AG}": BLOCKS, f"bw_{AG}": BLOCKS,
                                  f"bw_{RS}": BLOCKS}, (rank, ac, r["after"])
            if "split" in r:
                # A size bound of 3 buckets per block: 3 gathers and 3
                # reduce-scatters per block; the partitioner may save a small
                # bucket's gather rather than recompute it, as it saves tiny
                # per-parameter ones.
                split = r["split"]
                assert r["split_out_diff"] <= 1e-6 and r["split_grad_diff"] <= 1e-6, r
                assert split[f"fw_{AG}"] == split[f"bw_{RS}"] == 3 * BLOCKS, (rank, ac, split)
                assert BLOCKS <= split[f"bw_{AG}"] <= 3 * BLOCKS, (rank, ac, split)


def bucket_mib_default():
    from torchtitan_neuron.experiments.graph_trainer.bucketing import DEFAULT_BUCKET_MIB

    return DEFAULT_BUCKET_MIB


def _never_worker(rank: int, world: int, port: int, results):
    """Each AC mode and bucketing, resharded and kept: outputs, gradients
    and the collectives of the compiled graphs."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torchtitan.distributed.parallel_dims import ParallelDims

        from torchtitan_neuron import devices

        devices.install()
        dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1,
                            world_size=world, spmd_backend="partial_dtensor")
        dims.build_mesh()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        out = {}
        for ac in (False, True, "selective"):
            for bucket in (False, True):
                runs = {}
                for reshard in (True, False):
                    torch._dynamo.reset()
                    counts: dict = {}
                    model = _build(dims, False, ac, bucket, 3, reshard=reshard)
                    runs[reshard] = (*_step(model, x, counts), counts)
                (o0, g0, c0), (o1, g1, c1) = runs[True], runs[False]
                out[(str(ac), bucket)] = dict(
                    out_diff=(o0 - o1).abs().max().item(),
                    grad_diff=max((g0[n] - g1[n]).abs().max().item() for n in g0),
                    resharded=c0, kept=c1)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_never_reshard_keeps_the_gathers_for_backward():
    """``--parallelism.fsdp_reshard_after_forward never``: under no, full and
    selective AC, with and without bucketing, the backward graph gathers
    nothing, the forward gathers as before, and outputs and gradients equal
    the resharded run's to 1e-6 in fp32."""
    from runlog import free_port

    results = mp.Manager().dict()
    mp.spawn(_never_worker, args=(2, free_port(), results), nprocs=2)
    params = 4 * BLOCKS
    for rank, out in dict(results).items():
        assert len(out) == 6, out
        for (ac, bucket), r in out.items():
            assert r["out_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6, (rank, ac, bucket, r)
            n = BLOCKS if bucket else params
            kept, resharded = r["kept"], r["resharded"]
            assert kept == {f"fw_{AG}": n, f"bw_{RS}": n}, (rank, ac, bucket, kept)
            assert resharded[f"fw_{AG}"] == n and resharded[f"bw_{AG}"] >= BLOCKS, (
                rank, ac, bucket, resharded)


def test_fsdp_one_gather_per_block_equal_results_with_uneven_rows():
    results = _spawn(2, tp=False, odd_rows=3)
    _check(results)
    for out in results.values():
        assert "Unsafe side effect" in out["without_flag"], out["without_flag"]


@pytest.mark.slow
def test_tp_by_fsdp_one_gather_per_block_equal_results():
    _check(_spawn(4, tp=True, odd_rows=4))


# ---------------------------------------------------------------------------
# Real recipes, launched as a user would (slow tier)

RECIPES = {
    # name: (ranks, module, config, extra flags)
    # the recipe's bf16 gathers and fp32 reduce-scatters (_GatherBucket)
    "llama-selective-ac-bf16": (2, None, None, BF16),
    # fp32 throughout (torch's differentiable functional all-gather)
    "llama-full-ac-fp32": (2, None, None, ["activation-checkpoint:full"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_losses_equal_without_bucketing(tmp_path, name):
    """Same seed and data with and without --compile.no-bucketing: every
    step-line loss equal, and the first and last loss of the run summary
    (full precision) within 1e-6."""
    import json

    from conftest import FAST, run_train
    from runlog import DEBUG_CONFIG, LLAMA_MODULE

    ranks, module, config, extra = RECIPES[name]
    summaries, steps = {}, {}
    for flag in ([], ["--compile.no-bucketing"]):
        # Trainer flags first; a subcommand (activation-checkpoint:...) ends the line.
        args = [*FAST, "--training.steps", "4", "--debug.seed", "7", *flag, *extra]
        dump = tmp_path / ("off" if flag else "on")
        run = run_train(args, ngpu=ranks, module=module or LLAMA_MODULE,
                        config=config or DEBUG_CONFIG, dump_folder=dump, timeout=900)
        assert run.returncode == 0, run.output[-4000:]
        assert ("SimpleFSDP bucketing:" in run.output) == (not flag), run.output[-4000:]
        summaries[bool(flag)] = json.loads((dump / "run_summary.json").read_text())
        steps[bool(flag)] = [s.loss for s in run.steps]
    assert len(steps[False]) == 4 and steps[False] == steps[True], steps
    for key in ("loss_first", "loss_last"):
        on, off = summaries[False][key], summaries[True][key]
        assert abs(on - off) <= 1e-6 * abs(off), (key, on, off)
