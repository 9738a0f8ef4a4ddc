"""The Neuron runtime's device memory, as AWS documents it
(neuron-runtime/explore/device-memory).

Each compiled graph is a NEFF whose inputs and outputs are device tensors,
all allocated while it runs; its intermediates live in scratchpad. The
runtime keeps one shared scratchpad per core as large as the largest NEFF's
need, in pages, plus a private allocation for every intermediate larger
than a page, and micro-code per physical core. So a Neuron peak is the state,
plus the device tensors at their peak, plus both scratchpads, plus the
micro-code. Not modelled: the NEFFs' own code, constants, DMA rings, and how
the compiler lays out scratchpad variables (op-by-op lifetimes are assumed).
"""

from __future__ import annotations

import os

from torchtitan_neuron.plan.report import GIB

NEURON_TARGETS = ("trn2", "trn3")
# 96 MB of micro-code per physical NeuronCore (LNC=2: two per rank), and
# scratchpad pages of 512 MB by default (NEURON_SCRATCHPAD_PAGE_SIZE, in MB).
NEURON_MICROCODE_BYTES_PER_PHYSICAL_CORE = 96 * 2**20
NEURON_DEFAULT_SCRATCHPAD_PAGE_MB = 512


def scratchpad_page_bytes() -> int:
    return int(os.environ.get("NEURON_SCRATCHPAD_PAGE_SIZE",
                              NEURON_DEFAULT_SCRATCHPAD_PAGE_MB)) * 2**20


def runtime_terms(tracker, page: int) -> dict[str, int]:
    """Bytes the runtime holds for the whole step: the shared scratchpad
    (the largest program's intermediates, in whole pages), each program's
    private allocations for intermediates over a page, and the micro-code."""
    shared = max(tracker.scratchpad_peak.values(), default=0)
    shared = -(-shared // page) * page
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
    return {"shared_scratchpad": shared,
            "private_scratchpad": sum(tracker.scratchpad_large.values()),
            "runtime_code": lnc * NEURON_MICROCODE_BYTES_PER_PHYSICAL_CORE}


def step_terms(tracker, categories: tuple[str, ...], neuron: bool,
               page: int) -> tuple[int, dict[str, float]]:
    """(peak bytes beyond the persistent state, breakdown in GiB) of the
    traced step: op by op on CPU and CUDA, as device tensors plus the
    runtime's terms on Neuron."""
    if not neuron:
        breakdown = {c: tracker.peak_by_category.get(c, 0) / GIB for c in categories}
        return tracker.peak, breakdown
    breakdown = {c: tracker.tensor_peak_by_category.get(c, 0) / GIB for c in categories}
    runtime = runtime_terms(tracker, page)
    breakdown.update({k: v / GIB for k, v in runtime.items()})
    return tracker.tensor_peak + sum(runtime.values()), breakdown
