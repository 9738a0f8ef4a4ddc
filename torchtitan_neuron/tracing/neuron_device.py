"""A fake ``neuron`` device and process group: what TorchNeuron registers, with
nothing behind it.

TorchNeuron is a PrivateUse1 device named ``neuron`` with ``torch.neuron`` as
its device module, autoloaded with torch
(awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/index.html), whose
process groups are ``dist.init_process_group(backend="neuron")``
(.../torch/guides/torch-distributed.html). Here the same names are registered
with torch's Python-backend hooks, a stand-in device module and torch's fake
process group, so FakeTensors on ``neuron`` flow through the unchanged
neuron branch. ``setup()`` renames PrivateUse1, which torch allows once per
process: a rehearsal owns its process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.overrides import TorchFunctionMode

from torchtitan_neuron.devices import NEURON
from torchtitan_neuron.devices.neuron import CORE_MEMORY_GIB, HOST_CORES

DEVICE = NEURON.device_type


class StandInStream:
    """A stream that orders nothing: no kernel runs in a rehearsal. FSDP2
    (plain-FSDP recipes) makes its own streams and events on the device."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else StandInEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class StandInEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = StandInStream()


@dataclass
class StandInNeuronModule:
    """What ``torch.neuron`` offers that torchtitan and this project call.

    No device exists: memory figures are zero. ``reads`` records, for each
    memory read, whether ``synchronize()`` came first (the order AWS's
    memory-profiling guide requires), so the neuron branch's figure can be
    checked for it.
    """

    target: str
    synchronized: bool = False
    reads: list = field(default_factory=list)

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return HOST_CORES[self.target]

    def current_device(self) -> int:
        return 0

    def set_device(self, device) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        pass

    manual_seed_all = manual_seed

    def get_rng_state(self, device=None) -> torch.Tensor:
        # A Neuron generator's state is 16 bytes, an 8-byte seed then an
        # 8-byte offset (AWS Neuron docs, torch/reference/random-number-
        # generation). torch.random.fork_rng reads and restores it; pipeline
        # schedules fork it before their first step.
        return torch.zeros(16, dtype=torch.uint8)

    def set_rng_state(self, state, device=None) -> None:
        pass

    Stream = StandInStream
    Event = StandInEvent

    def current_stream(self, device=None) -> StandInStream:
        return _CURRENT_STREAM

    def stream(self, stream):
        return contextlib.nullcontext()

    def get_amp_supported_dtype(self) -> list:
        # torch.autocast asks a PrivateUse1 device's module for this.
        return [torch.bfloat16, torch.float16]

    def synchronize(self, device=None) -> None:
        self.synchronized = True

    def get_device_name(self, device=None) -> str:
        return f"NeuronCore ({self.target}, rehearsal stand-in)"

    def get_device_properties(self, device=None):
        return SimpleNamespace(name=self.get_device_name(),
                               total_memory=int(CORE_MEMORY_GIB[self.target] * 2**30))

    def _read(self, name: str) -> None:
        self.reads.append((name, self.synchronized))
        self.synchronized = False

    def memory_stats(self, device=None) -> dict[str, int]:
        self._read("memory_stats")
        return {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                "num_alloc_retries": 0, "num_ooms": 0}

    def reset_peak_memory_stats(self, device=None) -> None:
        self._read("reset_peak_memory_stats")

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self, device=None) -> tuple[int, int]:
        total = self.get_device_properties().total_memory
        return total, total

    memory = SimpleNamespace(_record_memory_history=lambda *a, **k: None,
                             _snapshot=lambda: {})


_state: dict = {}


def setup(target: str) -> StandInNeuronModule:
    """Register ``neuron`` as TorchNeuron would: the device (PrivateUse1
    renamed, a device module, hooks and a device guard), SDPA's fused path and
    the ``neuron`` process-group backend. Once per process; a second call
    with another target is refused."""
    if _state:
        if _state["module"].target != target:
            raise RuntimeError(
                f"the neuron stand-in is set up for {_state['module'].target}; "
                "PrivateUse1 is renamed once per process: rehearse "
                f"{target} in a new process")
        return _state["module"]
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    module = StandInNeuronModule(target)
    # torch's default device guard and hooks: without the guard, autograd on
    # a fake neuron tensor aborts the process.
    _setup_privateuseone_for_python_backend(rename=DEVICE, backend_module=module)
    _state["sdpa"] = register_fused_sdpa()
    register_process_group_backend()
    _state["module"] = module
    return module


def register_fused_sdpa():
    """SDPA on ``neuron`` goes to ``_scaled_dot_product_fused_attention_overrideable``.

    torch's SDPA asks a C++ dispatch stub (``_fused_sdp_choice_stub``) which
    fused kernel a device has; a backend written in C++, as TorchNeuron is,
    registers its choice there, and stock torch without one takes the math
    path, which materialises the whole score matrix. The stub cannot be set
    from Python, so SDPA itself is implemented for PrivateUse1's autograd key
    as the fused branch of ``scaled_dot_product_attention`` runs it: a boolean
    mask becomes an additive one, and grouped-query heads are repeated (the
    fused op takes no ``enable_gqa``). The fused op has meta kernels for
    forward and backward, so FakeTensors and AOTAutograd trace it.
    """
    lib = torch.library.Library("aten", "IMPL")
    fused = torch.ops.aten._scaled_dot_product_fused_attention_overrideable

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
             scale=None, enable_gqa=False):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        if enable_gqa and key.size(-3) != query.size(-3):
            repeats = query.size(-3) // key.size(-3)
            key = key.repeat_interleave(repeats, dim=-3)
            value = value.repeat_interleave(repeats, dim=-3)
        return fused(query, key, value, attn_mask, dropout_p, is_causal, False,
                     scale=scale)[0]

    lib.impl("scaled_dot_product_attention", sdpa, "AutogradPrivateUse1")
    return lib


def _create_fake_neuron_pg(common_opts, backend_opts):
    from torch.testing._internal.distributed.fake_pg import _create_fake_pg

    return _create_fake_pg(common_opts, backend_opts)


def register_process_group_backend() -> None:
    """``neuron`` as a process-group backend that communicates nothing:
    torch's fake process group under TorchNeuron's name (torchtitan's
    ``comm.mode fake_backend`` would name it ``fake``)."""
    import torch.distributed as dist

    dist.Backend.register_backend(DEVICE, _create_fake_neuron_pg, extended_api=True,
                                  devices=[DEVICE, "cpu"])


def init_process_group(ngpu: int, rank: int = 0) -> None:
    """Rank ``rank`` of ``ngpu`` on the ``neuron`` backend, initialised with a
    FakeStore; torchtitan's ``init_distributed`` then finds it initialised."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(DEVICE, store=FakeStore(), rank=rank, world_size=ngpu)
    # What torchtitan's init_distributed does before it creates a group, and
    # skips when one exists: autograd on one thread (device-mesh state is
    # thread-local; a device worker thread on the fake device aborts).
    torch.autograd.set_multithreading_enabled(False)


class TensorOnDevice(TorchFunctionMode):
    """``torch.tensor(data, device=neuron)`` built on the host, then copied.

    torch builds such a tensor below the dispatch modes, so ``HostToFakeDevice``
    never sees it and the stand-in device has no kernel for it. Built on the
    host and copied with ``.to``, it reaches ``HostToFakeDevice`` as every
    other host-to-device copy does (torchtitan's pipeline step returns
    ``torch.tensor([-1.0], device=...)`` on ranks without the last stage)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func is torch.tensor and device is not None and torch.device(device).type == DEVICE:
            return func(*args, **{**kwargs, "device": "cpu"}).to(device)
        return func(*args, **kwargs)


class HostToFakeDevice(TorchDispatchMode):
    """Ops that would put host data on ``neuron`` make FakeTensors instead.

    A training step keeps its batch on the host, reads a few values there
    (torchtitan logs the count of valid tokens with ``int()``), and copies
    the batch to the device. Here that copy, and any factory call naming
    ``neuron``, runs under the model's FakeTensorMode; ops on FakeTensors go
    to their own mode and host ops stay real, so host values can be read.

    A small tensor copied to the device and straight back (torchtitan's seed
    agreement: rank 0's RNG state, broadcast, read back) returns its host
    value: on the fake process group a broadcast leaves a rank's tensor as
    it was. It steps aside while torch.compile traces.
    """

    SHADOW_NUMEL = 64

    def __init__(self, fake_mode):
        super().__init__()
        self.fake_mode = fake_mode
        self.shadows: dict[int, tuple] = {}
        self.factory = TensorOnDevice()

    def __enter__(self):
        self.factory.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.factory.__exit__(*exc)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._pytree import tree_leaves, tree_map_only

        kwargs = kwargs or {}
        flat = tree_leaves((args, kwargs))
        devices = [a for a in flat if isinstance(a, torch.device)]
        fake = any(isinstance(a, FakeTensor) for a in flat)
        copy = func is torch.ops.aten._to_copy.default
        if copy and fake and devices and devices[0].type == "cpu":
            held, host = self.shadows.get(id(args[0]), (None, None))
            if held is args[0]:
                return func(host, **kwargs)
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        host_only = all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)
        if fake or not host_only or not any(d.type == DEVICE for d in devices):
            # FakeTensors, meta tensors and subclasses (DTensor) go their own
            # way; only host data and factories are made fake here.
            return func(*args, **kwargs)
        args, kwargs = tree_map_only(torch.Tensor, self.fake_mode.from_tensor, (args, kwargs))
        with self.fake_mode:
            out = func(*args, **kwargs)
        host = flat[0] if flat and isinstance(flat[0], torch.Tensor) else None
        if (copy and host is not None and host.device.type == "cpu"
                and host.numel() <= self.SHADOW_NUMEL):
            # Held, not weakly referenced: torch refuses to swap a tensor
            # that has a weakref (Module._apply), and these are tiny.
            self.shadows[id(out)] = (out, host)
        return out
