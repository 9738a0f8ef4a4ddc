"""torch 2.14.1's gloo worker-thread race, with torch alone (torchrun, 2 ranks).

Each iteration puts ``INFLIGHT`` functional all-gathers and as many
all-reduces of 8 floats in flight on the default group, then waits for them,
so that the group's two worker threads often finish collectives at the same
moment: the race in ``ProcessGroupGloo::runLoop`` (torchtitan_neuron/devices/gloo.py).
On glibc's malloc a rank then usually dies of SIGABRT ("malloc(): unaligned
tcache chunk detected") within a few thousand iterations.

``GLOO_RACE_FIX=1`` creates the group through ``torchtitan_neuron.devices.gloo``
(one worker thread) instead of torch's default (two). ``ITERS`` (default
3000) iterations; rank 0 prints ``done`` and the group's worker threads.

    python -m torch.distributed.run --nproc_per_node=2 tests/helpers/gloo_race.py
"""

import os
import time

import torch
import torch.distributed as dist

c10d = torch.ops._c10d_functional


def main() -> None:
    if os.environ.get("GLOO_RACE_FIX") == "1":
        from torchtitan_neuron.devices import gloo

        gloo.install()
    dist.init_process_group("gloo")
    group = dist.group.WORLD.group_name
    iters = int(os.environ.get("ITERS", "3000"))
    inflight = int(os.environ.get("INFLIGHT", "4"))
    x = torch.ones(8)
    start = time.monotonic()
    for _ in range(iters):
        outs = []
        for _ in range(inflight):
            outs.append(c10d.all_gather_into_tensor(x, 2, group))
            outs.append(c10d.all_reduce(x, "sum", group))
        for out in outs:
            c10d.wait_tensor(out)
    threads = dist.group.WORLD._get_backend(torch.device("cpu")).options._threads
    if dist.get_rank() == 0:
        print(f"done: {iters} iterations of {2 * inflight} collectives in "
              f"{time.monotonic() - start:.1f} s, {threads} gloo worker threads", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
