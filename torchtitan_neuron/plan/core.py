"""``plan()``: one recipe, one layout, one rank's peak memory."""

from __future__ import annotations

from torchtitan_neuron.memory import StorageTracker
from torchtitan_neuron.plan.neuron import NEURON_TARGETS, scratchpad_page_bytes, step_terms
from torchtitan_neuron.plan.report import GIB, Plan, ac_name, capacity_gib, largest_rows

CATEGORIES = ("gathered_parameters", "saved_activations", "logits_and_loss", "temporaries")


def plan(config, *, ngpu: int, target: str, recipe: str, top: int = 0) -> Plan:
    """Trace ``config``'s training step for rank 0 of ``ngpu`` on
    FakeTensors and return its peak memory on ``target``."""
    from torchtitan_neuron import platform
    from torchtitan_neuron.plan.backend import PlanBackend
    from torchtitan_neuron.plan.trace import build_trainer, fake_world, prepare_config, trace_step

    platform.install()
    backend = PlanBackend()
    prepare_config(config, target, backend)
    neuron = target in NEURON_TARGETS
    tracker = StorageTracker(record_peak=top > 0)
    page = scratchpad_page_bytes()
    if neuron:
        tracker.large_var_bytes = page
    with fake_world(ngpu):
        trainer = build_trainer(config, backend)
        state = trace_step(trainer, backend, tracker)
    step_bytes, step_breakdown = step_terms(tracker, CATEGORIES, neuron, page)
    breakdown = {k: v / GIB for k, v in state.items()}
    breakdown.update(step_breakdown)
    return Plan(
        recipe=recipe, ngpu=ngpu, target=target, layout=layout(config, trainer),
        peak_gib=(sum(state.values()) + step_bytes) / GIB,
        capacity_gib=capacity_gib(target, ngpu), breakdown=breakdown,
        largest=largest_rows(tracker, top, neuron),
    )


def layout(config, trainer) -> dict:
    pd = trainer.parallel_dims
    accumulation = trainer.gradient_accumulation_steps
    return {"tp": pd.tp, "dp_shard": pd.dp_shard, "dp_replicate": pd.dp_replicate,
            "local_batch": config.training.local_batch_size,
            "seq_len": config.training.seq_len,
            "grad_accum": accumulation,
            "global_batch": config.training.local_batch_size
            * accumulation * pd.dp_shard * pd.dp_replicate,
            "ac": ac_name(config.activation_checkpoint)}
