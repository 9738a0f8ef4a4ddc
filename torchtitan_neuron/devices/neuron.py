"""Trainium through TorchNeuron as torchtitan's device."""

from __future__ import annotations

import torch

from torchtitan_neuron.devices.compile_cache import per_rank_dir
from torchtitan_neuron.devices.detect import NEURON
from torchtitan_neuron.devices.torchtitan_globals import set_device_globals

# Where TorchNeuron keeps compiled NEFFs unless TORCH_NEURONX_NEFF_CACHE_DIR
# says otherwise (awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/
# reference/env-vars.html).
NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
DEFAULT_NEFF_CACHE = "/tmp/neff_cache"


def per_rank_neff_cache() -> str | None:
    """Give this rank its own NEFF cache directory, as
    ``per_rank_compile_cache`` does for inductor: ``$TORCH_NEURONX_NEFF_CACHE_DIR``
    (or TorchNeuron's default) stays the root and each rank uses
    ``<root>/rank<R>-of-<N>``, so ranks whose graphs differ only in their
    process group's name never share a compiled program."""
    return per_rank_dir(NEFF_CACHE_ENV, lambda: DEFAULT_NEFF_CACHE)


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

