"""Pre-flight memory planner: will this recipe, at this layout, fit?

    python -m torchtitan_neuron.plan --module M --config C [--ngpu N]
        [--target trn2|trn3|cuda|cpu] [--json] [--top K] [--sweep]
        [torchtitan overrides...]

It builds the recipe's real trainer for rank 0 of ``N`` in one process, with
torchtitan's fake process group (``--comm.mode fake_backend``) and every
tensor a FakeTensor: no memory is allocated for parameters, activations or
communication. It then runs two real training steps: the SimpleFSDP jit graph
compiled through AOTAutograd with the min-cut partitioner (the one aot_eager,
inductor and neuron use in torch 2.14), run op by op with each value dropped
after its last use; its activation checkpointing and TP layout; the real
loss, gradient clipping and the real optimizer. The first step compiles
and creates the gradients and optimizer state; its compiled programs return
outputs of the recorded shapes without running their ops. It follows every
tensor storage of the second step from the op that creates it until it is
freed, at the dtypes the run would use.

What it counts, per rank:

- sharded parameters, gradients and optimizer state: the live local shards
  after the first step (all three persist between steps);
- buffers (the rotary cache);
- gathered parameters in flight: outputs of all-gathers still live;
- saved activations: tensors made in the model's forward still live;
- logits and loss: tensors made inside the loss (the chunked loss applies
  lm_head there, in fp32);
- temporaries: everything else live at that moment (backward, clipping,
  optimizer).

``--target cpu`` and ``cuda``: the peak is the most bytes live at once, op by
op. Fusion (which removes pointwise intermediates) can only lower it.

``--target trn2`` and ``trn3`` model the Neuron runtime's device memory as
AWS documents it (neuron-runtime/explore/device-memory): each compiled graph
is a NEFF whose inputs and outputs are device tensors, all allocated while it
runs, and whose intermediates live in scratchpad. The runtime keeps one shared
scratchpad per core as large as the largest NEFF's need, in 512 MB pages,
plus a private allocation for every intermediate larger than a page, and
96 MB of micro-code per physical core (two per rank at LNC=2). So the peak is
the state, plus the device tensors at their peak, plus both scratchpads, plus
the micro-code. Attention is saved by selective AC on those targets (and on
CUDA) where the CPU kernel is not (``_target_attention``).

Not modelled: allocator fragmentation, the NEFFs' own code, constants and DMA
rings, communication buffers, and how the Neuron compiler lays out its
scratchpad variables (the plan assumes op-by-op lifetimes within a NEFF).
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # torchtitan's trainer turns automatic garbage collection off when it is
    # built; the planner's process turns it off from the start, so that
    # importing torch and torchtitan (over a thousand collections, about a
    # second here) does not pay for it either. Importing this module (the
    # tests do) leaves the collector alone.
    gc.disable()

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchtitan_neuron.memory import StorageTracker, instrument, state_bytes

GIB = 1024**3

# Device memory per rank, the figure a verdict is measured against. One rank
# is one logical NeuronCore at the default LNC=2 (two physical cores):
#   trn2: 96 GiB per chip / 4 logical cores = 24 GiB (the tutorial's figure);
#   trn3: 144 GiB per chip / 4 logical cores = 36 GiB.
TARGET_CAPACITY_GIB = {"trn2": 24.0, "trn3": 36.0}
TARGETS = ("trn2", "trn3", "cuda", "cpu")
NEURON_TARGETS = ("trn2", "trn3")

# The Neuron runtime's own device memory, from AWS's "Neuron device memory"
# page (neuron-runtime/explore/device-memory): a micro-code overhead of 96 MB
# per physical NeuronCore (LNC=2: two per rank), and scratchpad allocated in
# pages of 512 MB by default (NEURON_SCRATCHPAD_PAGE_SIZE, in MB).
NEURON_MICROCODE_BYTES_PER_PHYSICAL_CORE = 96 * 2**20
NEURON_DEFAULT_SCRATCHPAD_PAGE_MB = 512

# The compiled programs of the step being planned report to this tracker.
_ACTIVE_TRACKERS: list = []
# While set (the planner's first step, which only compiles and creates the
# gradients and optimizer state), compiled programs return outputs of the
# sizes, strides, offsets and dtypes their graphs record, without running.
_OUTPUTS_ONLY: list = []


@dataclass
class Plan:
    recipe: str
    ngpu: int
    target: str
    layout: dict
    peak_gib: float
    capacity_gib: float
    breakdown: dict = field(default_factory=dict)
    largest: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.capacity_gib

    @property
    def headroom_gib(self) -> float:
        return self.capacity_gib - self.peak_gib

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe, "ngpu": self.ngpu, "target": self.target,
            "layout": self.layout, "peak_gib": round(self.peak_gib, 4),
            "capacity_gib": round(self.capacity_gib, 4), "fits": self.fits,
            "headroom_gib": round(self.headroom_gib, 4),
            "breakdown": {k: round(v, 4) for k, v in self.breakdown.items()},
            **({"largest_at_peak": self.largest} if self.largest else {}),
        }

    def describe(self) -> str:
        lines = [
            f"Memory plan for {self.recipe} on {self.ngpu} x {self.target} "
            f"({', '.join(f'{k} {v}' for k, v in self.layout.items())}), one rank:",
        ]
        for name, gib in self.breakdown.items():
            lines.append(f"  {name.replace('_', ' '):<28} {gib:9.3f} GiB")
        lines.append(f"  {'peak':<28} {self.peak_gib:9.3f} GiB")
        lines.append(f"  {'capacity':<28} {self.capacity_gib:9.3f} GiB")
        if self.largest:
            lines.append("largest storages at the peak (GiB, count, term, made by, shape, dtype):")
            for row in self.largest:
                lines.append(f"  {row['gib']:9.3f} x{row['count']:<4} {row['term']:<20} "
                             f"{row['op']} {list(row['shape'])} {row['dtype']}")
        verdict = "fits" if self.fits else "OOM"
        lines.append(
            f"verdict: {verdict} (headroom {self.headroom_gib:+.3f} GiB, "
            f"{100 * self.peak_gib / self.capacity_gib:.0f}% of capacity)"
        )
        return "\n".join(lines)


def capacity_gib(target: str, ngpu: int) -> float:
    if target in TARGET_CAPACITY_GIB:
        return TARGET_CAPACITY_GIB[target]
    if target == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "--target cuda reads the capacity from the device, and no CUDA "
                "device is present here; plan for trn2 or cpu instead."
            )
        return torch.cuda.get_device_properties(0).total_memory / GIB
    if target == "cpu":
        from torchtitan_neuron import platform

        return platform.host_memory_bytes() / GIB / ngpu
    raise SystemExit(f"Unknown --target {target}: choose one of {', '.join(TARGETS)}.")


def ac_name(ac_config) -> str:
    """``none``, ``selective`` or ``full``, as the CLI subcommand spells it."""
    qualname = type(ac_config).__qualname__.lower()
    for name in ("selective", "full"):
        if name in qualname:
            return name
    return "none"


def _run_graph(gm, example_inputs):
    """Boxed code for one partitioned graph that drops each input and
    intermediate after its last use; each execution is reported to the
    active tracker as one compiled program."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    forward = gm.forward

    def run(args):
        if _OUTPUTS_ONLY:
            return _recorded_outputs(gm, args)
        if not _ACTIVE_TRACKERS:
            return forward(args)
        with _ACTIVE_TRACKERS[-1].program(id(gm)):
            return forward(args)

    run._boxed_call = True
    return run


def _recorded_outputs(gm, args: list) -> list:
    """A compiled program's outputs as its graph records them (size, stride,
    storage offset, dtype, device), made in the inputs' fake mode without
    running its ops: all the planner's first step needs of them."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(args)
    if fake_mode is None:
        raise RuntimeError("planner: a compiled program got real tensors in its first step")
    (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    args.clear()  # a boxed program owns its inputs, as when it runs

    def make(node):
        val = node.meta["val"] if isinstance(node, torch.fx.Node) else node
        if not isinstance(val, torch.Tensor):
            return val
        extent = val.storage_offset() + 1 + sum(
            (n - 1) * st for n, st in zip(val.shape, val.stride()) if n > 0)
        with fake_mode:
            flat = torch.empty(extent if val.numel() else 0, dtype=val.dtype, device=val.device)
            return flat.as_strided(val.shape, val.stride(), val.storage_offset())

    return [make(n) for n in outputs]


def _aot_settings() -> dict:
    """What torch 2.14's ``aot_eager`` gives AOTAutograd: the min-cut
    rematerialization partitioner (which aot_eager, inductor and neuron all
    use) and input mutations kept in the graph."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return dict(fw_compiler=_run_graph, bw_compiler=_run_graph,
                partition_fn=min_cut_rematerialization_partition,
                keep_inference_input_mutations=True)


def _register_plan_backend() -> str:
    """An AOTAutograd backend that runs each graph op by op, as torch 2.14's
    ``aot_eager`` does (``_aot_settings``, ``_run_graph``)."""
    from torch._dynamo.backends.common import aot_autograd

    name = "torchtitan_neuron_plan"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(name=name, compiler_fn=aot_autograd(**_aot_settings()))
    return name


def _clip_traced_by_aot(clip, dynamo_clip):
    """Gradient clipping as the planner compiles it: the same function
    (torchtitan's ``clip_grad_norm_``), traced by AOTAutograd with the plan
    backend's settings, without Dynamo's capture in front.

    Dynamo adds nothing to this function's graph: it has no control flow on
    values and no graph breaks, and its only tensor inputs are the gradients
    (the parameters are read for their ``.grad``). Its capture is what costs:
    a fake copy and guards for each of the 2 x 291 DTensors of the 8B model.
    The graph is the same, op for op and name for name (compared on the debug
    Llama and DeepSeek recipes). With pipeline stages (an all-reduce of the
    norm across them) or expert parallelism (which reads each parameter's
    mesh), ``dynamo_clip``, compiled as the run compiles it, is used instead.
    """
    from types import SimpleNamespace

    from torch._functorch.aot_autograd import aot_function

    compiled = {}

    def clip_grads(parameters, max_norm, **kwargs):
        if kwargs.get("pp_mesh") is not None or kwargs.get("ep_enabled"):
            return dynamo_clip(parameters, max_norm, **kwargs)
        grads = [p.grad for p in parameters if p.grad is not None]
        key = (len(grads), max_norm, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])))
        if key not in compiled:

            def on_grads(*grads):
                return clip([SimpleNamespace(grad=g) for g in grads], max_norm, **kwargs)

            compiled[key] = aot_function(on_grads, **_aot_settings())
        return compiled[key](*grads)

    return clip_grads


@contextlib.contextmanager
def _fake_model_state(fake_mode):
    """Materialize the model as FakeTensors (``to_empty``), and skip drawing
    initial weights: FakeTensors hold no values. Buffers (the rotary cache)
    are still computed, as shapes. Everything else (meshes, process groups)
    is built for real."""
    from torchtitan.protocols.model import BaseModel
    from torchtitan.protocols.module import Module

    init_param, init_weights = Module._init_param, BaseModel.init_weights
    to_empty = torch.nn.Module.to_empty

    def fake_to_empty(self, *args, **kwargs):
        with fake_mode:
            return to_empty(self, *args, **kwargs)

    def fake_init_weights(self, **kwargs):
        with fake_mode:
            return init_weights(self, **kwargs)

    Module._init_param = lambda self, name, param: None
    BaseModel.init_weights = fake_init_weights
    torch.nn.Module.to_empty = fake_to_empty
    try:
        yield
    finally:
        Module._init_param, BaseModel.init_weights = init_param, init_weights
        torch.nn.Module.to_empty = to_empty


@contextlib.contextmanager
def _target_attention(target: str):
    """Selective AC as it decides on the target, not on this CPU.

    torchtitan's selective policy saves the output of the attention op. On
    CPU, SDPA dispatches to ``_scaled_dot_product_flash_attention_for_cpu``,
    which is not in torchtitan's save list, so a CPU run recomputes attention
    in the backward. On CUDA it dispatches to the flash or efficient kernel,
    and on Neuron (a PrivateUse1 device) to
    ``_scaled_dot_product_fused_attention_overrideable``: both are in the
    list, so the attention output and its log-sum-exp are saved. When
    planning for those targets, the CPU kernel (same outputs, same shapes)
    is saved as theirs would be."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    if target == "cpu":
        yield
        return
    get_save_ops = SelectiveAC.get_save_ops

    def target_save_ops(self):
        return get_save_ops(self) | {
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        }

    SelectiveAC.get_save_ops = target_save_ops
    try:
        yield
    finally:
        SelectiveAC.get_save_ops = get_save_ops


@contextlib.contextmanager
def _fast_tracing():
    """Tracing settings that make planning the 8B step faster and leave the
    graphs as they are.

    - Dynamo runs no full garbage collection after each compile.
    - AOTAutograd prints the joint, forward and backward graphs as text for
      its logs and its cache entries whether or not either is used (about
      5% of the 8B plan); the plan backend is never cached, so the text is
      made only when those logs are on.
    - Selective activation checkpointing, while AOTAutograd traces the joint
      graph, detaches every op output of a checkpointed region to store it
      in a cache that tracing never reads back (torch: "storage is a tracing
      artifact"); each detach is one more op through functionalization and
      the tracer. The planner stores the traced tensors as they are. The
      partitioned graphs are the same op for op (the debug Llama's forward
      and backward code compared: only node numbering differs); in pinned
      side-by-side runs the 8B TP1 x FSDP64 plan took 7-11% less time.

    The planner's tests and ``make bench-plan`` compare its figures with
    runs made with torch's defaults.
    """
    from unittest import mock

    from torch._functorch._aot_autograd import graph_compile
    from torch._subclasses.functional_tensor import FunctionalTensor

    joint, fw_bw = graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs
    logs_on = torch._logging._internal.log_state.is_artifact_enabled

    def log_joint_graph(*args, **kwargs):
        return joint(*args, **kwargs) if logs_on("aot_joint_graph") else None

    def log_fw_bw_graphs(*args, **kwargs):
        return fw_bw(*args, **kwargs) if logs_on("aot_graphs") else (None, None)

    detach = torch.utils.checkpoint._detach_helper

    def detach_unless_tracing(x):
        if isinstance(x, FunctionalTensor):
            return x
        return detach(x)

    with torch._dynamo.config.patch(run_gc_after_compile=False), \
            mock.patch.object(graph_compile, "_log_joint_graph", log_joint_graph), \
            mock.patch.object(graph_compile, "_log_fw_bw_graphs", log_fw_bw_graphs), \
            mock.patch.object(torch.utils.checkpoint, "_detach_helper", detach_unless_tracing):
        yield


def _batches(config, vocab_size: int, count: int) -> list:
    """Real (small) token batches: the step reads their count of valid tokens."""
    batch, seq = config.training.local_batch_size, config.training.seq_len
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab_size, (batch, seq))
        positions = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
        out.append(({"input": tokens, "positions": positions},
                    torch.randint(0, vocab_size, (batch, seq))))
    return out


def plan(config, *, ngpu: int, target: str, recipe: str, top: int = 0) -> Plan:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan_neuron import platform
    from torchtitan_neuron.components.experts import EXPERT_KERNEL_ENV

    platform.install()
    # FakeTensors have no token counts for the per-expert loop to split on;
    # plan MoE layers on grouped_mm, the kernel Neuron compiles.
    os.environ.setdefault(EXPERT_KERNEL_ENV, "grouped_mm")
    os.environ["NGPU"] = str(ngpu)
    os.environ.setdefault("RANK", "0")
    config.comm.mode = "fake_backend"
    config.checkpoint.enable = False
    config.debug.seed = None
    # The plan reads no data: build the loader on the bundled corpus and
    # tokenizer, so a recipe's gated or remote assets are not needed.
    assets = Path(__file__).resolve().parents[1] / "tests" / "assets"
    if not Path(config.hf_assets_path or "").is_dir():
        config.hf_assets_path = str(assets / "tokenizer")
    config.dataloader.dataset = "c4_test"
    config.dataloader.dataset_path = str(assets / "c4_test")
    config.metrics.enable_tensorboard = False
    config.metrics.enable_wandb = False
    if config.compile.enable:
        config.compile.backend = _register_plan_backend()

    tracker = StorageTracker(record_peak=top > 0)
    neuron = target in NEURON_TARGETS
    if neuron:
        page = int(os.environ.get("NEURON_SCRATCHPAD_PAGE_SIZE",
                                  NEURON_DEFAULT_SCRATCHPAD_PAGE_MB)) * 2**20
        tracker.large_var_bytes = page
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _fake_model_state(fake_mode), _target_attention(target):
        trainer = config.build()
    data = iter(_batches(config, trainer.model_config.vocab_size,
                         2 * trainer.gradient_accumulation_steps))
    # The parameters are FakeTensors, so everything the step computes from them
    # is too; the step itself runs outside the fake mode, so the little it
    # reads back (the count of valid tokens) comes from the real token batch.
    trainer._planning = True
    if trainer.compiled_clip is not None:
        import torchtitan.distributed.utils as dist_utils

        trainer._clip_then_check = trainer._guarded(
            _clip_traced_by_aot(dist_utils.clip_grad_norm_, trainer.compiled_clip))
    trainer.metrics_processor.should_log = lambda step: False
    instrument(trainer, tracker)
    # Step 1 compiles and creates gradients and optimizer state; one
    # micro-batch does that. In step 2, micro-batches after the second repeat
    # the second's tensor lifetimes (the same graphs, with the gradients of
    # the earlier ones held), so two stand for any number.
    accumulation = trainer.gradient_accumulation_steps
    with _fast_tracing():
        trainer.step = 1
        trainer.gradient_accumulation_steps = 1
        _OUTPUTS_ONLY.append(True)
        try:
            trainer.train_step(data)
        finally:
            _OUTPUTS_ONLY.clear()
        state = state_bytes(trainer)
        trainer.step = 2
        trainer.gradient_accumulation_steps = min(accumulation, 2)
        _ACTIVE_TRACKERS.append(tracker)
        try:
            with tracker:
                trainer.train_step(data)
        finally:
            _ACTIVE_TRACKERS.remove(tracker)
            trainer.gradient_accumulation_steps = accumulation
    persistent = sum(state.values())
    breakdown = {k: v / GIB for k, v in state.items()}
    categories = ("gathered_parameters", "saved_activations", "logits_and_loss", "temporaries")
    if neuron:
        # Device tensors (the step's storages that cross a compiled program's
        # boundary) at their peak, plus what the runtime holds for the whole
        # step: the shared scratchpad (the largest program's intermediates,
        # in whole pages), each program's private allocations for
        # intermediates larger than a page, and the micro-code.
        for category in categories:
            breakdown[category] = tracker.tensor_peak_by_category.get(category, 0) / GIB
        shared = max(tracker.scratchpad_peak.values(), default=0)
        shared = -(-shared // page) * page
        lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
        private = sum(tracker.scratchpad_large.values())
        code = lnc * NEURON_MICROCODE_BYTES_PER_PHYSICAL_CORE
        breakdown["shared_scratchpad"] = shared / GIB
        breakdown["private_scratchpad"] = private / GIB
        breakdown["runtime_code"] = code / GIB
        peak_bytes = persistent + tracker.tensor_peak + shared + private + code
    else:
        for category in categories:
            breakdown[category] = tracker.peak_by_category.get(category, 0) / GIB
        peak_bytes = persistent + tracker.peak
    pd = trainer.parallel_dims
    layout = {"tp": pd.tp, "dp_shard": pd.dp_shard, "dp_replicate": pd.dp_replicate,
              "local_batch": config.training.local_batch_size,
              "seq_len": config.training.seq_len,
              "grad_accum": trainer.gradient_accumulation_steps,
              "global_batch": config.training.local_batch_size
              * trainer.gradient_accumulation_steps * pd.dp_shard * pd.dp_replicate,
              "ac": ac_name(config.activation_checkpoint)}
    largest = [
        {"gib": round(b / GIB, 4), "count": c, "term": term, "op": op,
         "shape": list(shape), "dtype": dtype}
        for b, c, term, op, shape, dtype in tracker.largest_at_peak(top)
    ] if top else []
    if neuron and top:
        for program_vars in tracker.large_vars.values():
            for size, made_by in program_vars:
                op, shape, dtype = made_by or ("?", (), "")
                largest.append({"gib": round(size / GIB, 4), "count": 1,
                                "term": "private_scratchpad", "op": op,
                                "shape": list(shape), "dtype": dtype})
    return Plan(
        recipe=recipe, ngpu=ngpu, target=target, layout=layout,
        peak_gib=peak_bytes / GIB,
        capacity_gib=capacity_gib(target, ngpu), breakdown=breakdown, largest=largest,
    )


SWEEP_TP = (1, 2, 4, 8)
SWEEP_AC = ("selective", "full")
_AC_PREFIX = "activation-checkpoint:"


def _layout_args(tp: int, ac: str, global_batch: int,
                 local_batch: int | None = None) -> list[str]:
    args = [f"--parallelism.tensor_parallel_degree={tp}",
            "--parallelism.data_parallel_shard_degree=-1",
            f"--training.global_batch_size={global_batch}"]
    if local_batch is not None:
        args.append(f"--training.local_batch_size={local_batch}")
    # tyro: the AC subcommand comes after every flag.
    return args + [f"{_AC_PREFIX}{ac}"]


def _plan_in_subprocess(opts, overrides: list[str], extra: list[str]) -> dict:
    """One plan per process: each needs its own fake world and compile state."""
    import subprocess

    user = [a for a in overrides if not a.startswith(_AC_PREFIX)]
    cmd = [sys.executable, "-m", "torchtitan_neuron.plan", "--module", opts.module,
           "--config", opts.config, f"--ngpu={opts.ngpu}", f"--target={opts.target}",
           "--json", *user, *extra]
    if opts.capacity_gib is not None:
        cmd.insert(cmd.index("--json"), f"--capacity-gib={opts.capacity_gib}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = [l for l in proc.stderr.splitlines() if l.strip()][-1:] or ["no output"]
        return {"error": last[0][-200:]}
    return json.loads(lines[-1])


def sweep(opts, overrides: list[str], base: Plan) -> list[str]:
    """Table over TP x AC at the recipe's global batch, and the smallest change
    that fits when the recipe as given does not."""
    rows, results = [], {}
    gb = base.layout["global_batch"]
    header = f"{'tp':>3} {'dp_shard':>8} {'ac':>9} {'accum':>5} {'peak GiB':>9} {'capacity':>8}  verdict"
    rows.append(header)
    for tp in SWEEP_TP:
        if opts.ngpu % tp:
            continue
        for ac in SWEEP_AC:
            r = _plan_in_subprocess(opts, overrides, _layout_args(tp, ac, gb))
            results[(tp, ac)] = r
            if "error" in r:
                rows.append(f"{tp:>3} {'':>8} {ac:>9} {'':>5} {'':>9} {'':>8}  refused: {r['error']}")
                continue
            lay = r["layout"]
            rows.append(
                f"{tp:>3} {lay['dp_shard']:>8} {ac:>9} {lay['grad_accum']:>5} "
                f"{r['peak_gib']:>9.2f} {r['capacity_gib']:>8.1f}  "
                f"{'fits' if r['fits'] else 'OOM'}"
            )
    if base.fits:
        rows.append(f"{opts.config} fits as given ({base.peak_gib:.2f} GiB of {base.capacity_gib:.1f}).")
        return rows
    # The tutorial's order: the full-AC variant, then tensor parallelism, then
    # a smaller batch last.
    tp0 = base.layout["tp"]
    candidates = [(tp0, "full")] + [(tp, "full") for tp in SWEEP_TP if tp > tp0 and opts.ngpu % tp == 0]
    for tp, ac in candidates:
        r = results.get((tp, ac)) or _plan_in_subprocess(opts, overrides, _layout_args(tp, ac, gb))
        if r.get("fits"):
            rows.append("Smallest change that fits: " + " ".join(_layout_args(tp, ac, gb))
                        + f" ({r['peak_gib']:.2f} GiB)")
            return rows
    tp_max = candidates[-1][0]
    batch = base.layout["local_batch"] // 2
    while batch >= 1:
        r = _plan_in_subprocess(opts, overrides, _layout_args(tp_max, "full", gb, batch))
        if r.get("fits"):
            rows.append("Smallest change that fits: " + " ".join(_layout_args(tp_max, "full", gb, batch))
                        + f" ({r['peak_gib']:.2f} GiB; the global batch is kept by accumulation)")
            return rows
        batch //= 2
    rows.append("No layout in the sweep fits: more ranks (--ngpu) or a larger device is needed.")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_neuron.plan", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
    )
    parser.add_argument("--module", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--ngpu", type=int, default=int(os.environ.get("NGPU", "1")))
    parser.add_argument("--target", default="trn2", choices=list(TARGETS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--capacity-gib", type=float, default=None,
                        help="device memory per rank, in place of the target's figure")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="also list the N largest groups of tensors live at the peak")
    parser.add_argument("--sweep", action="store_true",
                        help="also plan TP 1, 2, 4, 8 x selective/full AC at the same global batch")
    opts, overrides = parser.parse_known_args(argv)

    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_neuron.preflight import PreflightError, check_layout, check_recipe

    init_logger()
    try:
        check_recipe(opts.module, opts.config)
        config = ConfigManager().parse_args(
            ["--module", opts.module, "--config", opts.config, *overrides]
        )
        check_layout(config, opts.ngpu)
    except PreflightError as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        return 2
    result = plan(config, ngpu=opts.ngpu, target=opts.target, recipe=opts.config,
                  top=max(opts.top, 0))
    if opts.capacity_gib is not None:
        result.capacity_gib = opts.capacity_gib
    if opts.json:
        print(json.dumps(result.to_json()), flush=True)
    else:
        logger.info("\n" + result.describe())
    if opts.sweep:
        print("\n".join(sweep(opts, overrides, result)), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Nothing is left to release: skip the teardown of the traced graphs and
    # FakeTensors, which takes seconds at 8B.
    os._exit(code)
