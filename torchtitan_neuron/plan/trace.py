"""Build the recipe's trainer for one rank on FakeTensors and trace its step.

The trainer is the recipe's own, built for rank 0 of N on torchtitan's fake
process group (``comm.mode fake_backend``) or, for a Neuron target, on the
neuron branch the rehearsal traces (``tracing.world.neuron_world``); its model is
materialized as FakeTensors, its data is random tokens of its vocabulary,
and the plan backend compiles its graphs. Step 1 compiles and creates the gradients and
optimizer state; step 2 is the one measured.
"""

from __future__ import annotations

from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import save_attention
from torchtitan_neuron.memory_accounting.sharded_state import step_start_state
from torchtitan_neuron.memory_accounting.storage_tracker import StorageTracker, instrument
from torchtitan_neuron.plan.backend import PlanBackend
from torchtitan_neuron.tracing.patches import fast_tracing
from torchtitan_neuron.tracing.world import build_fake_trainer, traced_config, two_steps_of_batches


def prepare_config(config, target: str, backend: PlanBackend, neuron: bool = False) -> None:
    """The recipe's config, set to run one fake rank on random tokens: on
    torchtitan's fake process group, or on the ``neuron`` one that
    ``neuron_world`` initialises."""
    traced_config(config)
    if not neuron:
        config.comm.mode = "fake_backend"
    if config.compile.enable:
        config.compile.backend = backend.name
    if target == "cuda":
        # Attention saved as CUDA's kernels are (SimpleFSDP recipes do so
        # in training on every device; this covers the other recipes).
        config.activation_checkpoint = save_attention(config.activation_checkpoint)


def build_trainer(config, backend: PlanBackend, fake_mode=None):
    """The recipe's trainer with a fake model; its step reads no values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan_neuron.trainer import StepHook
    import torchtitan.distributed.utils as dist_utils

    hook = StepHook(
        wrap_clip=lambda compiled: backend.traced_clip(dist_utils.clip_grad_norm_, compiled),
        read_values=False)
    return build_fake_trainer(config, hook,
                              fake_mode or FakeTensorMode(allow_non_fake_inputs=True))


def trace_step(trainer, backend: PlanBackend, tracker: StorageTracker) -> dict[str, int]:
    """Run steps 1 and 2; return the persistent state's bytes as step 2 starts.

    The parameters are FakeTensors, so all the step computes from them is
    too; the batches are real, so the little it reads back (the count of
    valid tokens) is real. In step 2, micro-batches after the second repeat
    the second's tensor lifetimes (the same graphs, with the gradients of
    the earlier ones held), so two stand for any number.
    """
    accumulation = trainer.gradient_accumulation_steps
    data = iter(two_steps_of_batches(trainer))
    instrument(trainer, tracker)
    with fast_tracing():
        trainer.step = 1
        trainer.gradient_accumulation_steps = 1
        with backend.outputs_only():
            trainer.train_step(data)
        state = step_start_state(trainer)
        trainer.step = 2
        trainer.gradient_accumulation_steps = min(accumulation, 2)
        try:
            with backend.tracking(tracker):
                trainer.train_step(data)
        finally:
            trainer.gradient_accumulation_steps = accumulation
    return state
