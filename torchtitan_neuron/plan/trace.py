"""Build the recipe's trainer for one rank on FakeTensors and trace its step.

The trainer is the recipe's own, built for rank 0 of N on torchtitan's fake
process group (``comm.mode fake_backend``) or, for a Neuron target, on the
neuron branch the rehearsal traces (``neuron_world``); its model is
materialized as FakeTensors, its data is random tokens of its vocabulary,
and the plan backend compiles its graphs. Step 1 compiles and creates the gradients and
optimizer state; step 2 is the one measured.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

from torchtitan_neuron.activation_checkpoint import save_attention
from torchtitan_neuron.memory import StorageTracker, instrument, state_bytes
from torchtitan_neuron.plan.backend import PlanBackend
from torchtitan_neuron.plan.patches import fake_model_state, fast_tracing


def traced_config(config) -> None:
    """Settings every traced (not trained) step needs, the planner's and the
    rehearsal's: no checkpoint, no seeded init (FakeTensors hold no values),
    no metric writers, random tokens of the recipe's vocabulary."""
    from torchtitan_neuron.random_tokens import use_random_tokens

    config.checkpoint.enable = False
    config.debug.seed = None
    config.metrics.enable_tensorboard = False
    config.metrics.enable_wandb = False
    use_random_tokens(config)


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


@contextlib.contextmanager
def neuron_world(ngpu: int, target: str):
    """Rank 0 of ``ngpu`` on the neuron branch, as the rehearsal runs it:
    the stand-in ``neuron`` device (``rehearse.device.setup``, once per
    process), the platform installed as on a trn2 host, the ``neuron``
    process group. Yields (installed platform, device module, fake mode);
    host data copied to ``neuron`` becomes fake inside."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan_neuron import devices
    from torchtitan_neuron.rehearse import device

    module = device.setup(target)
    env = {"WORLD_SIZE": str(ngpu), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(
        min(ngpu, device.HOST_CORES[target]))}
    with fake_world(ngpu), mock.patch.dict(os.environ, env):
        installed = devices.install(devices.NEURON)
        device.init_process_group(ngpu)
        yield installed, module, FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def fake_world(ngpu: int):
    """The environment torchtitan's fake backend reads (NGPU, RANK), and
    MoE layers on grouped_mm, the kernel Neuron compiles (FakeTensors have
    no token counts for the per-expert loop to split on)."""
    from torchtitan_neuron.components.experts import EXPERT_KERNEL_ENV

    env = {"NGPU": str(ngpu), "RANK": os.environ.get("RANK", "0"),
           EXPERT_KERNEL_ENV: os.environ.get(EXPERT_KERNEL_ENV, "grouped_mm")}
    with mock.patch.dict(os.environ, env):
        yield


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


def build_fake_trainer(config, hook, fake_mode):
    """The recipe's trainer, its model materialized as FakeTensors of
    ``fake_mode``, built with ``hook`` (``StepHook``)."""
    with fake_model_state(fake_mode):
        return config.build(step_hook=hook)


def trace_step(trainer, backend: PlanBackend, tracker: StorageTracker) -> dict[str, int]:
    """Run steps 1 and 2; return the persistent state's bytes after step 1.

    The parameters are FakeTensors, so all the step computes from them is
    too; the batches are real, so the little it reads back (the count of
    valid tokens) is real. In step 2, micro-batches after the second repeat
    the second's tensor lifetimes (the same graphs, with the gradients of
    the earlier ones held), so two stand for any number.
    """
    accumulation = trainer.gradient_accumulation_steps
    loader = trainer.dataloader
    batches = [loader.batch() for _ in range(2 * accumulation)]
    data = iter(batches)
    instrument(trainer, tracker)
    with fast_tracing():
        trainer.step = 1
        trainer.gradient_accumulation_steps = 1
        with backend.outputs_only():
            trainer.train_step(data)
        state = state_bytes(trainer)
        trainer.step = 2
        trainer.gradient_accumulation_steps = min(accumulation, 2)
        try:
            with backend.tracking(tracker):
                trainer.train_step(data)
        finally:
            trainer.gradient_accumulation_steps = accumulation
    return state
