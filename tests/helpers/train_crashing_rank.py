"""Train through torchtitan_neuron's entry point with one rank crashing.

``CRASH_RANK=<r> CRASH_AT_STEP=<k>``: rank r raises ``RuntimeError`` at the
start of step k, as a bug or a failed device would, while the other ranks go
on into the step's collectives.
"""

import os

from torchtitan_neuron import trainer as neuron_trainer


def main() -> None:
    rank, step = int(os.environ["CRASH_RANK"]), int(os.environ["CRASH_AT_STEP"])
    train_step = neuron_trainer.NeuronTrainerMixin.train_step

    def crashing(self, data_iterator):
        if self.step == step and int(os.environ["RANK"]) == rank:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        return train_step(self, data_iterator)

    neuron_trainer.NeuronTrainerMixin.train_step = crashing
    from torchtitan_neuron.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()
