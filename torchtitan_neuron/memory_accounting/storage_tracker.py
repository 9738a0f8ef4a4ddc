"""Tensor lifetimes over a training step: one tracker for the planner (on
FakeTensors) and for measuring a real run (on real tensors,
``TORCHTITAN_NEURON_MEASURE_MEMORY_STEP``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_neuron.memory_accounting.sharded_state import local_shard

_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


def _storage_key(t: torch.Tensor) -> int | None:
    """The identity of the storage behind ``t`` (its local shard's)."""
    try:
        return id(local_shard(t).untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class StorageTracker(TorchDispatchMode):
    """Follows every storage created while it is active, by category.

    With ``record_peak=True`` it also remembers which op made each live
    storage, and keeps a copy of that table at the peak (refreshed whenever
    the peak grows by more than 0.5%, so the copy is within 0.5% of the
    peak): ``largest_at_peak()`` lists what the peak is made of.
    """

    def __init__(self, record_peak: bool = False):
        super().__init__()
        self.phase = "other"
        self.live: dict[int, tuple[int, str]] = {}
        self.by_category: dict[str, int] = defaultdict(int)
        self.current = 0
        self.peak = 0
        self.peak_by_category: dict[str, int] = {}
        self.record_peak = record_peak
        self._made_by: dict[int, tuple[str, tuple, str]] = {}
        self._func = ""
        self._snapshot: dict[int, tuple[int, str, tuple]] = {}
        self._snapshot_bytes = 0
        # Compiled-program accounting (see ``program``): storages that cross
        # a program boundary ("tensors") apart from each program's own
        # intermediates ("scratchpad").
        self.tensor_current = 0
        self.tensor_peak = 0
        self.tensor_by_category: dict[str, int] = defaultdict(int)
        self.tensor_peak_by_category: dict[str, int] = {}
        self._tensor_keys: set[int] = set()
        self._program: dict | None = None
        self.scratchpad_need: dict[int, int] = {}
        self.scratchpad_large: dict[int, int] = {}
        self.large_var_bytes: int | None = None
        self.large_vars: dict[int, list[tuple[int, tuple]]] = {}
        # Peaks per segment of the step, off unless ``track_segments`` is
        # called: the block class the ops run in, the programs run so far,
        # each program's index in order of first run.
        self.block: str | None = None
        self._blocks: tuple[int, int, int] | None = None
        self._runs = 0
        self._program_index: dict[int, int] = {}
        self.segment_peaks: dict | None = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile run its compiled graphs while the tracker is on
        # (the tracker sees the ops those graphs execute); by default Dynamo
        # falls back to eager under a dispatch mode, which would measure the
        # eager step instead of the compiled one.
        return True

    def _category(self, func) -> str:
        name = str(func)
        if "all_gather" in name:
            return "gathered_parameters"
        if self.phase == "forward":
            return "saved_activations"
        if self.phase == "loss":
            return "logits_and_loss"
        return "temporaries"

    def track_segments(self, head: int, layers: int, period: int = 1) -> None:
        """Also keep the peaks of each segment of the step: a compiled
        program's run (or the eager ops after it) and, within it, the ops of
        one transformer block, told by its place in a model of ``layers``
        blocks whose first ``head`` differ from the rest, repeated in units
        of ``period`` (``block_class``).
        The planner's shallow traces report them (plan/depth.py)."""
        self._blocks = (head, layers, period)
        self.segment_peaks = {"op": {}, "tensor": {}, "scratch": {}}

    def enter_block(self, index: int | None) -> None:
        """The ops that follow belong to transformer block ``index`` (None:
        to no block)."""
        if self._blocks is not None:
            self.block = None if index is None else block_class(index, *self._blocks)

    def _segment(self) -> str:
        run = str(self._runs) if self._program is not None else f"after{self._runs}"
        return f"{run}|{self.block}"

    def _note(self, level: str, key: str, current: int, by_category: dict) -> None:
        peaks = self.segment_peaks[level]
        if current > peaks.get(key, (-1,))[0]:
            peaks[key] = (current, dict(by_category))

    def _free(self, key: int) -> None:
        size, category = self.live.pop(key, (0, None))
        self._made_by.pop(key, None)
        if category is not None:
            self.current -= size
            self.by_category[category] -= size
        if key in self._tensor_keys:
            self._tensor_keys.discard(key)
            self.tensor_current -= size
            self.tensor_by_category[category] -= size
        elif self._program is not None and key in self._program["local"]:
            serial = self._program["local"].pop(key)
            self._program["events"].append((serial, -size, self.block))

    def _alias(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """``wait_tensor`` returns its input on real tensors; FakeTensors give
        it a new storage. Count one allocation, alive while ``out`` is."""
        old, new = _storage_key(src), _storage_key(out)
        if old is None or new is None or old == new or old not in self.live or new in self.live:
            return
        self.live[new] = self.live.pop(old)
        if old in self._made_by:
            self._made_by[new] = self._made_by.pop(old)
        if old in self._tensor_keys:
            self._tensor_keys.discard(old)
            self._tensor_keys.add(new)
        if self._program is not None and old in self._program["local"]:
            self._program["local"][new] = self._program["local"].pop(old)
        weakref.finalize(local_shard(out).untyped_storage(), self._free, new)

    def _add_tensor(self, key: int, size: int, category: str) -> None:
        self._tensor_keys.add(key)
        self.tensor_current += size
        self.tensor_by_category[category] += size
        if self.tensor_current > self.tensor_peak:
            self.tensor_peak = self.tensor_current
            self.tensor_peak_by_category = dict(self.tensor_by_category)
        if self.segment_peaks is not None:
            self._note("tensor", self._segment(), self.tensor_current, self.tensor_by_category)

    @contextlib.contextmanager
    def program(self, program_id: int):
        """One execution of a compiled program (a NEFF on Neuron).

        The Neuron runtime keeps a program's inputs and outputs as device
        tensors and its intermediates in scratchpad. So while the program
        runs, its inputs and all its outputs are live tensors at once; the
        storages it makes and frees before returning are scratchpad.
        ``scratchpad_need`` is the peak of all of them with op-by-op
        lifetimes (the runtime's max of offset + size over the NEFF's
        variables); ``scratchpad_large`` the peak of those larger than
        ``large_var_bytes`` live at once, which the runtime gives their own
        allocations when its scratchpad pages are not contiguous (large
        ones with disjoint lifetimes can share one).
        """
        if self._program is not None:  # nested: part of the outer program
            yield
            return
        self._runs += 1
        self.block = None
        self._program = {"local": {}, "events": [], "made_by": {}, "entry": self.tensor_current,
                         "entry_by_category": dict(self.tensor_by_category)}
        try:
            yield
        finally:
            prog, self._program = self._program, None
            self.block = None
            outputs = [k for k in prog["local"] if k in self.live]
            out_bytes = sum(self.live[k][0] for k in outputs)
            # Inputs freed while it ran were still held by the program.
            by_cat = defaultdict(int, prog["entry_by_category"])
            for k in outputs:
                by_cat[self.live[k][1]] += self.live[k][0]
            if prog["entry"] + out_bytes > self.tensor_peak:
                self.tensor_peak = prog["entry"] + out_bytes
                self.tensor_peak_by_category = dict(by_cat)
            if self.segment_peaks is not None:
                self._note("tensor", f"{self._runs}|end", prog["entry"] + out_bytes, by_cat)
            for k in outputs:
                self._add_tensor(k, *self.live[k])
            outs = {prog["local"][k] for k in outputs}
            current = peak = 0
            # Over-a-page intermediates (paged scratchpad) get their own
            # allocations; ones whose lifetimes do not overlap can reuse one,
            # so a program needs the peak of those live at once
            # (``large_vars``: the set live at that peak).
            large = large_peak = 0
            live_large: dict[int, int] = {}
            large_vars: list = []
            # Per block segment: (need, large) peaks, for shallow traces.
            by_block: dict = {}
            for serial, size, block in prog["events"]:
                if serial in outs:
                    continue
                current += size
                peak = max(peak, current)
                if self.large_var_bytes is not None and abs(size) > self.large_var_bytes:
                    if size > 0:
                        live_large[serial] = size
                    else:
                        live_large.pop(serial, None)
                    large += size
                    if large > large_peak:
                        large_peak = large
                        large_vars = [(b, prog["made_by"].get(k)) for k, b in live_large.items()]
                if self.segment_peaks is not None and size > 0:
                    need, big = by_block.get(block, (0, 0))
                    by_block[block] = (max(need, current), max(big, large))
            self.scratchpad_need[program_id] = max(self.scratchpad_need.get(program_id, 0), peak)
            if self.segment_peaks is not None:
                index = self._program_index.setdefault(program_id, len(self._program_index))
                for block, (need, big) in by_block.items():
                    self.segment_peaks["scratch"][f"{self._runs}|{block}"] = (index, need, big)
            if large_peak >= self.scratchpad_large.get(program_id, 0):
                self.scratchpad_large[program_id] = large_peak
                self.large_vars[program_id] = large_vars

    def _track(self, t: torch.Tensor, category: str, inputs: set = frozenset()) -> None:
        t = local_shard(t)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        if key in self.live or key in inputs:
            return
        size = storage.nbytes()
        self.live[key] = (size, category)
        weakref.finalize(storage, self._free, key)
        self.current += size
        self.by_category[category] += size
        if self.record_peak:
            self._made_by[key] = (self._func, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        if self._program is not None:
            serial = len(self._program["events"])
            self._program["local"][key] = serial
            self._program["events"].append((serial, size, self.block))
            if self.record_peak:
                self._program["made_by"][serial] = self._made_by.get(key)
        else:
            self._add_tensor(key, size, category)
        if self.segment_peaks is not None:
            self._note("op", self._segment(), self.current, self.by_category)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_category = dict(self.by_category)
            if self.record_peak and self.current > 1.005 * self._snapshot_bytes:
                self._snapshot = {k: (size_, cat, self._made_by.get(k))
                                  for k, (size_, cat) in self.live.items()}
                self._snapshot_bytes = self.current

    def largest_at_peak(self, n: int = 10) -> list[tuple[int, int, str, str, tuple, str]]:
        """(bytes, count, category, op, shape, dtype) of the ``n`` largest
        groups of same-op, same-shape storages live at the peak."""
        groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        for size, category, made_by in self._snapshot.values():
            op, shape, dtype = made_by or ("(before tracking)", (), "")
            g = groups[(category, op, shape, dtype)]
            g[0] += size
            g[1] += 1
        ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:n]
        return [(b, c, cat, op, shape, dtype) for (cat, op, shape, dtype), (b, c) in ranked]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _WAIT_TENSOR and isinstance(out, torch.Tensor):
            self._alias(args[0], out)
            return out
        if self.record_peak:
            self._func = str(func).removesuffix(".default")
        category = self._category(func)
        # In-place ops and views return an input's storage: not a new
        # allocation, even when that storage predates the tracker (the
        # parameters, gradients and optimizer state zeroed and updated in
        # place every step).
        inputs = {_storage_key(leaf) for leaf in pytree.tree_leaves((args, kwargs))
                  if isinstance(leaf, torch.Tensor)}
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, category, inputs)
        return out

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous


def block_class(index: int, head: int, layers: int, period: int = 1) -> str:
    """The place of block ``index`` in a stack of ``layers`` blocks whose
    first ``head`` differ from the rest, which repeat in units of ``period``
    blocks (GPT-OSS alternates two kinds of attention: period 2):
    ``head<i>`` for the head, and for the repeated run the unit's place,
    ``first``, ``second``, ``penult``, ``last`` or ``mid`` between (with a
    period above 1, then ``.<j>``, the block's place in its unit). A block's
    memory is its own pattern plus what the other blocks hold (affine in its
    index and the depth); the pattern depends on its neighbours, which are
    alike for ``second``, every ``mid`` and ``penult``, so no ``mid`` block
    peaks above both."""
    if index < head:
        return f"head{index}"
    unit, place = divmod(index - head, period)
    units = (layers - head) // period
    named = {0: "first", 1: "second", units - 1: "last", units - 2: "penult"}
    name = named.get(unit, "mid")
    return name if period == 1 else f"{name}.{place}"


def instrument(trainer, tracker: "StorageTracker") -> None:
    """Tell ``tracker`` which phase of the step is running: the model's
    forward, the loss (which applies lm_head), or the rest (backward,
    clipping, optimizer)."""
    model = trainer.model_parts[0]
    model.register_forward_pre_hook(lambda *a: setattr(tracker, "phase", "forward"))
    model.register_forward_hook(lambda *a: setattr(tracker, "phase", "backward"))
    loss_fn = trainer.loss_fn

    def tracked_loss(*args, **kwargs):
        with tracker.in_phase("loss"):
            return loss_fn(*args, **kwargs)

    trainer.loss_fn = tracked_loss
