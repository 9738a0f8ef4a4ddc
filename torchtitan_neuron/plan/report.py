"""The plan a planner run returns, and how it is printed."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_neuron.devices.neuron import CORE_MEMORY_GIB

GIB = 1024**3
TARGETS = ("trn2", "trn3", "cuda", "cpu")


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
    trace: dict = field(default_factory=dict)
    # Neuron targets: the scratchpad mode assumed, why, and the peak in each.
    scratchpad: dict = field(default_factory=dict)
    # Pipeline parallelism: the traced rank, and each traced rank's peak.
    rank: int = 0
    stage_peaks: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        """The plan ``to_json`` wrote (another process's)."""
        return cls(recipe=data["recipe"], ngpu=data["ngpu"], target=data["target"],
                   layout=data["layout"], peak_gib=data["peak_gib"],
                   capacity_gib=data["capacity_gib"], breakdown=data["breakdown"],
                   largest=data.get("largest_at_peak", []), trace=data.get("trace", {}),
                   scratchpad=data.get("scratchpad", {}), rank=data.get("rank", 0))

    def with_stage_rank(self, other: "Plan", rank: int) -> "Plan":
        """Of this plan (rank 0, the first pipeline stage's) and ``other``
        (``rank``'s, the last stage's), the one with the larger peak, both
        peaks named in ``stage_peaks``."""
        worst = other if other.peak_gib > self.peak_gib else self
        worst.rank = rank if worst is other else 0
        worst.stage_peaks = {"0": round(self.peak_gib, 4), str(rank): round(other.peak_gib, 4)}
        return worst

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
            "peak_bytes": round(self.peak_gib * GIB),
            "capacity_gib": round(self.capacity_gib, 4), "fits": self.fits,
            "headroom_gib": round(self.headroom_gib, 4),
            "breakdown": {k: round(v, 4) for k, v in self.breakdown.items()},
            **({"largest_at_peak": self.largest} if self.largest else {}),
            **({"trace": self.trace} if self.trace else {}),
            **({"rank": self.rank} if self.rank else {}),
            **({"stage_peaks_gib": self.stage_peaks} if self.stage_peaks else {}),
            **({"scratchpad": {**self.scratchpad, "peak_gib": {
                k: round(v, 4) for k, v in self.scratchpad["peak_gib"].items()}}}
               if self.scratchpad else {}),
        }

    def describe(self) -> str:
        lines = [
            f"Memory plan for {self.recipe} on {self.ngpu} x {self.target} "
            f"({', '.join(f'{k} {v}' for k, v in self.layout.items())}), "
            + (f"rank {self.rank}:" if self.stage_peaks else "one rank:"),
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
        if self.scratchpad:
            lines.append(self._scratchpad_line())
        if "ep_imbalance" in self.layout:
            lines.append(f"expert parallelism: the token all-to-all sized for an EP rank "
                         f"that receives {self.layout['ep_imbalance']}x the mean routed "
                         "tokens (--ep-imbalance)")
        if self.layout.get("free_gradients"):
            lines.append("gradients: freed as each step starts (--training.disable_cuda_graphs); "
                         "the step's own are counted in temporaries from the backward "
                         "that returns them")
        if self.trace.get("traced_layers"):
            first, second = self.trace["traced_layers"]
            lines.append(f"traced: the first {first} and {second} of {self.trace['layers']} "
                         "blocks, extrapolated (--every-block traces all)")
        if self.stage_peaks:
            first, last = self.stage_peaks.items()
            lines.append(f"pipeline stages: rank {first[0]} (the first stage) peaks at "
                         f"{first[1]:.3f} GiB, rank {last[0]} (the last stage, with the "
                         f"logits) at {last[1]:.3f} GiB; the plan above is the larger")
        verdict = "fits" if self.fits else "OOM"
        lines.append(
            f"verdict: {verdict} (headroom {self.headroom_gib:+.3f} GiB, "
            f"{100 * self.peak_gib / self.capacity_gib:.0f}% of capacity)"
        )
        return "\n".join(lines)


    def _scratchpad_line(self) -> str:
        mode, other = self.scratchpad["mode"], (
            "paged" if self.scratchpad["mode"] == "contiguous" else "contiguous")
        switch = ("NEURON_RT_CONTIGUOUS_SCRATCHPAD=0" if other == "paged"
                  else "contiguous pages (LNC=2, NEURON_RT_CONTIGUOUS_SCRATCHPAD unset)")
        alt = self.scratchpad["peak_gib"][other]
        alt_verdict = "fits" if alt <= self.capacity_gib else "OOM"
        line = (f"scratchpad: {mode} ({self.scratchpad['why']}); "
                f"with {switch}: peak {alt:.3f} GiB, {alt_verdict}")
        if (alt <= self.capacity_gib) != self.fits:
            line += " (the verdict depends on the scratchpad mode: not safe to launch)"
        return line


def capacity_gib(target: str, ngpu: int) -> float:
    """Device memory per rank on ``target``: the table for Neuron, the
    device for CUDA, the host's memory shared by the ranks for CPU."""
    from torchtitan_neuron import devices

    if target in CORE_MEMORY_GIB:  # a Trainium target: the memory per rank
        return CORE_MEMORY_GIB[target]
    if target == "cuda":
        total = devices.cuda_memory_bytes()
        if total is None:
            raise SystemExit(
                "--target cuda reads the capacity from the device, and no CUDA "
                "device is present here; plan for trn2 or cpu instead."
            )
        return total / GIB
    if target == "cpu":
        return devices.host_memory_bytes() / GIB / ngpu
    raise SystemExit(f"Unknown --target {target}: choose one of {', '.join(TARGETS)}.")


def largest_rows(tracker, top: int, neuron: bool) -> list[dict]:
    """The ``top`` largest groups live at the peak; on Neuron also each
    program's private (over-a-page) scratchpad allocations."""
    if not top:
        return []
    rows = [{"gib": round(b / GIB, 4), "count": c, "term": term, "op": op,
             "shape": list(shape), "dtype": dtype}
            for b, c, term, op, shape, dtype in tracker.largest_at_peak(top)]
    if neuron:
        for program_vars in tracker.large_vars.values():
            for size, made_by in program_vars:
                op, shape, dtype = made_by or ("?", (), "")
                rows.append({"gib": round(size / GIB, 4), "count": 1,
                             "term": "private_scratchpad", "op": op,
                             "shape": list(shape), "dtype": dtype})
    return rows
