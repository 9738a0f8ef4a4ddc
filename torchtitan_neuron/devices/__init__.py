"""The platform layer: which device this is, and torch and torchtitan adapted to it.

- ``detect``: ``neuron`` (TorchNeuron present), ``cuda`` or ``cpu``, with its
  process-group and compile backends;
- ``cpu`` and ``neuron``: each platform's device module for torchtitan;
- ``torchtitan_globals``: torchtitan's import-time copies of its device globals;
- ``compile_cache``: each rank's own compile cache;
- ``cpu_allocator``: jemalloc for CPU ranks where the host has it;
- ``gloo``: gloo process groups with one worker thread;
- ``known_warnings``: upstream warnings that say nothing on this platform.

``install()`` adapts torch and torchtitan to the platform, explicitly and
idempotently; the entry point (``torchtitan_neuron.train``) calls it once
before torchtitan's trainer runs. Nothing here patches anything at import time.
"""

from __future__ import annotations

from torchtitan.tools.logging import logger

from torchtitan_neuron.devices import cpu_allocator, gloo, known_warnings
from torchtitan_neuron.devices.compile_cache import per_rank_compile_cache
from torchtitan_neuron.devices.cpu import install_cpu
from torchtitan_neuron.devices.detect import (
    NEURON,
    NEURON_COMPILE_BACKEND,
    Platform,
    cuda_memory_bytes,
    detect,
    device_count,
    host_memory_bytes,
)
from torchtitan_neuron.devices.neuron import (
    DEFAULT_NEFF_CACHE,
    NEFF_CACHE_ENV,
    install_neuron,
    host_neff_cache,
)

__all__ = [
    "DEFAULT_NEFF_CACHE", "NEFF_CACHE_ENV", "NEURON", "NEURON_COMPILE_BACKEND",
    "Platform", "cuda_memory_bytes", "current", "detect", "device_count",
    "host_memory_bytes", "install", "per_rank_compile_cache", "host_neff_cache",
]

_installed: Platform | None = None


def install(platform: Platform | None = None) -> Platform:
    """Adapt torchtitan's device globals to the platform, once.

    ``platform`` is the detected one unless given (the rehearsal gives
    ``NEURON``). On CPU it sets ``device_type="cpu"`` and a CPU device module
    in every module listed in ``DEVICE_GLOBAL_COPIES``, makes
    ``get_local_device`` return the host device, and points MFU at the CPU
    matmul peak. On neuron it sets ``device_type="neuron"`` and
    ``NeuronDeviceModule`` there (memory read after a synchronize), and the
    launched ranks of a host share one NEFF cache. On cuda torchtitan's own detection
    is right and nothing is touched. On every platform a launched rank gets
    its own inductor cache (``per_rank_compile_cache``), and gloo process
    groups run one worker thread (``gloo.install``: torch 2.14.1's two race
    and corrupt the heap). Calling it again is a no-op.
    """
    global _installed
    if _installed is not None:
        return _installed
    platform = platform or detect()
    hidden = known_warnings.install(platform.name)
    touched = {"cpu": install_cpu, "neuron": install_neuron}.get(
        platform.name, lambda: [])()
    single_worker_gloo = gloo.install()
    caches = [per_rank_compile_cache()]
    if platform.name == "neuron":
        caches.append(host_neff_cache())
    _installed = platform
    caches = [c for c in caches if c]
    logger.info(
        f"torchtitan_neuron platform: {platform.name} (device {platform.device_type}, "
        f"process group {platform.dist_backend}, compile backend "
        f"{platform.compile_backend})"
        + (f"; adapted {len(touched)} torchtitan globals for {platform.name}"
           if touched else "")
        + (f"; compile cache {', '.join(caches)}" if caches else "")
        + (f"; {cpu_allocator.describe()}" if platform.name == "cpu" else "")
        + ("; gloo process groups with one worker thread" if single_worker_gloo else "")
    )
    hidden_line = known_warnings.describe(hidden, platform.name)
    if hidden_line:
        logger.info(hidden_line)
    return _installed


def current() -> Platform:
    """The installed platform, or the detected one if install() has not run."""
    return _installed or detect()

