"""Per-rank memory accounting for sharded training state.

SimpleFSDP keeps each parameter as a DTensor sharded over the data-parallel
mesh; its gradient and optimizer state follow the same sharding. What a rank
really holds is the local shards, which this module sums. These are measured
sizes of live tensors, not estimates.
"""

from __future__ import annotations

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


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    return t._local_tensor if isinstance(t, DTensor) else t



def state_bytes(trainer) -> dict[str, int]:
    """Bytes of the parameters, gradients, optimizer state and buffers, each
    storage counted once: gradients can be views of one flat buffer (a
    bucket's reduce-scatter output, FSDP2's), which holds them all."""
    seen: set = set()

    def nbytes(t: torch.Tensor) -> int:
        storage = local_shard(t).untyped_storage()
        if storage._cdata in seen:
            return 0
        seen.add(storage._cdata)
        return storage.nbytes()

    params = grads = buffers = 0
    for part in trainer.model_parts:
        for p in part.parameters():
            params += nbytes(p)
            if p.grad is not None:
                grads += nbytes(p.grad)
        for b in part.buffers():
            buffers += nbytes(b)
    opt = 0
    for optimizer in trainer.optimizers.optimizers:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    opt += nbytes(v)
    return {"sharded_parameters": params, "gradients": grads,
            "optimizer_state": opt, "buffers": buffers}


def step_start_state(trainer) -> dict[str, int]:
    """``state_bytes`` as a training step starts: after the ``zero_grad``
    that torchtitan's ``Trainer.train_step`` opens with (calling it here
    first changes nothing; the step's own call finds the same state).

    With ``--training.disable_cuda_graphs`` it sets the gradients to None, so
    the last step's gradients are not held through this one and the step's
    new ones are storages it makes (a tracker counts them as it runs);
    otherwise they are zeroed in place and held throughout."""
    trainer.optimizers.zero_grad(set_to_none=trainer.config.training.disable_cuda_graphs)
    return state_bytes(trainer)
