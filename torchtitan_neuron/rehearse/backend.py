"""The stand-in for TorchNeuron's ``neuron`` torch.compile backend.

It takes what the real backend takes, a Dynamo graph and its example inputs,
and runs AOTAutograd as TorchNeuron does: "AOT Autograd partitions the traced
graph into separate forward and backward graphs, which are compiled as
independent graphs", then lowered through StableHLO to neuronx-cc, with no
Inductor (awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/compile/
about-torch-compile.html). The partitioner is torch's min-cut
rematerialization one, which every AOTAutograd training backend in torch
2.14 uses (``aot_eager``, ``inductor``). Each partitioned graph is checked
(``checks.check_graph``) where TorchNeuron would lower it; the program it
returns produces outputs of the recorded shapes without running (the tensors
are fake), and counts its runs per step.
"""

from __future__ import annotations

import torch

from torchtitan_neuron import devices
from torchtitan_neuron.tracing.ops import recorded_outputs
from torchtitan_neuron.rehearse.checks import GraphFacts, check_graph, program_fingerprint
from torchtitan_neuron.tracing.ops import user_frame


class StandInNeuronBackend:
    """Registered as torch.compile's ``neuron`` backend for one rehearsal."""

    def __init__(self):
        self.step = 0
        self.graphs: list[GraphFacts] = []
        self.graph_breaks: list[dict] = []
        self.compiles: list[dict] = []
        self.runs: dict[int, dict[str, int]] = {}
        self.eager = None  # the EagerOps mode, paused while a program "runs"
        self.groups: dict[str, str] = {}  # process group -> mesh dimension

    def register(self, name: str = devices.NEURON_COMPILE_BACKEND) -> None:
        torch._dynamo.register_backend(name=name, compiler_fn=self)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
        dynamo_name = f"graph{len(self.compiles)}"
        first = next((n for n in gm.graph.nodes if user_frame(n)), None)
        where = user_frame(first) if first is not None else None
        self.compiles.append({
            "graph": dynamo_name, "step": self.step, "compile_id": str(compile_id),
            "file": where[0] if where else None, "line": where[1] if where else None})
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and reason.graph_break:
            frame = reason.user_stack[-1] if reason.user_stack else None
            self.graph_breaks.append({
                "file": frame.filename if frame else None,
                "line": frame.lineno if frame else None, "reason": reason.reason})

        def compiler(kind):
            def compile_graph(graph_module, inputs):
                return self._program(graph_module, f"{dynamo_name}.{kind}")
            return compile_graph

        return aot_autograd(
            fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _program(self, gm: torch.fx.GraphModule, name: str):
        from torch.fx.graph import _BoxedCodeGen

        facts = check_graph(gm, name, self.groups)
        facts.program = program_fingerprint(gm)
        self.graphs.append(facts)
        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()

        def run(args):
            counts = self.runs.setdefault(self.step, {})
            counts[name] = counts.get(name, 0) + 1
            if self.eager is not None:
                self.eager.paused = True
            try:
                return recorded_outputs(gm, args)
            finally:
                if self.eager is not None:
                    self.eager.paused = False

        run._boxed_call = True
        return run

    def collectives_per_step(self, step: int) -> dict[str, dict[str, int]]:
        """Collectives of the programs run in ``step``, each times its runs."""
        by_name = {g.name: g for g in self.graphs}
        total: dict[str, dict[str, int]] = {}
        for name, runs in self.runs.get(step, {}).items():
            for kind, entry in by_name[name].collectives.items():
                slot = total.setdefault(kind, {"count": 0, "bytes": 0})
                slot["count"] += entry["count"] * runs
                slot["bytes"] += entry["bytes"] * runs
        return total

    def collectives_by_mesh(self, step: int) -> dict[str, int]:
        """``kind over dim`` -> count, for the programs run in ``step``."""
        by_name = {g.name: g for g in self.graphs}
        total: dict[str, int] = {}
        for name, runs in self.runs.get(step, {}).items():
            for (kind, dim), count in by_name[name].by_mesh.items():
                key = f"{kind} over {dim}"
                total[key] = total.get(key, 0) + count * runs
        return total
