"""A Trainium-sized run pasted on a CPU host is refused before any rank starts.

A cheap estimate, not a plan: the model is built on the meta device to count
its parameters, and each rank's sharded state is what every CPU run holds at
least, fp32 parameters, gradients and AdamW's two moments (16 bytes a
parameter), over the ranks that shard them. If that alone exceeds the host's
memory divided by the ranks, no rank could get past its first step, so the
launcher refuses it and points at the CPU twin and the planner.
"""

from __future__ import annotations

import torch

from torchtitan_neuron import cpu_twins, devices

GIB = 1024**3
# fp32 parameter + fp32 gradient + AdamW's exp_avg and exp_avg_sq in fp32.
STATE_BYTES_PER_PARAMETER = 16


def parameter_count(config) -> int:
    with torch.device("meta"):
        model = config.model_spec.model.build()
    return sum(p.numel() for p in model.parameters())


def sharded_state_bytes(config, ngpu: int) -> tuple[int, int, int]:
    """(bytes per rank, parameters, shards): the state split over every rank
    but the replicas (FSDP, TP, CP and pipeline stages all divide it)."""
    params = parameter_count(config)
    shards = max(1, ngpu // max(1, config.parallelism.data_parallel_replicate_degree))
    return params * STATE_BYTES_PER_PARAMETER // shards, params, shards


def check_host_memory(config, ngpu: int, module: str | None, recipe: str | None,
                      host_bytes: int | None = None) -> str | None:
    """The refusal message when ``ngpu`` CPU ranks cannot hold the recipe's
    sharded state, else None."""
    per_rank, params, shards = sharded_state_bytes(config, ngpu)
    host = host_bytes or devices.host_memory_bytes()
    if per_rank <= host / ngpu:
        return None
    twin = cpu_twins.cpu_twin(module or "", recipe or "")
    rehearse = (f"Rehearse the same path on CPU with CONFIG={twin[0]} NGPU={twin[1]}"
                if twin else "Rehearse on CPU with the recipe module's debugmodel recipe")
    plan = cpu_twins.plan_command(module, recipe) if module and recipe else "python -m torchtitan_neuron.plan"
    return (
        f"NGPU={ngpu} CPU ranks of {recipe}: each needs {per_rank / GIB:.2f} GiB for its "
        f"sharded state alone ({params / 1e9:.2f} B parameters x {STATE_BYTES_PER_PARAMETER} "
        f"bytes of fp32 parameters, gradients and AdamW moments, over {shards} shards), "
        f"and this host has {host / ngpu / GIB:.2f} GiB per rank ({host / GIB:.1f} GiB / "
        f"{ngpu}). This recipe is sized for Trainium. {rehearse}, and ask the planner "
        f"whether it fits a trn2.48xlarge: {plan}"
    )
