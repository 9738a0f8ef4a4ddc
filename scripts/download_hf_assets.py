#!/usr/bin/env python3
"""Download a model's tokenizer (and optionally config or weights) from the
Hugging Face Hub: ``python -m torchtitan_neuron.hf download`` from a checkout,
with the same arguments (``--help`` lists them).

    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer
"""

import sys

from torchtitan_neuron.hf.download import download_hf_assets, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
