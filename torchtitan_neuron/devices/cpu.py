"""The CPU as torchtitan's device: a stand-in for ``torch.cuda``, the matmul
peak MFU is measured against, the host's DRAM bandwidth for inductor's
overlap scheduler, and each rank's share of compile workers.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import torch
from torchtitan.tools.logging import logger

from torchtitan_neuron.devices.detect import host_memory_bytes, ranks_on_host
from torchtitan_neuron.devices.torchtitan_globals import set_device_globals

CPU_PEAK_FLOPS_ENV = "TORCHTITAN_NEURON_CPU_PEAK_FLOPS"
# A bf16 matmul this many times slower than fp32 has no native kernel under
# it: torch falls back to a plain loop where the CPU lacks AVX512-BF16 and
# AMX. With oneDNN held to AVX2 on a Xeon, a 2048x256 by 256x768 mm took
# 363 ms in bf16 against 6.5 ms in fp32 (docs/troubleshooting.md); with the
# native kernels bf16 is the faster one.
SLOW_BF16_FACTOR = 4.0


def read_status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS, VmHWM, ...); -1 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1



def reset_peak_rss() -> bool:
    """Reset the peak resident set (VmHWM) to the current one: "5" to
    ``/proc/self/clear_refs`` (Linux >= 4.0). False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"



class CpuDeviceModule:
    """``torch.cpu`` as torchtitan uses ``torch.cuda``: what torch.cpu has is
    torch.cpu's own (``TORCH_CPU_DELEGATES``); the rest is added here.

    torch 2.14's torch.cpu has no memory statistics, device name or
    properties, seeding or cache calls, and its ``current_device()`` returns
    the string ``"cpu"`` where torchtitan needs an index
    (``barrier(device_ids=[current_device()])``,
    ``torch.device(device_type, current_device())``).

    Memory is the rank's peak resident set size (Linux ``VmHWM``), reset through
    ``/proc/self/clear_refs``: a real measurement of everything the process
    holds (tensors, interpreter, compiled code), not only tensors. Capacity is
    host memory divided among the ranks on this host.
    """

    is_available = staticmethod(torch.cpu.is_available)
    device_count = staticmethod(torch.cpu.device_count)
    set_device = staticmethod(torch.cpu.set_device)
    synchronize = staticmethod(torch.cpu.synchronize)
    current_stream = staticmethod(torch.cpu.current_stream)
    stream = staticmethod(torch.cpu.stream)
    Stream = torch.cpu.Stream
    StreamContext = torch.cpu.StreamContext
    Event = torch.cpu.Event

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return _cpu_name()

    @staticmethod
    def get_device_properties(device=None):
        return SimpleNamespace(
            name=_cpu_name(), total_memory=host_memory_bytes() // ranks_on_host()
        )

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = read_status_kib("VmHWM") * 1024
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        reset_peak_rss()

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        total = host_memory_bytes()
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), total

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def empty_cache() -> None:
        pass  # the host allocator keeps no cache to release

    # torchtitan's profiler records memory snapshots through this attribute.
    memory = SimpleNamespace(
        _record_memory_history=lambda *a, **k: None, _snapshot=lambda: {}
    )


# What CpuDeviceModule takes from torch.cpu unchanged, and what it adds
# because torch.cpu (torch 2.14.1) lacks it or answers differently. A test
# checks both lists against torch.cpu, so a torch that grows one of the added
# calls is noticed (docs/upstream-workarounds.md, "CPU device module").
TORCH_CPU_DELEGATES = ("is_available", "device_count", "set_device", "synchronize",
                       "current_stream", "stream", "Stream", "StreamContext", "Event")
ADDED_TO_TORCH_CPU = ("get_device_name", "get_device_properties", "memory_stats",
                      "reset_peak_memory_stats", "mem_get_info", "manual_seed",
                      "manual_seed_all", "empty_cache", "memory")


def _cpu_local_device() -> torch.device:
    # Every CPU rank shares the one host device; an index ("cpu:1") would make
    # device equality checks fail against tensors created on "cpu".
    return torch.device("cpu")


def measure_matmul_flops(
    dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5
) -> float:
    """Median FLOP/s of an n^3 matmul on this process's threads."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


_cpu_peak_cache: dict[str, float] = {}


def cpu_peak_flops() -> float:
    """Peak FLOP/s for MFU on a CPU rank: configured, else measured once.

    ``TORCHTITAN_NEURON_CPU_PEAK_FLOPS`` sets it; otherwise 1024^3 matmuls
    in fp32 and bf16 are timed on this rank's threads and the faster one is
    the peak (recipes compute in bf16 under mixed precision, and many CPUs
    run bf16 matmuls faster than fp32). Where a small bf16 matmul takes
    ``SLOW_BF16_FACTOR`` times as long as fp32, the CPU has no native bf16
    kernel: the rank says so, and the peak is fp32's, without timing the
    large bf16 one.
    """
    configured = os.environ.get(CPU_PEAK_FLOPS_ENV)
    if configured:
        try:
            return float(configured)
        except ValueError:
            raise ValueError(
                f"{CPU_PEAK_FLOPS_ENV}={configured!r} is not a number; "
                "set it to FLOP/s, e.g. 1.8e11"
            ) from None
    if "cpu" not in _cpu_peak_cache:
        fp32 = measure_matmul_flops(torch.float32)
        slowdown = bf16_matmul_slowdown()
        if slowdown >= SLOW_BF16_FACTOR:
            # Seconds per 1024^3 matmul on the slow path: the peak is fp32's.
            logger.info(
                f"bf16 matrix multiplies take {slowdown:.0f}x as long as fp32 on this "
                "CPU (no AVX512-BF16 or AMX): bf16 recipes step slowly here, and "
                "--training.mixed_precision_param float32 rehearses faster "
                "(docs/troubleshooting.md)"
            )
            _cpu_peak_cache["cpu"] = fp32
        else:
            _cpu_peak_cache["cpu"] = max(fp32, measure_matmul_flops(torch.bfloat16))
    return _cpu_peak_cache["cpu"]


def bf16_matmul_slowdown(n: int = 256, repeats: int = 3) -> float:
    """How many times as long an n^3 matmul takes in bf16 as in fp32 on this
    process's threads (below 1 where bf16 is the faster)."""
    return (measure_matmul_flops(torch.float32, n, repeats)
            / measure_matmul_flops(torch.bfloat16, n, repeats))



def install_cpu() -> list[str]:
    import torchtitan.tools.utils as tt_utils

    touched = set_device_globals("cpu", CpuDeviceModule)

    # trainer.py reads utils.get_local_device at call time; distributed.utils
    # holds an import-time copy.
    import torchtitan.distributed.utils as dist_utils

    for module in (tt_utils, dist_utils):
        module.get_local_device = _cpu_local_device
        touched.append(f"{module.__name__}.get_local_device")

    # Upstream falls back to an A100 figure for unknown devices; MFU on a CPU
    # rank is against the measured (or configured) matmul peak instead.
    upstream_peak = tt_utils.get_peak_flops

    def get_peak_flops(device_name: str) -> float:
        if device_name.startswith("CPU"):
            return cpu_peak_flops()
        return upstream_peak(device_name)

    if not getattr(upstream_peak, "_torchtitan_neuron", False):
        get_peak_flops._torchtitan_neuron = True
        tt_utils.get_peak_flops = get_peak_flops
    touched.append("torchtitan.tools.utils.get_peak_flops")

    # Inductor's overlap scheduling (upstream's bucketing passes) costs a
    # node by the memory it moves over the device's DRAM bandwidth, which it
    # asks a GPU datasheet or Triton's GPU driver for; on CPU that raises "0
    # active drivers". The host's measured copy bandwidth stands in.
    import torch._inductor.scheduler as scheduler
    import torch._inductor.utils as inductor_utils
    import torch.utils._runtime_estimation as runtime_estimation

    for module in (inductor_utils, scheduler, runtime_estimation):
        module.get_gpu_dram_gbps = host_dram_gbps
        touched.append(f"{module.__name__}.get_gpu_dram_gbps")
    touched += share_compile_workers()
    return touched


def compile_workers_per_rank() -> int:
    """Inductor compile workers for one CPU rank: its share of the host's
    cores among the ranks on this host, at least 1 (1 compiles in the rank's
    own process, with no pool)."""
    return max(1, torch._utils.cpu_count() // ranks_on_host())


def share_compile_workers() -> list[str]:
    """Give each CPU rank ``compile_workers_per_rank()`` inductor compile
    workers, unless ``$TORCHINDUCTOR_COMPILE_THREADS`` says otherwise.

    Inductor's first compile starts a pool of worker processes, one per core
    (``torch._inductor.async_compile.maybe_warm_pool``, whenever Triton is
    installed, and the torch wheel installs it), even when every graph then
    comes from the compile cache. CPU ranks already take the host's cores, so
    on the 2-core machine each rank's workers, importing torch, took the
    cores from both ranks' first step: the medium Llama's warm first step
    was 16.1-17.6 s with them and 9.2-14.6 s with one per rank, its cold one
    55.2 s and 52.8 s (docs/benchmarks.md).
    """
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return []
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = compile_workers_per_rank()
    return ["torch._inductor.config.compile_threads"]


_host_dram_cache: dict[str, float] = {}


def host_dram_gbps() -> float:
    """Host memory bandwidth in GB/s, measured once: bytes read plus written
    by a 64 MiB tensor copy on this process's threads, best of 5."""
    if "gbps" not in _host_dram_cache:
        src = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        _host_dram_cache["gbps"] = 2 * src.numel() / best / 1e9
    return _host_dram_cache["gbps"]

