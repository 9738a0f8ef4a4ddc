"""The grouped-GEMM kernels MoE experts can run on, and which one to use.

- ``grouped_mm``: ``torch._grouped_mm``, one grouped GEMM per projection
  (torchtitan's own path);
- ``loop``: one GEMM per expert over its slice of the expert-sorted tokens;
- ``auto``: on neuron, ``grouped_mm`` (what torch-neuronx compiles); elsewhere
  both are timed once per expert shape on this process's threads and the
  faster is used (logged). The choice is kept in the compile cache
  (``expert_kernels.json`` beside the compiled graphs), so a later run with
  that cache traces the same graph and reuses them, where a new measurement
  on a busy host could pick the other kernel and compile the step again.

A leaf module: both MoE families' experts (``components.experts``,
``models.gpt_oss.experts``) build on it.
"""


from __future__ import annotations

import json
import os
import time
from typing import Literal

import torch

from torchtitan.tools.logging import logger

from torchtitan_neuron import devices

ExpertImplementation = Literal["auto", "grouped_mm", "loop"]


def grouped_mm(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(A, B_t, offs=offs)


def per_expert_loop(
    A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """``A[rows of e] @ B_t[e]`` for each expert e, rows given by end offsets."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    for size in sizes:
        torch._check(size >= 0)
    torch._check(sum(sizes) == A.shape[0])
    return torch.cat([a @ b for a, b in zip(A.split(sizes), B_t.unbind(0))])


KERNELS = {"grouped_mm": grouped_mm, "loop": per_expert_loop}
_measured: dict[tuple[int, int, int], str] = {}


def _time(fn, *args, repeats: int = 3) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


# Beside the compiled graphs in the (per-rank) compile cache directory.
CHOICES_FILE = "expert_kernels.json"


def _choices_path() -> str:
    """``CHOICES_FILE`` in torch's compile cache directory (which
    ``cache_dir()`` creates)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), CHOICES_FILE)


def _stored_choices(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _keep(path: str, key: str, choice: str) -> None:
    """Add ``key: choice`` to the choices in ``path``, re-read so another
    process's entries stay (replaced whole, so a process reading it meanwhile
    sees the old file or the new one)."""
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({**_stored_choices(path), key: choice}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning(f"Could not keep the expert kernel choice in {path} ({exc}); "
                       "the next run measures again.")


def measure_fastest(dim: int, hidden_dim: int, num_experts: int, tokens: int = 2048) -> str:
    """Time both kernels on uneven random routing (one expert idle), bf16,
    once per compile cache: the kernel an earlier run with this compile cache
    used for this shape is used again."""
    key = (dim, hidden_dim, num_experts)
    if key not in _measured:
        name, path = f"{num_experts}x{dim}x{hidden_dim}", _choices_path()
        stored = _stored_choices(path).get(name)
        if stored in KERNELS:
            logger.info(f"Expert kernel for {num_experts} experts {dim}x{hidden_dim}: "
                        f"{stored} (measured by an earlier run, kept in {path})")
            choice = [stored]
        else:
            # Models are built under a meta-device context; time on real memory.
            with torch.device("cpu"):
                choice = [_measure(dim, hidden_dim, num_experts, tokens)]
        # Every rank runs rank 0's choice, so all ranks trace the same graph.
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(choice, src=0)
        if choice[0] != stored:
            _keep(path, name, choice[0])
        _measured[key] = choice[0]
    return _measured[key]


def _measure(dim: int, hidden_dim: int, num_experts: int, tokens: int) -> str:
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(tokens, dim, dtype=torch.bfloat16, device="cpu", generator=gen)
    B_t = torch.randn(
        num_experts, dim, hidden_dim, dtype=torch.bfloat16, device="cpu", generator=gen
    )
    counts = torch.randint(0, 2 * tokens // num_experts, (num_experts,), generator=gen)
    counts[0] = 0
    offs = torch.cumsum(counts, 0).clamp_max(tokens).to(torch.int32)
    offs[-1] = tokens
    times = {name: _time(fn, A, B_t, offs) for name, fn in KERNELS.items()}
    fastest = min(times, key=times.get)
    logger.info(
        f"Expert kernel for {num_experts} experts {dim}x{hidden_dim}: {fastest} ("
        + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items())
        + ")"
    )
    return fastest


# Pins what ``auto`` resolves to (grouped_mm or loop), e.g. so a memory plan
# and the run it is checked against use the same kernel.
EXPERT_KERNEL_ENV = "TORCHTITAN_NEURON_EXPERT_KERNEL"


def resolve_implementation(
    requested: ExpertImplementation, dim: int, hidden_dim: int, num_experts: int
) -> str:
    if requested != "auto":
        return requested
    pinned = os.environ.get(EXPERT_KERNEL_ENV)
    if pinned:
        if pinned not in KERNELS:
            raise ValueError(
                f"{EXPERT_KERNEL_ENV}={pinned} is not an expert kernel; use one of "
                f"{sorted(KERNELS)} or unset it to measure the fastest."
            )
        return pinned
    if devices.current().is_neuron:
        return "grouped_mm"
    return measure_fastest(dim, hidden_dim, num_experts)
