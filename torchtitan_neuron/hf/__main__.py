"""``python -m torchtitan_neuron.hf COMMAND [arguments]``: the Hugging Face
hand-off from the command line.

    export    a DCP checkpoint as a folder from_pretrained opens
    check     a Hugging Face folder against this project's model, on one batch
    loss      the loss of a saved model (DCP or safetensors) on fixed batches
    download  a model's tokenizer, config or weights from the Hub

``python -m torchtitan_neuron.hf COMMAND --help`` gives each one's arguments.
"""

import os
import sys

COMMANDS = {
    "export": ("torchtitan_neuron.hf.export", "export_main"),
    "check": ("torchtitan_neuron.hf.check", "check_main"),
    "loss": ("torchtitan_neuron.hf.model", "loss_main"),
    "download": ("torchtitan_neuron.hf.download", "main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"python -m torchtitan_neuron.hf: unknown command {command!r}; use one of "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    module, function = COMMANDS[command]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return getattr(importlib.import_module(module), function)(rest)


if __name__ == "__main__":
    sys.exit(main())
