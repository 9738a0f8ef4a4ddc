"""A rehearsal's findings, its verdict, and how both are printed."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# TorchNeuron decomposes complex ops before lowering when this is on (its
# default from PyTorch 2.13); off, only verified complex ops are lowered
# (awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/reference/env-vars.html).
COMPLEX_ENV = "TORCH_NEURONX_COMPLEX_DECOMPOSE"


# Pipeline parallelism's send and receive: torch's schedule runs them between
# the stages' compiled programs by design, so they are listed, not warned of.
PIPELINE_P2P = frozenset({"c10d.send", "c10d.recv_", "c10d.isend", "c10d.irecv"})


@dataclass
class Report:
    recipe: str
    ngpu: int
    target: str
    rank: int = 0
    pp: int = 1
    seconds: float = 0.0
    host_ranks: int = 1
    host_peer: dict = field(default_factory=dict)
    """The host's last rank, traced beside this one: its rank, its programs
    (graph name -> fingerprint) and reasons, or the error that ended it."""
    compile_backend: str = ""
    graphs: list = field(default_factory=list)
    """One entry per partitioned graph: name, op count, collectives."""
    graph_breaks: list = field(default_factory=list)
    recompiles: list = field(default_factory=list)
    dynamic_shapes: list = field(default_factory=list)
    host_syncs: list = field(default_factory=list)
    foreign_devices: list = field(default_factory=list)
    dtypes: Counter = field(default_factory=Counter)
    complex_ops: Counter = field(default_factory=Counter)
    collectives: dict = field(default_factory=dict)
    """Per step (step 2): compiled programs times their runs, plus eager ops."""
    collectives_by_mesh: dict = field(default_factory=dict)
    """Per step (step 2), compiled programs only: ``kind over dim`` -> count
    (``all_gather_into_tensor over cp``: context parallelism's key gathers)."""
    ops: Counter = field(default_factory=Counter)
    eager: dict = field(default_factory=dict)
    """Ops run outside compiled graphs in step 2: ops, dtypes, devices, collectives."""
    failures: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)
    """What the neuron branch did: device, process group, caches, memory figure."""

    def reasons(self) -> list[str]:
        out = [f"graph break at {b['file']}:{b['line']}: {b['reason']}"
               for b in self.graph_breaks]
        out += [f"recompiled in step 2: {r['graph']} ({r['file']}:{r['line']})"
                for r in self.recompiles]
        out += [f"{d['kind']} shape {d['shape']} in {d['graph']} at {d['file']}:{d['line']}"
                for d in self.dynamic_shapes]
        out += [f"host synchronisation {h['op']} in {h['graph']} at {h['file']}:{h['line']}"
                for h in self.host_syncs]
        out += [f"{d['device']} device in {d['graph']} ({d['op']}) at {d['file']}:{d['line']}"
                for d in self.foreign_devices]
        out += list(self.failures)
        # What only the host's last rank hit.
        peer = self.host_peer
        out += [f"rank {peer['rank']}: {r}" for r in peer.get("reasons", []) if r not in out]
        return out

    def add_host_peer(self, rank: int, peer: dict) -> None:
        self.host_peer = {"rank": rank, "reasons": peer.get("reasons", []),
                          "error": peer.get("error"),
                          "programs": {g["name"]: g["program"] for g in peer.get("graphs", [])}}

    def programs(self) -> dict:
        return {g["name"]: g["program"] for g in self.graphs}

    def host_programs(self) -> str:
        """How many distinct programs the host's ranks compile, from this
        rank's graphs and the host's last rank's."""
        mine, peer = self.programs(), self.host_peer
        n = self.host_ranks
        if not mine or not peer:
            return ""
        if peer.get("error"):
            return f"rank {peer['rank']}'s trace did not finish: {peer['error']}"
        theirs = peer["programs"]
        distinct = set(mine.values()) | set(theirs.values())
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        shared = (f"with the NEFF cache shared per host, {len(distinct)} compiles "
                  f"where a cache per rank would run {n * len(mine)}")
        if not differ:
            return (f"{len(mine)} programs on rank {self.rank}, the same {len(theirs)} on rank "
                    f"{peer['rank']} (the host's last): the host's {n} ranks compile "
                    f"{len(set(mine.values()))} distinct programs ({shared})")
        why = (" (another pipeline stage)" if self.pp > 1 else "")
        return (f"{len(mine)} programs on rank {self.rank}; rank {peer['rank']} (the host's "
                f"last){why} differs in {len(differ)} ({', '.join(differ[:4])}"
                f"{', ...' if len(differ) > 4 else ''}): at least {len(distinct)} distinct "
                f"programs on the host, ranks between them not traced")

    def warnings(self) -> list[str]:
        out = []
        if self.complex_ops:
            ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.complex_ops.items()))
            out.append(f"complex-dtype ops in compiled graphs ({ops}): TorchNeuron "
                       f"decomposes them only with {COMPLEX_ENV}=1 (its default on "
                       "PyTorch >= 2.13); with it off, unverified ones fall back")
        if self.dtypes.get("float64") or self.eager.get("dtypes", {}).get("float64"):
            out.append("float64 tensors in the step: Trainium computes in 32 bits "
                       "or fewer; check why a double appears")
        heavy = {k: v for k, v in self.eager.get("heavy", {}).items()
                 if k not in PIPELINE_P2P}
        if self.graphs and heavy:
            ops = ", ".join(f"{k} x{v['count']} (first at {v['first_at']})"
                            for k, v in sorted(heavy.items()))
            out.append(f"a compiled recipe runs these outside its compiled graphs, op "
                       f"by op on Neuron, in step 2: {ops}")
        if self.eager.get("devices", {}).get("cuda"):
            out.append("eager ops touched a cuda device")
        return out

    @property
    def ready(self) -> bool:
        return not self.reasons()

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe, "ngpu": self.ngpu, "target": self.target,
            "ready": self.ready, "reasons": self.reasons(), "warnings": self.warnings(),
            "seconds": round(self.seconds, 1), "compile_backend": self.compile_backend,
            "graphs": self.graphs, "graph_breaks": self.graph_breaks,
            "recompiles": self.recompiles, "dynamic_shapes": self.dynamic_shapes,
            "host_syncs": self.host_syncs, "foreign_devices": self.foreign_devices,
            "dtypes": dict(self.dtypes), "complex_ops": dict(self.complex_ops),
            "collectives": self.collectives,
            "collectives_by_mesh": self.collectives_by_mesh, "ops": dict(self.ops.most_common()),
            "eager": self.eager, "notes": self.notes, "rank": self.rank,
            "host_ranks": self.host_ranks, "host_peer": self.host_peer,
            "host_programs": self.host_programs(),
        }

    def describe(self) -> str:
        verdict = "ready" if self.ready else "not ready"
        lines = [f"Rehearsal of {self.recipe} as rank {self.rank} of {self.ngpu} on {self.target} "
                 f"(neuron branch, fake tensors): {verdict} ({self.seconds:.0f} s)"]
        lines += [f"  {k}: {v}" for k, v in self.notes.items()]
        if self.host_programs():
            lines.append(f"  programs per host: {self.host_programs()}")
        lines.append(f"  compiled graphs: {len(self.graphs)} (compile backend "
                     f"{self.compile_backend}); ops in them: {sum(self.ops.values())}")
        for g in self.graphs:
            lines.append(f"    {g['name']}: {g['ops']} ops, collectives {g['collectives']}")
        lines.append("  dtypes: " + ", ".join(f"{k} {v}" for k, v in self.dtypes.most_common()))
        if self.eager.get("ops"):
            lines.append(f"  eager ops in step 2: {sum(self.eager['ops'].values())} "
                         f"(devices {self.eager['devices']})")
        lines.append("  collectives per step: " + (", ".join(
            f"{k} x{v['count']} ({v['bytes'] / 2**30:.2f} GiB)"
            for k, v in sorted(self.collectives.items())) or "none"))
        if self.collectives_by_mesh:
            lines.append("  in compiled graphs, by mesh dimension: " + ", ".join(
                f"{k} x{v}" for k, v in sorted(self.collectives_by_mesh.items())))
        lines += [f"  NOT READY: {r}" for r in self.reasons()]
        lines += [f"  warning: {w}" for w in self.warnings()]
        return "\n".join(lines)
