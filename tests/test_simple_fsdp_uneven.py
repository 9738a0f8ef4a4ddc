"""SimpleFSDP with TP parameters that FSDP cannot shard evenly.

Proves: on TP2 x FSDP2 (4 gloo ranks), a module owning a TP-sharded
parameter whose TP-local dim 0 (3 rows) is not a multiple of the FSDP degree
(2) is kept replicated over FSDP by ``replicate_unevenly_sharded``, and only
that module's own parameter: its child's weight is still FSDP-sharded. In
the forward the parameter reads as exactly this TP rank's 3 rows (upstream's
gather alone would re-wrap the uneven FSDP shards of 2 and 1 rows as if
every rank held the larger one); the gradient is the sum over the two FSDP
ranks of the same TP rank, as FSDP's reduce-scatter would give. This is the
case of GPT-OSS-120B's 64 attention sinks at TP4 x FSDP32 (docs/gpt_oss.md).
Over ``REPLICATE_LIMIT`` elements the same module is refused with a message
naming it, its TP-local shape and the FSDP degrees that would divide it.

Tier: e2e, in ``make test-slow`` (4 processes, 26-35 s on the 2-core machine).
Run: .venv/bin/python -m pytest tests/test_simple_fsdp_uneven.py -q
"""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.e2e

ROWS = 6  # 3 per TP rank, not a multiple of FSDP 2


class Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.arange(ROWS, dtype=torch.float32))
        self.child = nn.Linear(4, 4, bias=False)


def _worker(rank: int, world: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor
        from torchtitan.distributed.parallel_dims import ParallelDims
        from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

        from torchtitan_neuron import devices
        from torchtitan_neuron.experiments.graph_trainer.parallelize import (
            replicate_unevenly_sharded,
        )

        devices.install()  # a CPU device mesh
        dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1,
                            world_size=world, spmd_backend="partial_dtensor")
        dims.build_mesh()
        tp_mesh = dims.get_mesh("tp")
        model = Owner()
        # TP shards the sinks over heads, as GPT-OSS's sharding config does.
        model.sinks = nn.Parameter(distribute_tensor(model.sinks.data, tp_mesh, [Shard(0)]))
        training = SimpleNamespace(mixed_precision_param="float32",
                                   mixed_precision_reduce="float32")
        # Over the replication limit, the same module is refused by name.
        from torchtitan_neuron.experiments.graph_trainer import parallelize as par

        limit, par.REPLICATE_LIMIT = par.REPLICATE_LIMIT, 2
        try:
            replicate_unevenly_sharded(model, parallel_dims=dims, training=training)
            refusal = None
        except ValueError as exc:
            refusal = str(exc)
        finally:
            par.REPLICATE_LIMIT = limit
        kept = replicate_unevenly_sharded(model, parallel_dims=dims, training=training)
        model = apply_simple_fsdp(model, parallel_dims=dims, training=training)
        tp_rank = tp_mesh.get_local_rank()
        fsdp_rank = dims.get_mesh("fsdp").get_local_rank()
        stored = model._parameters["sinks"]
        child = model.child._parameters["weight"]
        sinks = model.sinks  # the SimpleFSDP property: the compute tensor
        (sinks * (fsdp_rank + 1)).sum().backward()
        results[rank] = dict(
            refusal=refusal, kept=kept, tp_rank=tp_rank,
            stored=[str(p) for p in stored.placements],
            child=[str(p) for p in child.placements],
            child_local_rows=child.to_local().shape[0],
            sinks=(sinks.to_local() if isinstance(sinks, DTensor) else sinks).tolist(),
            grad=stored.grad.to_local().tolist(),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_uneven_tp_parameter_is_replicated_over_fsdp_and_reads_its_tp_rows():
    from runlog import free_port

    world = 4
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, free_port(), results), nprocs=world)
    assert len(results) == world
    half = ROWS // 2
    for r in results.values():
        assert r["refusal"] == (
            "SimpleFSDP cannot shard sinks (TP-local shape (3,)) over 2 FSDP ranks: "
            "2 does not divide its 3 rows, and at 3 elements per TP rank it is too "
            "large to keep replicated. Choose an FSDP degree (world size / "
            "--parallelism.tensor_parallel_degree) that divides 3, or split it with "
            "--parallelism.expert_parallel_degree.")
        assert r["kept"] == ["sinks"]
        # Replicated over FSDP, still sharded over TP; the child sharded.
        assert r["stored"] == ["R", "S(0)"]
        assert r["child"][0] == "S(0)" and r["child_local_rows"] == 2
        t = r["tp_rank"]
        assert r["sinks"] == [float(i) for i in range(t * half, (t + 1) * half)]
        # Loss weights 1 and 2 on the two FSDP ranks: the gradient is 3.
        assert r["grad"] == [3.0] * half
