"""Compiled gradient-norm clipping equals torchtitan's eager clipping.

Proves: on 2 gloo ranks with SimpleFSDP-sharded (DTensor) gradients, the
``grad_clip`` compile component returns the same total norm and leaves the
same clipped gradients as ``torchtitan.distributed.utils.clip_grad_norm_``.
(test_training.py checks that a training run's clip graph holds the
cross-rank all-reduce of the norm.)

Tier: e2e (two spawned ranks), in ``make test-slow``.
Run: .venv/bin/python -m pytest tests/test_grad_clip.py -q
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runlog import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _worker(rank: int, world: int, port: int, backend: str, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        import torchtitan.distributed.utils as dist_utils
        from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

        from torchtitan_neuron.trainer import compile_grad_clip

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)
        )
        model = data_parallel(model, mesh, "fully_shard")
        torch.manual_seed(rank + 1)
        (model(torch.randn(4, 16)) ** 2).sum().backward()
        params = list(model.parameters())
        originals = [p.grad.detach().clone() for p in params]

        eager_norm = dist_utils.clip_grad_norm_(params, 0.1, foreach=True)
        eager_grads = [p.grad.full_tensor() for p in params]

        for p, g in zip(params, originals):
            p.grad = g.clone()
        compiled_norm = compile_grad_clip(backend)(params, 0.1, foreach=True)
        compiled_grads = [p.grad.full_tensor() for p in params]

        torch.testing.assert_close(compiled_norm, eager_norm, rtol=1e-6, atol=0)
        for a, b in zip(compiled_grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
        assert float(eager_norm) > 0.1, "the test must actually clip"
        results[rank] = float(compiled_norm)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_clip_matches_eager(backend):
    world = 2
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(world, free_port(), backend, results), nprocs=world)
    assert len(results) == world and results[0] == results[1]
