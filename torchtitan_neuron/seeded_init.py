"""Weight initialization that does not depend on the parallel layout.

torchtitan initializes a model after parallelizing it, by running each
parameter's initializer on its DTensor. On CPU (and any device without
DTensor's offset-based RNG) every shard then draws the same numbers, so the
starting model differs between 1 rank, FSDP and TP x FSDP even with the same
``--debug.seed``.

With a seed set, this module runs each parameter's own initializer on a full,
unsharded tensor on the host, drawn from a generator seeded by the run's seed
and the parameter's name, and copies this rank's shard out of it. The result
is the same model on every layout, and the same one a single process builds.
The cost is one full-size host tensor at a time (the largest parameter) and
generating every parameter in full on every rank; without a seed, torchtitan's
own initialization runs unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.models.common.param_init import skip_param_init
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.module import Module

# Wrapper segments that parallelization inserts into module names; a
# parameter's identity is its name in the unwrapped model.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_name(fqn: str) -> str:
    return ".".join(p for p in fqn.split(".") if p not in _WRAPPER_SEGMENTS)


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter, from the run's seed and its name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of the unsharded ``full`` into ``param``."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            # Every rank holds the same ``full``: slice locally, no collective.
            local = distribute_tensor(
                full, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


class _State:
    seed: int | None = None
    names: dict[int, str] = {}


_STATE = _State()
_original_init_param = Module._init_param
_original_init_weights = BaseModel.init_weights


def _init_param(self: Module, name: str, param: torch.nn.Parameter) -> None:
    seed = _STATE.seed
    module_name = _STATE.names.get(id(self))
    init = (self._param_init or {}).get(name)
    if seed is None or module_name is None or init is None or init is skip_param_init:
        return _original_init_param(self, name, param)
    fqn = f"{module_name}.{name}" if module_name else name
    full = torch.empty(tuple(param.shape), dtype=param.dtype, device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(parameter_seed(seed, fqn))
        with torch.no_grad():
            init(full)
    copy_full_into(param, full)


def _init_weights(self: BaseModel, **kwargs) -> None:
    if _STATE.seed is None:
        return _original_init_weights(self, **kwargs)
    previous = _STATE.names
    _STATE.names = {id(m): canonical_name(n) for n, m in self.named_modules()}
    try:
        return _original_init_weights(self, **kwargs)
    finally:
        _STATE.names = previous


@contextlib.contextmanager
def layout_invariant_init(seed: int | None) -> Iterator[None]:
    """Within this context, models initialized through ``init_weights`` get
    layout-independent weights for ``seed`` (no effect when ``seed`` is None).
    """
    if seed is None:
        yield
        return
    Module._init_param = _init_param
    BaseModel.init_weights = _init_weights
    previous, _STATE.seed = _STATE.seed, seed
    try:
        yield
    finally:
        _STATE.seed = previous
        Module._init_param = _original_init_param
        BaseModel.init_weights = _original_init_weights
