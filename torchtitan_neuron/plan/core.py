"""``plan()``: one recipe, one layout, one rank's peak memory."""

from __future__ import annotations

from collections import Counter

from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import ac_name
from torchtitan_neuron.memory_accounting.storage_tracker import StorageTracker
from torchtitan_neuron.devices.neuron import paged_page_bytes, scratchpad_mode
from torchtitan_neuron.plan.neuron import NEURON_TARGETS, SCRATCHPAD_MODES, step_terms
from torchtitan_neuron.plan.report import GIB, Plan, capacity_gib, largest_rows

CATEGORIES = ("gathered_parameters", "saved_activations", "logits_and_loss", "temporaries")


def plan(config, *, ngpu: int, target: str, recipe: str, top: int = 0) -> Plan:
    """Trace ``config``'s training step for rank 0 of ``ngpu`` on
    FakeTensors and return its peak memory on ``target``.

    A Neuron target is traced on the neuron branch, as the rehearsal traces
    it (device and process group ``neuron``, SDPA's fused op), with this
    backend standing in for torch.compile's ``neuron``; others on the CPU
    device and torchtitan's fake process group."""
    neuron = target in NEURON_TARGETS
    tracker = StorageTracker(record_peak=top > 0)
    trainer, state, backend = _trace(config, ngpu, target, tracker)
    return assemble(tracker, state, recipe=recipe, ngpu=ngpu, target=target,
                    layout=layout(config, trainer), trace=trace_facts(backend),
                    largest=largest_rows(tracker, top, neuron and scratchpad_mode()[0] == "paged"))


def segment_trace(config, *, ngpu: int, target: str, head: int, layers: int,
                  period: int = 1) -> dict:
    """Trace as ``plan`` does and return the peaks of each segment of the
    step (``StorageTracker.track_segments``) for a model of ``layers``
    blocks, the first ``head`` unlike the rest, which repeat in units of
    ``period``: what plan/depth.py extrapolates from."""
    tracker = StorageTracker()
    tracker.track_segments(head, layers, period)
    trainer, state, backend = _trace(config, ngpu, target, tracker, marks_blocks=True)
    return {"layers": layers, "state": state, "segments": tracker.segment_peaks,
            "layout": layout(config, trainer), "trace": trace_facts(backend, counts=True)}


def assemble(tracker, state: dict, *, recipe: str, ngpu: int, target: str, layout: dict,
             trace: dict, largest: list) -> Plan:
    """The plan from a traced (or extrapolated) step: ``tracker`` has the
    peaks (``peak``, ``tensor_peak``, each ``*_by_category``) and each
    program's scratchpad need; ``state`` the persistent bytes."""
    neuron = target in NEURON_TARGETS
    mode, why = scratchpad_mode() if neuron else (None, "")
    step_bytes, step_breakdown = step_terms(tracker, CATEGORIES, neuron, mode)
    breakdown = {k: v / GIB for k, v in state.items()}
    breakdown.update(step_breakdown)
    scratchpad = {}
    if neuron:
        # One trace gives both allocation modes; the verdict uses ``mode``.
        scratchpad = {"mode": mode, "why": why, "peak_gib": {
            m: (sum(state.values()) + step_terms(tracker, CATEGORIES, True, m)[0]) / GIB
            for m in SCRATCHPAD_MODES}}
    return Plan(
        recipe=recipe, ngpu=ngpu, target=target, layout=layout,
        peak_gib=(sum(state.values()) + step_bytes) / GIB,
        capacity_gib=capacity_gib(target, ngpu), breakdown=breakdown,
        largest=largest, trace=trace, scratchpad=scratchpad,
    )


def trace_facts(backend, counts: bool = False) -> dict:
    """Where the step was traced: the device, the compile backend's name,
    the partitioned graphs and their ops (with ``counts``, also each
    graph's own op counts)."""
    import torchtitan.tools.utils as tt_utils

    ops: Counter = Counter()
    for graph in backend.graphs:
        ops.update(graph)
    facts = {"device": tt_utils.device_type, "compile_backend": backend.name,
             "graphs": len(backend.graphs), "ops": dict(sorted(ops.items()))}
    if counts:
        facts["per_graph"] = [dict(g) for g in backend.graphs]
        facts["marked_blocks"] = backend.marked
    return facts


def _trace(config, ngpu: int, target: str, tracker, marks_blocks: bool = False):
    """(trainer, persistent state bytes, backend) of the traced step: on the
    neuron branch for a Neuron target (over-a-page intermediates told apart
    for paged scratchpad), on the host device otherwise."""
    if target in NEURON_TARGETS:
        tracker.large_var_bytes = paged_page_bytes()
        return _neuron_trace(config, ngpu, target, tracker, marks_blocks)
    return _host_trace(config, ngpu, target, tracker, marks_blocks)


def _host_trace(config, ngpu: int, target: str, tracker, marks_blocks: bool = False):
    from torchtitan_neuron import devices
    from torchtitan_neuron.plan.backend import PlanBackend
    from torchtitan_neuron.plan.trace import build_trainer, prepare_config, trace_step
    from torchtitan_neuron.tracing.world import fake_world

    devices.install()
    backend = PlanBackend()
    backend.marks_blocks = marks_blocks
    prepare_config(config, target, backend)
    with fake_world(ngpu):
        trainer = build_trainer(config, backend)
        return trainer, trace_step(trainer, backend, tracker), backend


def _neuron_trace(config, ngpu: int, target: str, tracker, marks_blocks: bool = False):
    from torchtitan_neuron import devices
    from torchtitan_neuron.plan.backend import PlanBackend
    from torchtitan_neuron.plan.trace import build_trainer, prepare_config, trace_step
    from torchtitan_neuron.tracing.world import neuron_world
    from torchtitan_neuron.tracing.neuron_device import HostToFakeDevice

    with neuron_world(ngpu, target) as (_, _, fake_mode):
        backend = PlanBackend(devices.NEURON_COMPILE_BACKEND)
        backend.marks_blocks = marks_blocks
        prepare_config(config, target, backend, neuron=True)
        with HostToFakeDevice(fake_mode):
            trainer = build_trainer(config, backend, fake_mode)
            return trainer, trace_step(trainer, backend, tracker), backend


def layout(config, trainer) -> dict:
    from torchtitan_neuron.tracing.world import ep_imbalance

    pd = trainer.parallel_dims
    accumulation = trainer.gradient_accumulation_steps
    return {"tp": pd.tp, "dp_shard": pd.dp_shard, "dp_replicate": pd.dp_replicate,
            **({"cp": pd.cp} if pd.cp > 1 else {}),
            **({"pp": pd.pp, "pp_schedule": config.parallelism.pipeline_parallel_schedule,
                "microbatches": trainer.num_pipeline_parallel_microbatches}
               if pd.pp > 1 else {}),
            **({"ep": pd.ep, "ep_imbalance": ep_imbalance()} if pd.ep > 1 else {}),
            **({"free_gradients": True} if config.training.disable_cuda_graphs else {}),
            "local_batch": config.training.local_batch_size,
            "seq_len": config.training.seq_len,
            "grad_accum": accumulation,
            "global_batch": config.training.local_batch_size
            * accumulation * pd.dp_shard * pd.dp_replicate,
            "ac": ac_name(config.activation_checkpoint)}
