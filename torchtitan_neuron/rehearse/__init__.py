"""Rehearse the Neuron branch without Trainium.

    python -m torchtitan_neuron.rehearse --module M --config C --ngpu N
        [--target trn2|trn3] [--json] [torchtitan overrides...]

It builds the recipe's own trainer for rank 0 of N on the neuron platform
branch, as ``devices.install()`` sets it up on a Trainium host: device
``neuron``, process group ``neuron`` (fake: nothing is sent), compile backend
``neuron`` (a stand-in running AOTAutograd as TorchNeuron does), every tensor
a FakeTensor. It traces the first two training steps and checks what would
be handed to the Neuron compiler against TorchNeuron's documented contract:
graph breaks, step-2 recompilations, symbolic or data-dependent shapes, host
synchronisations and host devices inside compiled graphs make it ``not
ready`` (exit 1); complex ops and float64 are warnings. Recipe or layout
errors exit 2. See docs/rehearsal.md.

Modules: ``device`` (the fake neuron device, SDPA and process group),
``backend`` (the stand-in compile backend), ``checks`` (what is looked for),
``core`` (``rehearse()``), ``report`` (``Report``), ``__main__`` (the CLI).
"""

_EXPORTS = {"Report": "report", "rehearse": "core"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
