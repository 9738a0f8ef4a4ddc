#!/usr/bin/env python3
"""Export a DCP checkpoint as a Hugging Face folder ``from_pretrained`` opens:
``python -m torchtitan_neuron.hf export`` from a checkout, with the same
arguments (``--help`` lists them)."""

import sys

from torchtitan_neuron.hf.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
