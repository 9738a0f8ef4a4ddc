"""Per-rank memory accounting for sharded training state.

SimpleFSDP keeps each parameter as a DTensor sharded over the data-parallel
mesh; its gradient and optimizer state follow the same sharding. What a rank
really holds is the local shards, which this module sums. These are measured
sizes of live tensors, not estimates.
"""

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


@dataclass(frozen=True)
class ShardedStateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def describe(self) -> str:
        mib = 2**20
        return (
            f"parameters {self.params / mib:.2f} MiB, gradients {self.grads / mib:.2f} MiB, "
            f"optimizer state {self.optimizer / mib:.2f} MiB"
        )


def sharded_state_bytes(model_parts, optimizers) -> ShardedStateBytes:
    """Bytes of this rank's parameter, gradient and optimizer-state shards."""
    params = [p for m in model_parts for p in m.parameters()]
    state_bytes = 0
    for optimizer in getattr(optimizers, "optimizers", [optimizers]):
        for state in optimizer.state.values():
            state_bytes += sum(
                _local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor)
            )
    return ShardedStateBytes(
        params=sum(_local_bytes(p) for p in params),
        grads=sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        optimizer=state_bytes,
    )
