"""Per-rank memory accounting for sharded training state.

SimpleFSDP keeps each parameter as a DTensor sharded over the data-parallel
mesh; its gradient and optimizer state follow the same sharding. What a rank
really holds is the local shards, which this module sums. These are measured
sizes of live tensors, not estimates.
"""

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


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


# ---------------------------------------------------------------------------
# Tensor lifetimes over a training step: one tracker for the planner (on
# FakeTensors) and for measuring a real run (on real tensors).

def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class StorageTracker(TorchDispatchMode):
    """Follows every storage created while it is active, by category."""

    def __init__(self):
        super().__init__()
        self.phase = "other"
        self.live: dict[int, tuple[int, str]] = {}
        self.by_category: dict[str, int] = defaultdict(int)
        self.current = 0
        self.peak = 0
        self.peak_by_category: dict[str, int] = {}

    def _category(self, func) -> str:
        name = str(func)
        if "all_gather" in name:
            return "gathered_parameters"
        if self.phase == "forward":
            return "saved_activations"
        if self.phase == "loss":
            return "logits_and_loss"
        return "temporaries"

    def _free(self, key: int) -> None:
        size, category = self.live.pop(key, (0, None))
        if category is not None:
            self.current -= size
            self.by_category[category] -= size

    def _track(self, t: torch.Tensor, category: str) -> None:
        t = _local(t)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = (size, category)
        weakref.finalize(storage, self._free, key)
        self.current += size
        self.by_category[category] += size
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_category = dict(self.by_category)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = self._category(func)
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, category)
        return out

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous


def state_bytes(trainer) -> dict[str, int]:
    params = grads = buffers = 0
    for part in trainer.model_parts:
        for p in part.parameters():
            params += _local(p).untyped_storage().nbytes()
            if p.grad is not None:
                grads += _local(p.grad).untyped_storage().nbytes()
        for b in part.buffers():
            buffers += _local(b).untyped_storage().nbytes()
    opt = 0
    for optimizer in trainer.optimizers.optimizers:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    opt += _local(v).untyped_storage().nbytes()
    return {"sharded_parameters": params, "gradients": grads,
            "optimizer_state": opt, "buffers": buffers}


def instrument(trainer, tracker: "StorageTracker") -> None:
    """Tell ``tracker`` which phase of the step is running: the model's
    forward, the loss (which applies lm_head), or the rest (backward,
    clipping, optimizer)."""
    model = trainer.model_parts[0]
    model.register_forward_pre_hook(lambda *a: setattr(tracker, "phase", "forward"))
    model.register_forward_hook(lambda *a: setattr(tracker, "phase", "backward"))
    loss_fn = trainer.loss_fn

    def tracked_loss(*args, **kwargs):
        with tracker.in_phase("loss"):
            return loss_fn(*args, **kwargs)

    trainer.loss_fn = tracked_loss
