"""Gloo process groups with one worker thread: torch 2.14.1's two race.

A ``ProcessGroupGloo`` runs its collectives on worker threads, two per
network device by default (``options->threads = devices * 2`` in the Python
binding of its constructor). After each collective, the worker that ran it
records it in the group's status, unlocked (``ProcessGroupGloo::runLoop`` in
torch 2.14.1):

    AsyncWork::execute(work);
    pgStatus_->lastCompletedSeq = ...;
    pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_);
    ...
    lock.lock();

``lastCompletedWorkName`` is one ``std::string`` shared by both workers. When
two collectives finish at the same moment, one worker frees the string's
heap buffer (``"ALLGATHER_COALESCED"``, which a functional all-gather
reports, is too long to be stored inline) while the other writes
``"ALLREDUCE"`` into it, or both free it. glibc's malloc then aborts the
process on a later allocation, anywhere ("malloc(): unaligned tcache chunk
detected", "double free or corruption"), and the rank dies of SIGABRT; an
allocator without those checks (jemalloc) carries on over a corrupted heap.
SimpleFSDP's compiled steps keep an all-gather and a reduce-scatter in flight
together (the prefetch pass), which is when it happens.
``tests/helpers/gloo_race.py`` reproduces it with torch alone.

With one worker thread the group runs its collectives one after another, on
that thread, still asynchronously to the training thread, and the race
cannot happen. ``install`` registers a creator for the ``gloo`` backend
through torch's own registry (``Backend.register_backend``) that builds the
group as torch's does, with ``threads = 1``: the same devices
(``GLOO_SOCKET_IFNAME``, or the default device), timeout,
``enable_reconfigure``, ranks and group name. Every process group made after
it (the default group and each mesh dimension's) is such a group.
"""

from __future__ import annotations

import os

WORKER_THREADS = 1


def _devices(process_group_gloo) -> list:
    """The network devices torch's own constructor picks: one per interface in
    ``GLOO_SOCKET_IFNAME`` when it is set, else the default device."""
    names = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(names) > 1:
        return [process_group_gloo.create_device(interface=name) for name in names.split(",")]
    return [process_group_gloo.create_default_device()]


def create_process_group(opts, backend_options=None):
    """torch's ``_create_gloo_process_group`` with one worker thread: an
    ``extended_api`` creator, given torch's ``_DistributedBackendOptions``."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = _devices(ProcessGroupGloo)
    options._timeout = opts.timeout
    options._threads = WORKER_THREADS
    options.enable_reconfigure = opts.enable_reconfigure
    group = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)
    group.options.global_ranks_in_group = opts.global_ranks_in_group
    group.options.group_name = opts.group_id
    return group


def install() -> bool:
    """Make every gloo process group created from now on use one worker
    thread. Idempotent; False when this torch has no gloo."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, ProcessGroup

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    plugin = Backend._plugins.get("GLOO")
    if plugin is None or plugin.creator_fn is not create_process_group:
        Backend.register_backend(
            Backend.GLOO, create_process_group, extended_api=True,
            devices=Backend.backend_capability[Backend.GLOO],
            _backend_type=ProcessGroup.BackendType.GLOO)
    return True


def worker_threads(group=None) -> int | None:
    """The worker threads of ``group``'s gloo backend (default: the default
    group), or None when it has none."""
    import torch
    import torch.distributed as dist

    group = group or dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    options = getattr(backend, "options", None)
    return getattr(options, "_threads", None)
