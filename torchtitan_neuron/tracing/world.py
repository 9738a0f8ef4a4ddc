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


def traced_rank() -> int:
    """The rank a trace stands for: 0, or ``RANK`` where the planner traces
    another (the last pipeline stage's, ``last_stage_rank``)."""
    return int(os.environ.get("RANK", "0"))


def last_stage_rank(config, ngpu: int) -> int:
    """The first rank holding the last pipeline stage: pipeline parallelism
    is the outermost mesh dimension, so pipeline rank r starts at global rank
    r * ngpu / pp; torch's V schedules put the last stage on pipeline rank
    0, the others on the last."""
    pp = config.parallelism.pipeline_parallel_degree
    if pp == 1:
        return 0
    from torch.distributed.pipelining.schedules import (
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
        get_schedule_class,
    )

    # The classes torchtitan's stage placement treats as V-shaped.
    schedule = get_schedule_class(config.parallelism.pipeline_parallel_schedule)
    if schedule in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        return 0
    return (pp - 1) * (ngpu // pp)


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
        device.init_process_group(ngpu, traced_rank())
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

    env = {"NGPU": str(ngpu), "RANK": str(traced_rank()),
           EXPERT_KERNEL_ENV: os.environ.get(EXPERT_KERNEL_ENV, "grouped_mm")}
    with mock.patch.dict(os.environ, env), balanced_expert_routing(ep_imbalance()):
        yield


def build_fake_trainer(config, hook, fake_mode):
    """The recipe's trainer, its model materialized as FakeTensors of
    ``fake_mode``, built with ``hook`` (``StepHook``); pipeline stages are
    given their shapes (``static_pipeline_stages``)."""
    with fake_model_state(fake_mode), static_pipeline_stages(config):
        trainer = config.build(step_hook=hook)
    if getattr(trainer, "pp_schedule", None) is not None:
        static_schedule(trainer.pp_schedule)
    return trainer


def two_steps_of_batches(trainer) -> list:
    """The batches steps 1 and 2 draw from ``trainer``'s loader: one per
    gradient-accumulation step, and under pipeline parallelism one per
    microbatch, since torchtitan then fetches each microbatch apart."""
    microbatches = getattr(trainer, "num_pipeline_parallel_microbatches", 1)
    loader = trainer.dataloader
    return [loader.batch()
            for _ in range(2 * trainer.gradient_accumulation_steps * microbatches)]


def stage_shapes(config, stage_index: int, num_stages: int, tp_mesh=None):
    """(input, output) of one pipeline stage as meta tensors, from the
    config alone: what torch's schedule would otherwise agree with the
    neighbouring ranks by send and receive before the first step.

    The first stage takes a microbatch of token ids; a stage hands the next
    its hidden states, in the mixed-precision parameter dtype SimpleFSDP
    casts to (single-rank runs included), split over the sequence by context
    parallelism and, on ``tp_mesh``, a DTensor sharded over the sequence
    (tensor parallelism's sequence-parallel layout); the last stage returns
    the logits. A wrong shape or layout fails the trace (the received buffer
    meets the stage's graph), so it cannot pass unseen.
    """
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.config import TORCH_DTYPE_MAP

    p, t = config.parallelism, config.training
    micro = p.pipeline_parallel_microbatch_size
    seq = t.seq_len // max(p.context_parallel_degree, 1)
    dim = config.model_spec.model.dim
    dtype = TORCH_DTYPE_MAP[t.mixed_precision_param]

    def activation(*shape, shard=None):
        # requires_grad: the schedule sends the activations' gradients back.
        if tp_mesh is None or shard is None:
            return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=True)
        local = list(shape)
        local[shard] //= tp_mesh.size()
        return DTensor.from_local(
            torch.empty(*local, dtype=dtype, device="meta", requires_grad=True),
            tp_mesh, [Shard(shard)], run_check=False)

    hidden = activation(micro, seq, dim, shard=1)
    inputs = (torch.empty(micro, seq, dtype=torch.int64, device="meta") if stage_index == 0
              else hidden)
    if stage_index < num_stages - 1:
        return inputs, hidden
    return inputs, activation(micro, seq, config.model_spec.model.vocab_size)


@contextlib.contextmanager
def static_pipeline_stages(config):
    """torchtitan's ``pipeline_llm`` builds each ``PipelineStage`` with its
    shapes from ``stage_shapes``: a traced rank's fake process group cannot
    answer the shape agreement of torch's schedule, which then needs static
    shapes (``static_schedule`` skips the agreement)."""
    import torchtitan.distributed.pipeline_parallel as pipeline_parallel
    from torch.distributed.pipelining import PipelineStage

    def stage(submodule, stage_index, num_stages, device, **kwargs):
        tp_mesh = (kwargs["get_mesh"](("tp",), None)
                   if config.parallelism.tensor_parallel_degree > 1 else None)
        inputs, outputs = stage_shapes(config, stage_index, num_stages, tp_mesh)
        grads = {}
        if tp_mesh is not None:
            # DTensors: torch asks for their gradients' layouts too.
            grads = dict(input_grads=(None,) if stage_index == 0 else inputs,
                         output_grads=outputs)
        return PipelineStage(submodule, stage_index, num_stages, device,
                             input_args=inputs, output_args=outputs, **grads, **kwargs)

    with mock.patch.object(pipeline_parallel, "PipelineStage", stage):
        yield


def static_schedule(schedule) -> None:
    """``schedule`` (a traced rank's pipeline schedule) takes its stages'
    static shapes without the vote its ``_warmup_p2p`` holds before the first
    step: what torch does itself on a process group whose backend is "fake".
    The rehearsal's stand-in "neuron" group is fake too, but torch cannot
    tell, and the vote's ``torch.tensor(..., device=neuron)`` has no kernel."""
    from torch.distributed.pipelining._utils import InferenceMode

    def static_warmup(stages, has_backward, p2p_done):
        for st in stages:
            if InferenceMode.needs_dynamic(st._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {st.stage_index} has no static shapes")
            st._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static_warmup
