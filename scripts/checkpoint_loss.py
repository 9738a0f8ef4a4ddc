#!/usr/bin/env python3
"""The loss of a saved model on a fixed batch, in one process, unsharded:
``python -m torchtitan_neuron.hf loss`` from a checkout, with the same
arguments (``--help`` lists them)."""

import sys

from torchtitan_neuron.hf.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["loss", *sys.argv[1:]]))
