"""The one module that knows device strings.

Everything else asks it: which device the run uses (``neuron``, ``cuda`` or
``cpu``), the process-group backend, the compile backend a recipe's
``backend="neuron"`` resolves to, memory capacity and peak FLOPs.

torchtitan 0.3.0 assumes an accelerator: ``tools/utils.py`` falls back to
``"cuda"`` when none is found, and several modules copy ``device_type`` /
``device_module`` at import time. ``install()`` adapts those globals for the CPU,
explicitly and idempotently, and is called once by the entry point
(``torchtitan_neuron.train``) before torchtitan's trainer runs. Nothing here
patches anything at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from torchtitan.tools.logging import logger

from torchtitan_neuron import cpu_allocator, gloo, known_warnings

# Where torchtitan 0.3.0 keeps an import-time copy of ``device_type`` and/or
# ``device_module``. A test checks this list against torchtitan's source, so a
# new copy upstream is noticed. The autoparallel modules are left out on
# purpose: they import the optional ``autoparallel`` package and are never
# reached by this project's recipes.
DEVICE_GLOBAL_COPIES: dict[str, tuple[str, ...]] = {
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.models.common.token_dispatcher": ("device_type", "device_module"),
    "torchtitan.tools.profiler": ("device_module",),
}
UNPATCHED_DEVICE_COPIES = frozenset(
    {
        "torchtitan.experiments.graph_trainer.llama3.parallelize_autoparallel",
        "torchtitan.experiments.graph_trainer.deepseek_v3.parallelize_autoparallel",
    }
)

# Compile backends that only exist on one platform and what stands in for
# them elsewhere. On CPU, inductor (C++ codegen) beat aot_eager in steady
# state (docs/architecture.md, "Compile cache").
_LOCAL_COMPILE_BACKEND = {"neuron": "neuron", "cuda": "inductor", "cpu": "inductor"}
NEURON_COMPILE_BACKEND = "neuron"
_PLATFORM_ONLY_BACKENDS = {NEURON_COMPILE_BACKEND: "neuron"}

CPU_PEAK_FLOPS_ENV = "TORCHTITAN_NEURON_CPU_PEAK_FLOPS"


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


# --------------------------------------------------------------------------
# CPU stand-in for torch.cuda as torchtitan uses it
# --------------------------------------------------------------------------


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


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


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def _ranks_on_host() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


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
            name=_cpu_name(), total_memory=host_memory_bytes() // _ranks_on_host()
        )

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = _read_status_kib("VmHWM") * 1024
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        # "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0).
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

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
    run bf16 matmuls faster than fp32).
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
        _cpu_peak_cache["cpu"] = max(
            measure_matmul_flops(torch.float32), measure_matmul_flops(torch.bfloat16)
        )
    return _cpu_peak_cache["cpu"]


# --------------------------------------------------------------------------
# install()
# --------------------------------------------------------------------------

_installed: Platform | None = None


def _set_device_globals(device_type: str, device_module) -> list[str]:
    """Every import-time copy of torchtitan's ``device_type`` and
    ``device_module`` (``DEVICE_GLOBAL_COPIES``) set to these."""
    touched = []
    for module_name, names in DEVICE_GLOBAL_COPIES.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, device_type if name == "device_type" else device_module)
            touched.append(f"{module_name}.{name}")
    return touched


def _install_cpu() -> list[str]:
    import torchtitan.tools.utils as tt_utils

    touched = _set_device_globals("cpu", CpuDeviceModule)

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
    touched += _share_compile_workers()
    return touched


def compile_workers_per_rank() -> int:
    """Inductor compile workers for one CPU rank: its share of the host's
    cores among the ranks on this host, at least 1 (1 compiles in the rank's
    own process, with no pool)."""
    return max(1, torch._utils.cpu_count() // _ranks_on_host())


def _share_compile_workers() -> list[str]:
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


def per_rank_compile_cache() -> str | None:
    """Give this rank its own inductor/AOTAutograd cache directory.

    Ranks on one host share ``/tmp/torchinductor_<user>`` by default. Under TP
    x FSDP, ranks of different subgroups trace graphs that differ only in the
    name of their process group, and torch 2.14's AOTAutograd cache serves
    one rank's compiled code to another: seen here as "Could not resolve the
    process group registered under the name 23" on a 4-rank TP2 x FSDP2
    DeepSeek run with inductor. ``$TORCHINDUCTOR_CACHE_DIR`` (or torch's
    default) stays the root; each rank uses ``<root>/rank<R>-of-<N>``.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return _per_rank_dir("TORCHINDUCTOR_CACHE_DIR", default_cache_dir)


def _per_rank_dir(env: str, default_root) -> str | None:
    """``<root>/rank<R>-of-<N>`` for a launched rank, set in ``env``: the root
    is ``env``'s value or ``default_root()``. None outside a launch."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    path = os.path.join(os.environ.get(env) or default_root(), f"rank{rank}-of-{world}")
    os.environ[env] = path
    return path


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
    return _per_rank_dir(NEFF_CACHE_ENV, lambda: DEFAULT_NEFF_CACHE)


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


def _install_neuron() -> list[str]:
    return _set_device_globals(NEURON.device_type, NeuronDeviceModule())


def install(platform: Platform | None = None) -> Platform:
    """Adapt torchtitan's device globals to the platform, once.

    ``platform`` is the detected one unless given (the rehearsal gives
    ``NEURON``). On CPU it sets ``device_type="cpu"`` and a CPU device module
    in every module listed in ``DEVICE_GLOBAL_COPIES``, makes
    ``get_local_device`` return the host device, and points MFU at the CPU
    matmul peak. On neuron it sets ``device_type="neuron"`` and
    ``NeuronDeviceModule`` there (memory read after a synchronize), and each
    launched rank gets its own NEFF cache. On cuda torchtitan's own detection
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
    touched = {"cpu": _install_cpu, "neuron": _install_neuron}.get(
        platform.name, lambda: [])()
    single_worker_gloo = gloo.install()
    caches = [per_rank_compile_cache()]
    if platform.name == "neuron":
        caches.append(per_rank_neff_cache())
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



@contextlib.contextmanager
def grad_clip_override(clip_fn):
    """Run torchtitan's train step with ``clip_fn`` as its gradient clipper.

    ``Trainer.train_step`` calls ``torchtitan.distributed.utils.clip_grad_norm_``
    inline; swapping that module attribute for the duration of one step is the
    only way to compile it without copying ``train_step``. ``None`` leaves the
    eager function in place.
    """
    if clip_fn is None:
        yield
        return
    import torchtitan.distributed.utils as dist_utils

    eager = dist_utils.clip_grad_norm_
    dist_utils.clip_grad_norm_ = clip_fn
    try:
        yield
    finally:
        dist_utils.clip_grad_norm_ = eager
