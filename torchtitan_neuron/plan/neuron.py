"""The Neuron runtime's device memory in a plan, as AWS documents it
(neuron-runtime/explore/device-memory, the aws-neuron-sdk page of
2026-08-21; the figures are in ``torchtitan_neuron.devices.neuron``).

Each compiled graph is a NEFF whose inputs and outputs are device tensors,
all allocated while it runs; its intermediates live in scratchpad. A NEFF's
scratchpad need is the max of offset + size over its variables (op-by-op
lifetimes are assumed for the offsets). The runtime keeps one shared
scratchpad per core as large as the largest NEFF's need, grown in pages:

- contiguous (Runtime 2.33+ with Driver 2.24+, Trn2/Trn3 at LNC=2, the
  default there): 64 MB pages forming one region a variable may span, so
  nothing else is allocated; ``NEURON_SCRATCHPAD_PAGE_SIZE`` has no effect;
- paged (``NEURON_RT_CONTIGUOUS_SCRATCHPAD=0``, and the default at LNC=1):
  pages of ``NEURON_SCRATCHPAD_PAGE_SIZE`` MB (512 by default) that need not
  be adjacent, so a variable larger than a page also gets a private
  allocation, and the shared pages are still sized by the whole need.

A Neuron peak is the state, plus the device tensors at their peak, plus the
scratchpad, plus 96 MB of micro-code per physical core. Not modelled: the
NEFFs' own code, constants, DMA rings, collectives buffers, and how the
compiler lays out scratchpad variables.
"""

from __future__ import annotations

from torchtitan_neuron.devices.neuron import (
    CONTIGUOUS_PAGE_BYTES,
    NEURON_MICROCODE_BYTES_PER_PHYSICAL_CORE,
    logical_core_size,
    paged_page_bytes,
)
from torchtitan_neuron.plan.report import GIB

NEURON_TARGETS = ("trn2", "trn3")
SCRATCHPAD_MODES = ("contiguous", "paged")


def runtime_terms(tracker, mode: str) -> dict[str, int]:
    """Bytes the runtime holds for the whole step under ``mode``: the shared
    scratchpad (the largest program's need, in whole pages), each program's
    private allocations (paged only), and the micro-code."""
    need = max(tracker.scratchpad_need.values(), default=0)
    page = CONTIGUOUS_PAGE_BYTES if mode == "contiguous" else paged_page_bytes()
    private = 0 if mode == "contiguous" else sum(tracker.scratchpad_large.values())
    return {"shared_scratchpad": -(-need // page) * page,
            "private_scratchpad": private,
            "runtime_code": logical_core_size() * NEURON_MICROCODE_BYTES_PER_PHYSICAL_CORE}


def step_terms(tracker, categories: tuple[str, ...], neuron: bool,
               mode: str | None = None) -> tuple[int, dict[str, float]]:
    """(peak bytes beyond the persistent state, breakdown in GiB) of the
    traced step: op by op on CPU and CUDA, as device tensors plus the
    runtime's terms under scratchpad ``mode`` on Neuron."""
    if not neuron:
        breakdown = {c: tracker.peak_by_category.get(c, 0) / GIB for c in categories}
        return tracker.peak, breakdown
    breakdown = {c: tracker.tensor_peak_by_category.get(c, 0) / GIB for c in categories}
    runtime = runtime_terms(tracker, mode)
    breakdown.update({k: v / GIB for k, v in runtime.items()})
    return tracker.tensor_peak + sum(runtime.values()), breakdown
