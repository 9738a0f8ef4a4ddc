"""What this machine lets `make bench`'s MFU reach, measured without training.

    .venv/bin/python scripts/bench_ceiling.py [--models tiny,medium,deepseek]
        [--ranks 2] [--repeats 7]

`make bench` reports MFU against the fp32 matmul peak of one thread (a
2048^3 ``torch.mm``, the other core idle) and compares the 2-rank MFU with
the same model's 1-rank MFU. Two things bound those figures before any
training code runs, and this script measures both, 1 thread per process:

- **Both cores busy.** The 2048^3 matmul timed in one process alone, then in
  ``--ranks`` processes started together (what a 2-rank run's compute
  threads do). ``concurrent_vs_alone`` is the fraction of the 1-thread peak
  each process keeps when the other core works too: a 2-rank run cannot
  beat ``concurrent_vs_alone`` times its 1-rank MFU by compute alone.
- **The model's own matmuls.** Every linear layer of the bench model (and,
  for MoE, each routed expert's weights at the tokens top-k routing gives
  it on average) as the three matmuls of its forward and backward
  (``x @ W.T``, ``dy @ W``, ``dy.T @ x``), at the tokens one of ``--ranks``
  ranks processes per micro-batch, timed alone and concurrently. The
  FLOP-weighted throughput over the 2048^3 peak is the MFU the run would
  have if attention, the norms, the loss, the optimizer and communication
  took no time at all: an upper bound on ``mfu_vs_matmul_peak``.
- **The update.** Gradient clipping and the fused AdamW step of the recipes
  (torchtitan's defaults) over all the model's parameters, and over one
  rank's shard of them (1/``--ranks`` of each), 1 thread, alone. ``make
  bench``'s ``simplefsdp_no_comm`` processes update every parameter, where
  a rank of the 2-rank run updates its shard: the difference is what that
  cell's step time over-counts against the 2-rank run.
- **The collectives.** One step's collectives of the bucketed SimpleFSDP
  recipe, without the model: ``--ranks`` gloo processes gather every block's
  parameters twice (forward, and again in backward) and reduce-scatter its
  gradients once, one fp32 bucket per transformer block and one per other
  parameter. ``comm_cpu_s`` is the CPU time (all threads, user and system)
  each process spends on them per step: on a machine whose cores all
  compute, that time comes out of the compute. ``comm_wall_s`` is how long
  they take with nothing else running.

Prints ``key=value`` lines; nothing is written.
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import time


from bench import MODELS  # noqa: E402


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_seconds(repeats: int, n: int = 2048) -> tuple[float, float]:
    """(FLOPs, median seconds) of one n^3 fp32 matmul."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3, _timed(lambda: torch.mm(a, b), repeats)


def gemm_seconds(shapes: list[tuple[int, int, int, int]], repeats: int) -> tuple[float, float]:
    """(FLOPs, seconds) of ``count`` x (m, k) @ (k, n) per shape, summed."""
    import torch

    flops = seconds = 0.0
    for m, k, n, count in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        flops += count * 2 * m * k * n
        seconds += count * _timed(lambda: torch.mm(a, b), repeats)
    return flops, seconds


def _worker(barrier, queue, what, args, rank):
    import torch

    torch.set_num_threads(1)
    barrier.wait()
    queue.put(what(*args) if rank is None else what(rank, *args))


def together(processes: int, what, *args, ranked: bool = False) -> list:
    """``what(*args)`` in ``processes`` spawned processes started at once;
    ``ranked``: ``what(rank, *args)``, rank 0.. in each."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_worker,
                         args=(barrier, queue, what, args, rank if ranked else None))
             for rank in range(processes)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return results


def update_seconds(numels: list[int], repeats: int) -> float:
    """Median seconds of gradient clipping plus one fused AdamW step over
    fp32 parameters of these sizes (torchtitan's default optimizer)."""
    import torch

    params = [torch.nn.Parameter(torch.randn(n)) for n in numels]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=8e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=True)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    return _timed(step, repeats)


def meta_model(name: str):
    """The bench model of its SimpleFSDP recipe, built on the meta device."""
    import torch
    from torchtitan.config import ConfigManager

    module, recipe = MODELS[name].simplefsdp
    config = ConfigManager().parse_args(["--module", module, "--config", recipe])
    with torch.device("meta"):
        return config.model_spec.model.build()


def model_numels(name: str) -> list[int]:
    """The sizes of the bench model's parameters."""
    return [p.numel() for p in meta_model(name).parameters()]


def model_buckets(name: str) -> list[int]:
    """The sizes of the bench model's gathers: one per transformer block
    (its parameters together), one per parameter outside the blocks."""
    buckets: dict[str, int] = {}
    for pname, p in meta_model(name).named_parameters():
        parts = pname.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else pname
        buckets[key] = buckets.get(key, 0) + p.numel()
    return list(buckets.values())


def _collectives(rank, world, init, buckets, repeats) -> tuple[float, float]:
    import resource

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                            world_size=world)
    shards = [torch.randn(-(-n // world)) for n in buckets]
    full = [torch.empty(s.numel() * world) for s in shards]

    def step():
        for _ in range(2):  # the forward's gathers, then the backward's re-gathers
            for shard, gathered in zip(shards, full):
                dist.all_gather_single(gathered, shard)
        for shard, gathered in zip(shards, full):
            dist.reduce_scatter_single(shard, gathered)

    step()  # warm-up: gloo's connections and buffers
    cpu, wall = [], []
    for _ in range(repeats):
        dist.barrier()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step()
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        wall.append(t1 - t0)
    dist.barrier()
    dist.destroy_process_group()
    return statistics.median(cpu), statistics.median(wall)


def collectives_seconds(buckets: list[int], ranks: int, repeats: int
                        ) -> list[tuple[float, float]]:
    """(CPU seconds, wall seconds) per rank of one step's collectives."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return together(ranks, _collectives, ranks, f"{tmp}/init", buckets, repeats,
                        ranked=True)


def model_gemms(name: str, ranks: int) -> tuple[list[tuple[int, int, int, int]], int]:
    """The bench model's forward and backward matmuls at one rank's
    micro-batch, as (m, k, n, count); and the tokens."""
    import torch

    model = MODELS[name]
    built = meta_model(name)
    tokens = model.global_batch // ranks * model.seq_len
    shapes: dict[tuple[int, int, int], int] = {}

    def add(m, k, n):
        # x @ W.T (forward), dy @ W (input gradient), dy.T @ x (weight gradient)
        for shape in ((m, k, n), (m, n, k), (n, m, k)):
            shapes[shape] = shapes.get(shape, 0) + 1

    for mod in built.modules():
        if isinstance(mod, torch.nn.Linear):
            add(tokens, mod.in_features, mod.out_features)
    for pname, p in built.named_parameters():
        # Routed experts: [experts, a, b] weights, each expert seeing
        # tokens * top_k / experts tokens on average.
        if p.dim() == 3 and "experts" in pname:
            moe = next(m for n_, m in built.named_modules()
                       if pname.startswith(n_ + ".") and hasattr(m, "router"))
            top_k = moe.router.top_k
            experts, a, b = p.shape
            per_expert = max(1, tokens * top_k // experts)
            for _ in range(experts):
                add(per_expert, b if pname.endswith("w2") else a,
                    a if pname.endswith("w2") else b)
    return [(m, k, n, c) for (m, k, n), c in shapes.items()], tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,medium,deepseek")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()

    (flops, alone), = together(1, peak_seconds, opts.repeats)
    busy = together(opts.ranks, peak_seconds, opts.repeats)
    peak = flops / alone
    busy_gflops = [f / s / 1e9 for f, s in busy]
    ratio = statistics.mean(busy_gflops) / (peak / 1e9)
    print(f"matmul_peak_gflops={peak / 1e9:.1f} (fp32, 1 thread, 2048^3, alone)")
    print(f"matmul_gflops_concurrent={','.join(f'{g:.1f}' for g in busy_gflops)} "
          f"({opts.ranks} processes at once) concurrent_vs_alone={ratio:.3f}", flush=True)
    for name in opts.models.split(","):
        shapes, tokens = model_gemms(name, opts.ranks)
        (f1, s1), = together(1, gemm_seconds, shapes, opts.repeats)
        both = together(opts.ranks, gemm_seconds, shapes, opts.repeats)
        s2 = statistics.mean(s for _, s in both)
        print(f"model={name} tokens_per_rank={tokens} gemm_shapes={len(shapes)} "
              f"gemm_vs_peak_alone={f1 / s1 / peak:.3f} "
              f"gemm_vs_peak_concurrent={f1 / s2 / peak:.3f}", flush=True)
        numels = model_numels(name)
        shard = [-(-n // opts.ranks) for n in numels]
        (full,) = together(1, update_seconds, numels, opts.repeats)
        (part,) = together(1, update_seconds, shard, opts.repeats)
        print(f"model={name} parameters={sum(numels)} update_s_all={full:.3f} "
              f"update_s_one_shard={part:.3f}", flush=True)
        comm = collectives_seconds(model_buckets(name), opts.ranks, opts.repeats)
        print(f"model={name} ranks={opts.ranks} "
              f"comm_cpu_s={statistics.mean(c for c, _ in comm):.3f} "
              f"comm_wall_s={statistics.mean(w for _, w in comm):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
