"""Compile a two-block SimpleFSDP model whose blocks gather in bf16 and
reduce-scatter in fp32 (``bucketing._GatherBucket``, as the default recipes
do) with inductor on 2 gloo ranks, run forward and backward, and print rank
0's AOTAutograd cache counters as JSON. Run twice with one
TORCHINDUCTOR_CACHE_DIR: the second run should hit.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

from compile_sac_block import Model  # noqa: E402  (the same two-block model)


def _worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch._dynamo.utils import counters
        from torchtitan.distributed.parallel_dims import ParallelDims
        from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

        from torchtitan_neuron import devices
        from torchtitan_neuron.experiments.graph_trainer.bucketing import bucket_blocks

        devices.install()  # a CPU device mesh
        # Each rank its own cache, as the launcher gives it.
        devices.per_rank_compile_cache()
        dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1,
                            world_size=2, spmd_backend="partial_dtensor")
        dims.build_mesh()
        torch.manual_seed(0)
        training = SimpleNamespace(mixed_precision_param="bfloat16",
                                   mixed_precision_reduce="float32")
        model = apply_simple_fsdp(Model(), parallel_dims=dims, training=training)
        assert bucket_blocks(model, torch.bfloat16, torch.float32)[2] == 2
        compiled = torch.compile(model, backend="inductor")
        compiled(torch.randn(4, 32, dtype=torch.bfloat16)).float().sum().backward()
        results[rank] = dict(counters["aot_autograd"])
    finally:
        dist.destroy_process_group()


def main() -> None:
    from runlog import free_port

    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), results), nprocs=2)
    print(json.dumps(results[0]))


if __name__ == "__main__":
    main()
