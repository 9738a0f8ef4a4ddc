"""Trainium through TorchNeuron as torchtitan's device, and every Trainium
fact the package uses, each written once: memory and cores, the runtime's
scratchpad and micro-code, where compiled programs are cached.
"""

from __future__ import annotations

import os

import torch

from torchtitan_neuron.devices.detect import NEURON
from torchtitan_neuron.devices.torchtitan_globals import set_device_globals

# Device memory per rank, the figure a plan's verdict is measured against.
# One rank is one logical NeuronCore at the default LNC=2 (two physical cores):
#   trn2: 96 GiB per chip / 4 logical cores = 24 GiB (the tutorial's figure);
#   trn3: 144 GiB per chip / 4 logical cores = 36 GiB.
CORE_MEMORY_GIB = {"trn2": 24.0, "trn3": 36.0}
# Logical NeuronCores (LNC=2) per host: a trn2.48xlarge has 16 Trainium2
# chips of 8 physical cores (the tutorial's 64 ranks). AWS's pages cited here
# give trn3's chip (8 physical cores) but no instance size: 16 chips assumed.
HOST_CORES = {"trn2": 64, "trn3": 64}

# The Neuron runtime's device memory, as AWS documents it
# (neuron-runtime/explore/device-memory, the aws-neuron-sdk page of
# 2026-08-21): 96 MB of micro-code per physical core; a shared scratchpad per
# core grown in 64 MB pages when contiguous (Runtime 2.33+ with Driver 2.24+,
# Trn2/Trn3 at LNC=2, the default there), else in pages of
# NEURON_SCRATCHPAD_PAGE_SIZE MB (512 by default).
NEURON_MICROCODE_BYTES_PER_PHYSICAL_CORE = 96 * 2**20
CONTIGUOUS_PAGE_BYTES = 64 * 2**20
NEURON_DEFAULT_SCRATCHPAD_PAGE_MB = 512


def logical_core_size() -> int:
    """Physical NeuronCores per rank: ``NEURON_LOGICAL_NC_CONFIG``, 2 by default."""
    return int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))


def scratchpad_mode() -> tuple[str, str]:
    """(mode, why): the scratchpad allocation the runtime would use, read
    from the environment variables the runtime reads."""
    if os.environ.get("NEURON_RT_CONTIGUOUS_SCRATCHPAD") == "0":
        return "paged", "NEURON_RT_CONTIGUOUS_SCRATCHPAD=0"
    if logical_core_size() == 1:
        return "paged", "LNC=1 has no contiguous scratchpad"
    return "contiguous", "the default at LNC=2 from Neuron Runtime 2.33 with Driver 2.24"


def paged_page_bytes() -> int:
    return int(os.environ.get("NEURON_SCRATCHPAD_PAGE_SIZE",
                              NEURON_DEFAULT_SCRATCHPAD_PAGE_MB)) * 2**20


# Where TorchNeuron keeps compiled NEFFs unless TORCH_NEURONX_NEFF_CACHE_DIR
# says otherwise (awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/
# reference/env-vars.html).
NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
DEFAULT_NEFF_CACHE = "/tmp/neff_cache"


def host_neff_cache() -> str | None:
    """The NEFF cache every rank of a host shares: ``$TORCH_NEURONX_NEFF_CACHE_DIR``
    or TorchNeuron's default, set for a launched rank so all agree. None
    outside a launch.

    Ranks that hand neuronx-cc the same graph then compile it once per host,
    not once per rank (the rehearsal counts the distinct programs of a host).
    AWS's page on the cache covers "shared cache directories"
    (awsdocs-neuron.readthedocs-hosted.com/en/v2.34.0/about-neuron/arch/
    neuron-features/neuron-caching.html, its description), and its key is a
    hash of the graph and the compiler's flags: what a NEFF bakes in comes
    from that graph, so two graphs that differ (a process group's name
    included) never share an entry. Inductor's cache, whose key left the
    group's name out, stays per rank (``per_rank_compile_cache``)."""
    if os.environ.get("RANK") is None or os.environ.get("WORLD_SIZE") is None:
        return None
    path = os.environ.get(NEFF_CACHE_ENV) or DEFAULT_NEFF_CACHE
    os.environ[NEFF_CACHE_ENV] = path
    return path


class NeuronDeviceModule:
    """``torch.neuron`` as torchtitan uses ``torch.cuda``, except that every
    memory statistic is read after ``torch.neuron.synchronize()``.

    AWS: "The Neuron allocator is asynchronous. Always call
    torch.neuron.synchronize() before you read any memory statistic"; the
    statistics are ``torch_neuronx``'s memory functions
    (awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/
    memory-profiling-guide.html). Everything else is ``torch.neuron``'s.
    """

    MEMORY_READS = ("memory_stats", "reset_peak_memory_stats")

    def __getattr__(self, name: str):
        return getattr(torch.neuron, name)

    @staticmethod
    def _memory_functions():
        try:
            import torch_neuronx

            return torch_neuronx
        except ImportError:  # a rehearsal's stand-in device module has them
            return torch.neuron

    def memory_stats(self, device=None) -> dict[str, int]:
        torch.neuron.synchronize()
        return self._memory_functions().memory_stats(device)

    def reset_peak_memory_stats(self, device=None) -> None:
        torch.neuron.synchronize()
        self._memory_functions().reset_peak_memory_stats(device)


def install_neuron() -> list[str]:
    return set_device_globals(NEURON.device_type, NeuronDeviceModule())

