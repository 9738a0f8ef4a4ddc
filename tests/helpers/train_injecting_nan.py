"""Train through torchtitan_neuron's entry point with a NaN put into the loss.

``NAN_AT_STEP=<k>`` multiplies the loss by NaN on step k, before backward, so
the gradients of that step are NaN too, as a real divergence would make them.
"""

import os

import torch

from torchtitan_neuron import trainer as neuron_trainer


def main() -> None:
    bad_step = int(os.environ["NAN_AT_STEP"])
    original_init = neuron_trainer.NeuronTrainerMixin.__init__

    def init(self, config):
        original_init(self, config)
        loss_fn = self.loss_fn

        def poisoned(*args, **kwargs):
            loss, rest = loss_fn(*args, **kwargs)
            if self.step == bad_step:
                loss = loss * torch.tensor(float("nan"), device=loss.device)
            return loss, rest

        self.loss_fn = poisoned

    neuron_trainer.NeuronTrainerMixin.__init__ = init
    from torchtitan_neuron.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()
