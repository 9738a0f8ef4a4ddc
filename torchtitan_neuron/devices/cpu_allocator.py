"""The memory allocator of CPU ranks: jemalloc, keeping freed memory for reuse.

A training step on a CPU rank allocates and frees the same large buffers every
step (activations, gathered parameters, gradient buckets, gloo's copies of
them). glibc's malloc hands blocks above its mmap threshold (at most 32 MiB)
back to the kernel when they are freed, so the next step takes a page fault
on every 4 KiB of them again; on this project's 2-core machine (a Firecracker
VM) a fresh 21 MiB copy took 8-10 ms against 1.4 ms into memory already
mapped. jemalloc with its decay turned off (``dirty_decay_ms:-1``,
``muzzy_decay_ms:-1``) keeps freed pages mapped and reuses them. Measured
step times are in docs/benchmarks.md ("The CPU ranks' allocator").

The allocator must be chosen before a process starts (``LD_PRELOAD``), so
``torchtitan_neuron.launch`` calls ``rank_environment`` before torchrun starts
the ranks, for every recipe it launches (SimpleFSDP, eager FSDP2,
``aot_fx_trace``) alike. ``TORCHTITAN_NEURON_CPU_ALLOCATOR`` chooses:

- ``auto`` (default): jemalloc when the system has it, glibc's malloc otherwise;
- ``jemalloc``: jemalloc, and an error before any rank starts when it is missing;
- ``system``: the C library's malloc, nothing preloaded.

A user's own ``LD_PRELOAD`` or ``MALLOC_CONF`` is left as set. Neuron and CUDA
hosts are not touched: their step's memory is the device's.
"""

from __future__ import annotations

import os
import sys

ALLOCATOR_ENV = "TORCHTITAN_NEURON_CPU_ALLOCATOR"
CHOICES = ("auto", "jemalloc", "system")
# background_thread:false - no purging thread beside the rank's compute;
# dirty/muzzy decay -1 - freed pages stay mapped for the next step.
JEMALLOC_CONF = "background_thread:false,dirty_decay_ms:-1,muzzy_decay_ms:-1"
JEMALLOC_NAMES = ("libjemalloc.so.2", "libjemalloc.so")
SYSTEM_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
               "/usr/lib", "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64")
INSTALL_HINT = ("apt install libjemalloc2 (Debian, Ubuntu), dnf install jemalloc "
                "(Amazon Linux, Fedora) or conda install jemalloc")


def library_dirs(environ=os.environ) -> list[str]:
    """Where jemalloc is looked for: the active conda or virtual environment's
    ``lib``, then the system's library directories."""
    prefixes = [environ.get("CONDA_PREFIX"), sys.prefix]
    return [os.path.join(p, "lib") for p in prefixes if p] + list(SYSTEM_DIRS)


def find_jemalloc(dirs: list[str] | None = None) -> str | None:
    """The path of the jemalloc shared library, or None."""
    for directory in dirs if dirs is not None else library_dirs():
        for name in JEMALLOC_NAMES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
    return None


def _choice(environ) -> str:
    """``TORCHTITAN_NEURON_CPU_ALLOCATOR`` as given, lower case; ``auto`` if unset."""
    return environ.get(ALLOCATOR_ENV, "auto").strip().lower() or "auto"


def rank_environment(environ=os.environ, dirs: list[str] | None = None) -> dict[str, str]:
    """The variables to add to CPU ranks' environment (empty: none); jemalloc
    is looked for in ``dirs`` (default: ``library_dirs(environ)``).

    Raises ``ValueError`` with the fix when the choice is not one of
    ``CHOICES``, or is ``jemalloc`` and jemalloc cannot be found."""
    choice = _choice(environ)
    if choice not in CHOICES:
        raise ValueError(
            f"{ALLOCATOR_ENV}={environ[ALLOCATOR_ENV]!r} is not an allocator: use "
            f"{', '.join(CHOICES)} (auto: jemalloc when installed)")
    if choice == "system" or environ.get("LD_PRELOAD"):
        return {}
    dirs = library_dirs(environ) if dirs is None else dirs
    path = find_jemalloc(dirs)
    if path is None:
        if choice == "jemalloc":
            raise ValueError(
                f"{ALLOCATOR_ENV}=jemalloc, but no {' or '.join(JEMALLOC_NAMES)} is in "
                f"{', '.join(dirs)}. Install it "
                f"({INSTALL_HINT}), or set {ALLOCATOR_ENV}=auto to run on the C library's "
                "malloc.")
        return {}
    return {"LD_PRELOAD": path, "MALLOC_CONF": environ.get("MALLOC_CONF", JEMALLOC_CONF)}


def loaded() -> str:
    """The allocator this process runs on, read from its own memory map:
    ``jemalloc`` or ``glibc malloc``."""
    try:
        with open("/proc/self/maps") as maps:
            if any("libjemalloc" in line for line in maps):
                return "jemalloc"
    except OSError:
        pass
    return "glibc malloc"


def describe() -> str:
    """One line for a CPU rank's log: the allocator, and how to change it."""
    name = loaded()
    if name == "jemalloc":
        return (f"allocator jemalloc (MALLOC_CONF={os.environ.get('MALLOC_CONF', '')}; "
                f"{ALLOCATOR_ENV}=system for the C library's)")
    if _choice(os.environ) == "system":
        return f"allocator {name} ({ALLOCATOR_ENV}=system)"
    return (f"allocator {name}; CPU ranks step faster on jemalloc, which "
            f"torchtitan_neuron.launch preloads when installed ({INSTALL_HINT})")


def release_free_memory() -> bool:
    """Hand the allocator's free blocks back to the system, so the resident
    set holds only what is in use: ``malloc_trim(0)`` on glibc, a purge of
    every arena on jemalloc (``mallctl("arena.4096.purge")``, 4096 being
    ``MALLCTL_ARENAS_ALL``). False where neither is found."""
    import ctypes

    libc = ctypes.CDLL(None)
    if loaded() == "jemalloc":
        mallctl = getattr(libc, "mallctl", None)
        return mallctl is not None and mallctl(b"arena.4096.purge", None, None, None, 0) == 0
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
