#!/usr/bin/env python3
"""A Hugging Face folder against this project's model, on the same batch:
``python -m torchtitan_neuron.hf check`` from a checkout, with the same
arguments (``--help`` lists them)."""

import sys

from torchtitan_neuron.hf.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["check", *sys.argv[1:]]))
