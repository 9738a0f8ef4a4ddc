"""The platform layer: selection order, backend resolution, CPU adaptation.

Proves: neuron is chosen when torch-neuronx is importable (with a stand-in, since
it cannot be installed here), then cuda, then cpu; a recipe's ``neuron`` compile
backend resolves to the local compiler elsewhere; ``install()`` adapts every
import-time copy of torchtitan's device globals and nothing else is left
pointing at CUDA; the CPU memory figure is a real, resettable measurement.

Tier: fast.
Run: .venv/bin/python -m pytest tests/test_devices.py -q
"""

import ast
import os
import importlib
import pathlib

import pytest
import torch

import torchtitan
from torchtitan_neuron import devices
import torchtitan_neuron.devices.cpu  # noqa: F401  (devices.cpu below)
import torchtitan_neuron.devices.torchtitan_globals  # noqa: F401


def test_neuron_wins_when_torch_neuronx_is_present():
    plat = devices.detect(
        module_available=lambda name: name == "torch_neuronx", cuda_available=lambda: True
    )
    assert (plat.name, plat.device_type, plat.dist_backend, plat.compile_backend) == (
        "neuron", "neuron", "neuron", "neuron"
    )
    assert plat.is_neuron


def test_cuda_then_cpu():
    cuda = devices.detect(module_available=lambda n: False, cuda_available=lambda: True)
    assert (cuda.device_type, cuda.dist_backend, cuda.compile_backend) == (
        "cuda", "nccl", "inductor"
    )
    cpu = devices.detect(module_available=lambda n: False, cuda_available=lambda: False)
    assert (cpu.device_type, cpu.dist_backend) == ("cpu", "gloo")
    assert not cuda.is_neuron and not cpu.is_neuron


def test_detect_finds_a_real_stand_in_module(tmp_path, monkeypatch):
    # A package named torch_neuronx on sys.path is enough for detection.
    (tmp_path / "torch_neuronx").mkdir()
    (tmp_path / "torch_neuronx" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert devices.detect().name == "neuron"


def test_neuron_backend_resolves_to_local_compiler():
    cpu = devices.Platform("cpu", "cpu", "gloo", "inductor")
    assert cpu.resolve_compile_backend("neuron") == "inductor"
    assert cpu.resolve_compile_backend("aot_eager") == "aot_eager"
    neuron = devices.Platform("neuron", "neuron", "neuron", "neuron")
    assert neuron.resolve_compile_backend("neuron") == "neuron"


def _import_time_device_copies() -> set[str]:
    """Modules of torchtitan that import device_type/device_module by value."""
    root = pathlib.Path(torchtitan.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        if "tests" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "torchtitan.tools.utils"
                and {a.name for a in node.names} & {"device_type", "device_module"}
            ):
                rel = path.relative_to(root.parent).with_suffix("")
                found.add(".".join(rel.parts))
    return found


def test_every_import_time_device_copy_is_known():
    known = (set(devices.torchtitan_globals.DEVICE_GLOBAL_COPIES)
             | devices.torchtitan_globals.UNPATCHED_DEVICE_COPIES)
    new = _import_time_device_copies() - known
    assert not new, f"torchtitan grew import-time device copies: {sorted(new)}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU adaptation only")
def test_install_adapts_every_copy_and_is_idempotent():
    plat = devices.install()
    assert plat.name == "cpu"
    for module_name, names in devices.torchtitan_globals.DEVICE_GLOBAL_COPIES.items():
        module = importlib.import_module(module_name)
        for name in names:
            value = getattr(module, name)
            expected = "cpu" if name == "device_type" else devices.cpu.CpuDeviceModule
            assert value == expected, f"{module_name}.{name} = {value!r}"
    assert devices.install() is plat
    import torchtitan.tools.utils as tt_utils

    assert tt_utils.get_local_device() == torch.device("cpu")
    assert tt_utils.get_peak_flops(devices.cpu.CpuDeviceModule.get_device_name()) > 1e9
    # Inductor's overlap scheduling costs nodes by DRAM bandwidth: on CPU the
    # host's measured figure, where it asked Triton's GPU driver and raised.
    import torch.utils._runtime_estimation as runtime_estimation

    gbps = runtime_estimation.get_gpu_dram_gbps()
    assert gbps == devices.cpu.host_dram_gbps() and 0.5 < gbps < 10_000


def test_each_cpu_rank_gets_its_share_of_compile_workers(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(torch._utils, "cpu_count", lambda: 8)
    # inductor's config module restores its own patches (pytest's would hide the key).
    with inductor_config.patch(compile_threads=None):
        for ranks, workers in (("1", 8), ("2", 4), ("3", 2), ("16", 1)):
            monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
            assert devices.cpu.share_compile_workers() == [
                "torch._inductor.config.compile_threads"]
            assert inductor_config.compile_threads == workers, ranks
    # The user's own setting stands.
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "6")
    with inductor_config.patch(compile_threads=6):
        assert devices.cpu.share_compile_workers() == []
        assert inductor_config.compile_threads == 6


def test_cpu_memory_figure_is_measured_and_resettable():
    dev = devices.cpu.CpuDeviceModule
    dev.reset_peak_memory_stats()
    before = dev.memory_stats()["reserved_bytes.all.peak"]
    block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
    during = dev.memory_stats()["reserved_bytes.all.peak"]
    del block
    dev.reset_peak_memory_stats()
    after = dev.memory_stats()["reserved_bytes.all.peak"]
    assert during - before > 200 * 2**20
    assert after < during - 200 * 2**20


def test_peak_flops_can_be_configured(monkeypatch):
    monkeypatch.setenv(devices.cpu.CPU_PEAK_FLOPS_ENV, "1.5e11")
    assert devices.cpu.cpu_peak_flops() == 1.5e11
    monkeypatch.setenv(devices.cpu.CPU_PEAK_FLOPS_ENV, "fast")
    with pytest.raises(ValueError, match=devices.cpu.CPU_PEAK_FLOPS_ENV):
        devices.cpu.cpu_peak_flops()


def test_each_rank_gets_its_own_compile_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    path = devices.per_rank_compile_cache()
    assert path == str(tmp_path / "rank3-of-4")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
    monkeypatch.delenv("RANK")
    assert devices.per_rank_compile_cache() is None


def test_cpu_device_module_is_torch_cpu_plus_what_it_lacks():
    dev = devices.cpu.CpuDeviceModule
    for name in devices.cpu.TORCH_CPU_DELEGATES:
        assert getattr(dev, name) is getattr(torch.cpu, name), name
    assert dev.is_available() and dev.device_count() == 1
    dev.set_device(torch.device("cpu"))
    dev.synchronize()
    with dev.stream(dev.current_stream()):
        pass
    # An index, as torch.device(device_type, index) and barrier(device_ids=...) need.
    assert torch.device("cpu", dev.current_device()).type == "cpu"
    assert dev.get_device_properties().total_memory > 0


@pytest.mark.parametrize("bf16_time, notice", [(0.1, False), (50.0, True)],
                         ids=["native-bf16", "no-native-bf16"])
def test_a_cpu_without_native_bf16_is_named_and_its_large_bf16_matmul_not_timed(
        monkeypatch, caplog, bf16_time, notice):
    """The seconds per matmul are given here: bf16 at 0.1x fp32's (AMX) or
    50x (the fallback loop of a CPU without AVX512-BF16 or AMX)."""
    timed = []

    def flops(dtype=torch.float32, n=1024, repeats=5):
        timed.append((dtype, n))
        return 2 * n**3 / (bf16_time if dtype == torch.bfloat16 else 1.0)

    monkeypatch.delenv(devices.cpu.CPU_PEAK_FLOPS_ENV, raising=False)
    monkeypatch.setattr(devices.cpu, "measure_matmul_flops", flops)
    monkeypatch.setattr(devices.cpu, "_cpu_peak_cache", {})
    with caplog.at_level("INFO"):
        peak = devices.cpu.cpu_peak_flops()
    said = [r.getMessage() for r in caplog.records if "bf16 matrix multiplies" in r.getMessage()]
    if notice:
        assert peak == 2 * 1024**3 and (torch.bfloat16, 1024) not in timed
        assert said == ["bf16 matrix multiplies take 50x as long as fp32 on this CPU (no "
                        "AVX512-BF16 or AMX): bf16 recipes step slowly here, and "
                        "--training.mixed_precision_param float32 rehearses faster "
                        "(docs/troubleshooting.md)"]
    else:
        assert peak == 2 * 1024**3 / 0.1 and (torch.bfloat16, 1024) in timed and not said
