"""One rank of N on FakeTensors: the world a traced (not trained) step runs
in, for the planner and the rehearsal alike.

``fake_world`` is torchtitan's fake process group; ``neuron_world`` is the
neuron branch on the stand-in device (``tracing.neuron_device``);
``traced_config`` sets a recipe to run there on random tokens;
``build_fake_trainer`` builds the recipe's trainer with its model as
FakeTensors.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

from torchtitan_neuron.tracing.patches import fake_model_state


def traced_config(config) -> None:
    """Settings every traced (not trained) step needs, the planner's and the
    rehearsal's: no checkpoint, no seeded init (FakeTensors hold no values),
    no metric writers, random tokens of the recipe's vocabulary."""
    from torchtitan_neuron.tracing.random_tokens import use_random_tokens

    config.checkpoint.enable = False
    config.debug.seed = None
    config.metrics.enable_tensorboard = False
    config.metrics.enable_wandb = False
    use_random_tokens(config)


# How many times the mean routed tokens a traced EP rank receives. A rank's
# load is the sum of its experts' loads, so it is at most the largest expert's
# max/mean (the ``expert_imbalance`` of the step line); the DeepSeek and
# GPT-OSS debug recipes print up to 2.0 in their first steps.
EP_IMBALANCE_ENV = "TORCHTITAN_NEURON_EP_IMBALANCE"
DEFAULT_EP_IMBALANCE = 2.0


def ep_imbalance() -> float:
    return float(os.environ.get(EP_IMBALANCE_ENV, DEFAULT_EP_IMBALANCE))


@contextlib.contextmanager
def neuron_world(ngpu: int, target: str):
    """Rank 0 of ``ngpu`` on the neuron branch, as the rehearsal runs it:
    the stand-in ``neuron`` device (``tracing.neuron_device.setup``, once
    per process), the platform installed as on a trn2 host, the ``neuron``
    process group. Yields (installed platform, device module, fake mode);
    host data copied to ``neuron`` becomes fake inside."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan_neuron import devices
    from torchtitan_neuron.devices.neuron import HOST_CORES
    from torchtitan_neuron.tracing import neuron_device as device

    module = device.setup(target)
    env = {"WORLD_SIZE": str(ngpu), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(
        min(ngpu, HOST_CORES[target]))}
    with fake_world(ngpu), mock.patch.dict(os.environ, env):
        installed = devices.install(devices.NEURON)
        device.init_process_group(ngpu)
        yield installed, module, FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def fake_world(ngpu: int):
    """The environment torchtitan's fake backend reads (NGPU, RANK), MoE
    layers on grouped_mm, the kernel Neuron compiles (FakeTensors have no
    token counts for the per-expert loop to split on), and expert
    parallelism's all-to-all sized for an EP rank that receives
    ``ep_imbalance()`` times the mean load (``patches.balanced_expert_routing``)."""
    from torchtitan_neuron.components.expert_kernels import EXPERT_KERNEL_ENV
    from torchtitan_neuron.tracing.patches import balanced_expert_routing

    env = {"NGPU": str(ngpu), "RANK": os.environ.get("RANK", "0"),
           EXPERT_KERNEL_ENV: os.environ.get(EXPERT_KERNEL_ENV, "grouped_mm")}
    with mock.patch.dict(os.environ, env), balanced_expert_routing(ep_imbalance()):
        yield


def build_fake_trainer(config, hook, fake_mode):
    """The recipe's trainer, its model materialized as FakeTensors of
    ``fake_mode``, built with ``hook`` (``StepHook``)."""
    with fake_model_state(fake_mode):
        return config.build(step_hook=hook)


def two_steps_of_batches(trainer) -> list:
    """The batches steps 1 and 2 draw from ``trainer``'s loader: one per
    gradient-accumulation step, and under pipeline parallelism one per
    microbatch, since torchtitan then fetches each microbatch apart."""
    microbatches = getattr(trainer, "num_pipeline_parallel_microbatches", 1)
    loader = trainer.dataloader
    return [loader.batch()
            for _ in range(2 * trainer.gradient_accumulation_steps * microbatches)]
