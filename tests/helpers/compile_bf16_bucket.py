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
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": Block(), "1": Block()})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def _worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch._dynamo.utils import counters
        from torchtitan.distributed.parallel_dims import ParallelDims
        from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

        from torchtitan_neuron import platform
        from torchtitan_neuron.bucketing import bucket_blocks

        platform.install()  # a CPU device mesh
        # Each rank its own cache, as the launcher gives it.
        platform.per_rank_compile_cache()
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
