"""Compile a two-block model under torchtitan's selective AC with inductor,
run forward and backward, and print torch's AOTAutograd cache counters as
JSON. Run twice with one TORCHINDUCTOR_CACHE_DIR: the second run should hit.
"""

import json

import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torchtitan.distributed.activation_checkpoint import SelectiveAC

from torchtitan_neuron.experiments.graph_trainer.activation_checkpoint import apply_activation_checkpointing


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": Block(), "1": Block()})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    apply_activation_checkpointing(model, SelectiveAC.Config(), dump_folder="")
    compiled = torch.compile(model, backend="inductor")
    compiled(torch.randn(4, 32, requires_grad=True)).sum().backward()
    print(json.dumps(dict(counters["aot_autograd"])))


if __name__ == "__main__":
    main()
