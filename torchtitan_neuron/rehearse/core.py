"""``rehearse()``: one recipe's first two steps as one rank of N on the
neuron branch, with fake tensors, checked against TorchNeuron's contract."""

from __future__ import annotations

import os
import time
import traceback
from collections import Counter

import torch

from torchtitan_neuron.rehearse.report import Report


def rehearse(config, *, ngpu: int, target: str, recipe: str) -> Report:
    """Build ``config``'s trainer for rank 0 (or ``RANK``) of ``ngpu`` on the neuron
    platform (``neuron_world``: the device is set up once per process), trace
    two steps, report."""
    from torchtitan_neuron import devices
    from torchtitan_neuron.tracing.world import build_fake_trainer, neuron_world, traced_config
    from torchtitan_neuron.tracing import neuron_device as device
    from torchtitan_neuron.rehearse.backend import StandInNeuronBackend
    from torchtitan_neuron.trainer import StepHook

    from torchtitan_neuron.tracing.world import traced_rank

    start = time.perf_counter()
    report = Report(recipe=recipe, ngpu=ngpu, target=target, rank=traced_rank(),
                    pp=config.parallelism.pipeline_parallel_degree)
    backend = StandInNeuronBackend()
    traced_config(config)
    # The same neuron branch ``plan --target trn2|trn3`` traces.
    with neuron_world(ngpu, target) as (installed, module, fake_mode):
        backend.register(devices.NEURON_COMPILE_BACKEND)
        report.notes.update(_branch_notes(installed, module))
        try:
            with device.HostToFakeDevice(fake_mode):
                trainer = build_fake_trainer(config, StepHook(read_values=False), fake_mode)
        except Exception as exc:  # noqa: BLE001  (reported: the build is step 0)
            _record_failure(report, 0, exc)
            trainer = None
        if trainer is not None:
            from torchtitan_neuron.rehearse.checks import mesh_groups

            backend.groups = mesh_groups(trainer.parallel_dims)
            report.compile_backend = (config.compile.backend if config.compile.enable
                                      else "off")
            report.notes["compile"] = _compile_note(config, backend)
            _run_steps(trainer, backend, fake_mode, report)
            report.notes["memory figure"] = _memory_note(trainer, module)
    _collect(report, backend)
    report.seconds = time.perf_counter() - start
    return report


def _branch_notes(installed, module) -> dict:
    from torchtitan_neuron import devices

    import torchtitan.tools.utils as tt_utils

    return {
        "platform": f"{installed.name} (device {tt_utils.device_type}, process group "
                    f"{installed.dist_backend})",
        "NeuronCores on this host": devices.device_count(devices.NEURON.name),
        "NEFF cache": os.environ.get(devices.NEFF_CACHE_ENV),
        "inductor cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }


def _compile_note(config, backend) -> str:
    if not config.compile.enable:
        return "off: the step runs op by op (eager report)"
    found = torch._dynamo.lookup_backend(config.compile.backend)
    which = "the rehearsal's stand-in" if found is backend else repr(found)
    return (f"torch.compile backend '{config.compile.backend}' -> {which}; components "
            f"{list(config.compile.components)}")


def _memory_note(trainer, module) -> str:
    """The step line's memory figure, read as the neuron branch reads it."""
    stats = trainer.metrics_processor.device_memory_monitor.get_peak_stats()
    synced = bool(module.reads) and all(s for _, s in module.reads)
    return (f"{stats.max_reserved_gib:.2f}GiB reserved "
            f"({'every read after' if synced else 'NOT after'} torch.neuron.synchronize(); "
            "nothing is allocated in a rehearsal)")


def _run_steps(trainer, backend, fake_mode, report: Report) -> None:
    """Steps 1 and 2, every device tensor fake (host data stays real until
    it is copied to ``neuron``); an error ends the trace and is reported (a
    Dynamo graph break with its user frame)."""
    from torchtitan_neuron.rehearse.checks import EagerOps
    from torchtitan_neuron.tracing.neuron_device import HostToFakeDevice

    from torchtitan_neuron.tracing.world import two_steps_of_batches

    data = iter(two_steps_of_batches(trainer))
    eager = EagerOps()
    backend.eager = eager
    for step in (1, 2):
        backend.step = trainer.step = step
        eager.reset()
        try:
            with HostToFakeDevice(fake_mode), eager:
                trainer.train_step(data)
        except Exception as exc:  # noqa: BLE001  (reported, not raised)
            _record_failure(report, step, exc)
            break
    if not report.failures and not report.graph_breaks:
        _run_validation(trainer, backend, fake_mode, report)
    report.eager = {"ops": dict(eager.ops.most_common()), "dtypes": dict(eager.dtypes),
                    "devices": dict(eager.devices), "collectives": eager.collectives,
                    "heavy": {name: {"count": eager.ops[name], "first_at": at}
                              for name, at in eager.where.items()}}


def _run_validation(trainer, backend, fake_mode, report: Report) -> None:
    """With the validator on, one validation batch after step 2, as
    torchtitan's ``Validator.validate`` runs it (eval mode, no grad): its
    graphs (the model's and the loss's, compiled again with grad mode off)
    are checked like the step's. The validator then reads the loss's value,
    which a fake tensor does not have: that read ends the trace, and only
    there."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from torchtitan_neuron.tracing.neuron_device import HostToFakeDevice

    validator = getattr(trainer, "validator", None)
    if validator is None or not trainer.config.validator.enable:
        return
    validator.config.steps = 1
    graphs = len(backend.graphs)
    backend.step = "validation"
    try:
        with HostToFakeDevice(fake_mode):
            validator.validate(trainer.model_parts, step=2)
    except DataDependentOutputException as exc:
        # Raised where validate() itself reads a value, not inside the model.
        own = [f for f in traceback.extract_tb(exc.__traceback__)
               if f.filename.endswith("components/validate.py")]
        if not own or ".item()" not in (own[-1].line or ""):
            _record_failure(report, "validation", exc)
            return
    except Exception as exc:  # noqa: BLE001  (reported, not raised)
        _record_failure(report, "validation", exc)
        return
    finally:
        for part in trainer.model_parts:
            part.train()
    report.notes["validation"] = (f"one batch traced after step 2 (eval mode, no grad): "
                                  f"{len(backend.graphs) - graphs} more graphs compiled")


def _record_failure(report: Report, step: int | str, exc: Exception) -> None:
    from torch._dynamo.exc import Unsupported, UserError

    # Under fullgraph=True Dynamo raises where it would otherwise break the
    # graph: Unsupported (e.g. Tensor.item), or UserError for control flow
    # on a data-dependent value (e.g. on an .item() result).
    if isinstance(exc, (Unsupported, UserError)):
        stack = getattr(exc, "real_stack", None) or []
        frame = stack[-1] if stack else None
        reason = str(exc).strip().splitlines()[0][:300]
        report.graph_breaks.append({"file": frame.filename if frame else None,
                                    "line": frame.lineno if frame else None,
                                    "reason": reason})
        return
    traceback.print_exception(exc)  # the whole story, on stderr
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    where = f" at {last.filename}:{last.lineno}" if last else ""
    stage = (step if isinstance(step, str) else f"step {step}" if step
             else "building the trainer")
    report.failures.append(f"{stage} raised {type(exc).__name__}{where}: "
                           f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")


def _collect(report: Report, backend) -> None:
    ops: Counter = Counter()
    for g in backend.graphs:
        ops.update(g.ops)
        report.dtypes.update(g.dtypes)
        report.complex_ops.update(g.complex_ops)
        report.host_syncs += g.host_syncs
        report.foreign_devices += g.foreign_devices
        report.dynamic_shapes += g.dynamic_shapes
        report.graphs.append({"name": g.name, "ops": sum(g.ops.values()),
                              "histogram": dict(g.ops.most_common()),
                              "dtypes": dict(g.dtypes), "program": g.program,
                              "collectives": {k: v["count"] for k, v in g.collectives.items()}})
    report.ops = ops
    report.graph_breaks += backend.graph_breaks
    report.recompiles = [c for c in backend.compiles if c["step"] == 2]
    per_step = backend.collectives_per_step(2)
    for kind, entry in report.eager.get("collectives", {}).items():
        slot = per_step.setdefault(kind, {"count": 0, "bytes": 0})
        slot["count"] += entry["count"]
        slot["bytes"] += entry["bytes"]
    report.collectives = per_step
    report.collectives_by_mesh = backend.collectives_by_mesh(2)
