"""Train through torchtitan_neuron's entry point with a graph-capturing backend.

``--compile.backend capture_graphs`` runs aot_eager and writes the ATen ops of
every forward and backward graph AOTAutograd hands it to
``$CAPTURE_DIR/rank<R>_<fw|bw>_<N>.txt``, one op per line, so tests inspect
the compiled graphs themselves rather than log text.
"""

import itertools
import os

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

_counter = itertools.count()


def _recorder(kind: str):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        rank = os.environ.get("RANK", "0")
        path = os.path.join(
            os.environ["CAPTURE_DIR"], f"rank{rank}_{kind}_{next(_counter)}.txt"
        )
        with open(path, "w") as f:
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    f.write(f"{node.target}\n")
        return make_boxed_func(gm.forward)

    return compile_graph


def main() -> None:
    torch._dynamo.register_backend(
        name="capture_graphs",
        compiler_fn=aot_autograd(fw_compiler=_recorder("fw"), bw_compiler=_recorder("bw")),
    )
    from torchtitan_neuron.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()
