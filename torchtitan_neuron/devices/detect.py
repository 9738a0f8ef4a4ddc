"""Which platform this process runs on: ``neuron``, ``cuda`` or ``cpu``.

Everything else asks this package: which device the run uses, the
process-group backend, the compile backend a recipe's ``backend="neuron"``
resolves to, and how many devices and how much memory the host has.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

# them elsewhere. On CPU, inductor (C++ codegen) beat aot_eager in steady
# state (docs/architecture.md, "Compile cache").
_LOCAL_COMPILE_BACKEND = {"neuron": "neuron", "cuda": "inductor", "cpu": "inductor"}
NEURON_COMPILE_BACKEND = "neuron"
_PLATFORM_ONLY_BACKENDS = {NEURON_COMPILE_BACKEND: "neuron"}


@dataclass(frozen=True)
class Platform:
    name: str
    """``neuron``, ``cuda`` or ``cpu``."""
    device_type: str
    dist_backend: str
    compile_backend: str
    """What a recipe's ``backend="neuron"`` means on this platform."""

    @property
    def is_neuron(self) -> bool:
        """Whether this is Trainium through TorchNeuron (or its rehearsal)."""
        return self.name == "neuron"

    @property
    def has_premul_sum(self) -> bool:
        """Whether the process group offers ReduceOp.PREMUL_SUM (gloo does not)."""
        return self.dist_backend != "gloo"

    def resolve_compile_backend(self, requested: str) -> str:
        """Map a requested compile backend onto one that exists here.

        A backend tied to another platform (``neuron`` off Trainium) becomes the
        local compiler; any other name is passed through unchanged.
        """
        owner = _PLATFORM_ONLY_BACKENDS.get(requested)
        if owner is not None and owner != self.name:
            return self.compile_backend
        return requested


def _module_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# TorchNeuron registers the PrivateUse1 device ``neuron``, the process-group
# backend ``neuron`` and the torch.compile backend ``neuron``
# (awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/index.html,
# torch/guides/torch-distributed.html, torch/compile/reference-torch-compile.html).
NEURON = Platform("neuron", "neuron", "neuron", NEURON_COMPILE_BACKEND)


def detect(
    *,
    module_available=_module_available,
    cuda_available=torch.cuda.is_available,
) -> Platform:
    """Pick the platform: neuron if torch-neuronx is present, then cuda, then cpu.

    A rehearsal of the Neuron branch (``torchtitan_neuron.rehearse``) does not
    detect: it passes ``NEURON`` to ``install()`` itself."""
    if module_available("torch_neuronx"):
        return NEURON
    if cuda_available():
        return Platform("cuda", "cuda", "nccl", _LOCAL_COMPILE_BACKEND["cuda"])
    return Platform("cpu", "cpu", "gloo", _LOCAL_COMPILE_BACKEND["cpu"])



def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cuda_memory_bytes() -> int | None:
    """Total memory of CUDA device 0, or None without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def device_count(platform_name: str) -> int | None:
    """Devices a rank can use here: NeuronCores, GPUs; None when unknown
    (and on CPU, where ranks are processes)."""
    if platform_name == "cuda":
        return torch.cuda.device_count()
    if platform_name == "neuron":
        # TorchNeuron is autoloaded with torch and registers ``neuron`` as the
        # PrivateUse1 device with ``torch.neuron`` as its device module
        # (awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/index.html):
        # no ``import torch_neuronx`` is needed to count NeuronCores.
        for count in (lambda: torch.neuron.device_count(),
                      lambda: torch.accelerator.device_count()):
            try:
                return int(count())
            except Exception:
                continue
    return None



def ranks_on_host() -> int:
    """Ranks torchrun started on this host (1 outside a launch)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

