"""The chunked loss gathers a SimpleFSDP ``lm_head`` once per microbatch.

Proves, on 2 gloo ranks with an ``lm_head`` whose 15 rows do not split evenly
(padded), sharded by upstream's ``apply_simple_fsdp``, 4 chunks, 2
microbatches accumulated:

- upstream's ``ChunkedLossWrapperWithParamGrads`` all-gathers the weight and
  reduce-scatters its gradient once per chunk (8 and 8);
  ``SimpleFSDPChunkedLoss`` on a marked ``lm_head`` once per microbatch;
- the losses, the hidden states' gradients and the weight's accumulated sharded gradient are
  equal to upstream's to 1e-6, with fp32 parameters and with bf16 gathers and
  fp32 reduce-scatters (the chunk gradients are summed in fp32 either way);
- an unmarked ``lm_head`` (``--compile.no-bucketing``) keeps upstream's
  per-chunk gathers.

The recipes' losses with and without bucketing (which covers this) are
compared in tests/test_bucketing.py.

Tier: e2e, 2 processes per dtype (about 14 s).
Run: .venv/bin/python -m pytest tests/test_chunked_loss.py -q
"""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.e2e

AG, RS = "all_gather_into_tensor", "reduce_scatter_tensor"
MICROBATCHES = 2


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(8, 15, bias=False)


def _run(dims, kind: str, param_dtype: str):
    from torch.distributed.tensor.debug import CommDebugMode
    from torchtitan.experiments.graph_trainer.chunked_loss import (
        ChunkedLossWrapperWithParamGrads,
    )
    from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

    from torchtitan_neuron.experiments.graph_trainer import chunked_loss

    torch.manual_seed(0)
    training = SimpleNamespace(mixed_precision_param=param_dtype,
                               mixed_precision_reduce="float32")
    model = apply_simple_fsdp(Head(), parallel_dims=dims, training=training)
    cls = ChunkedLossWrapperWithParamGrads if kind == "upstream" else chunked_loss.SimpleFSDPChunkedLoss
    loss_fn = cls.Config(num_chunks=4).build(compile_config=None)
    loss_fn.set_lm_head(model.lm_head)
    marked = chunked_loss.mark(model.lm_head, getattr(torch, param_dtype), torch.float32) \
        if kind == "marked" else 0
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, hidden_grads = [], []
    with CommDebugMode() as comm:
        for _ in range(MICROBATCHES):  # gradient accumulation
            hidden = torch.randn(2, 8, 8, generator=g).to(getattr(torch, param_dtype))
            hidden.requires_grad_()
            labels = torch.randint(0, 15, (2, 8), generator=g)
            loss, _ = loss_fn(hidden, labels, torch.tensor(64.0))
            loss.backward()
            losses.append(loss.item())
            hidden_grads.append(hidden.grad.float())
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    weight = model.lm_head._parameters["weight"]
    return dict(
        marked=marked, loss=torch.tensor(losses), hidden=torch.stack(hidden_grads),
        grad=weight.grad.to_local().clone(),
        ag=sum(v for k, v in counts.items() if AG in k),
        rs=sum(v for k, v in counts.items() if RS in k))


def _worker(rank: int, port: int, dtype: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torchtitan.distributed.parallel_dims import ParallelDims

        from torchtitan_neuron import devices

        devices.install()  # a CPU device mesh
        dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1,
                            world_size=2, spmd_backend="partial_dtensor")
        dims.build_mesh()
        runs = {kind: _run(dims, kind, dtype) for kind in ("upstream", "unmarked", "marked")}
        up = runs["upstream"]
        results[rank] = {kind: dict(
            marked=r["marked"], ag=r["ag"], rs=r["rs"],
            loss_diff=(r["loss"] - up["loss"]).abs().max().item(),
            hidden_diff=(r["hidden"] - up["hidden"]).abs().max().item(),
            grad_diff=(r["grad"] - up["grad"]).abs().max().item(),
            grad_rows=r["grad"].shape[0]) for kind, r in runs.items()}
    finally:
        dist.destroy_process_group()


# One process pair per dtype: upstream's SimpleFSDP classes are cached per
# module class, with the first instance's mixed-precision policy.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lm_head_gathered_once_with_equal_gradients(dtype):
    from runlog import free_port

    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), dtype, results), nprocs=2)
    assert len(results) == 2
    for rank, runs in results.items():
        up, unmarked, marked = runs["upstream"], runs["unmarked"], runs["marked"]
        # 4 chunks, 2 microbatches.
        assert (up["ag"], up["rs"]) == (8, 8), (rank, up)
        assert (unmarked["ag"], unmarked["rs"]) == (8, 8), (rank, unmarked)
        assert marked["marked"] == 1 and (marked["ag"], marked["rs"]) == (2, 2), (rank, marked)
        # 15 rows over 2 ranks: 8 and 7.
        assert marked["grad_rows"] == (8 if rank == 0 else 7)
        for kind in ("unmarked", "marked"):
            r = runs[kind]
            assert max(r["loss_diff"], r["hidden_diff"], r["grad_diff"]) <= 1e-6, (rank, kind, r)
