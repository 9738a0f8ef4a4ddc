"""Pre-flight memory planner: will this recipe, at this layout, fit?

    python -m torchtitan_neuron.plan --module M --config C [--ngpu N]
        [--target trn2|trn3|cuda|cpu] [--json] [--top K] [--sweep]
        [--every-block] [torchtitan overrides...]

It builds the recipe's own trainer for rank 0 of N in one process, on
torchtitan's fake process group with every tensor a FakeTensor, and traces
two real training steps (the compiled SimpleFSDP graphs op by op, AC, loss,
clipping, optimizer) on random tokens: no tokenizer, corpus or device memory
is needed. A model ending in 12 or more alike blocks (or units of a few) is
traced at 4 and 5 of them, in two processes at once, and its plan
extrapolated exactly (``depth``; ``--every-block`` traces all of them).
The peak is the most bytes live at once in step 2 (``core``);
for trn2/trn3, the Neuron runtime's device tensors, scratchpad and
micro-code (``neuron``). Not modelled: allocator fragmentation and
communication buffers.

Modules: ``core`` (``plan()``), ``trace`` (building and tracing the step),
``backend`` (the AOT backend), ``neuron``, ``report`` (``Plan``),
``sweep``, ``depth`` (shallow traces), ``patches`` (every upstream patch),
``__main__`` (the CLI).
"""

# Importing the package stays light (``python -m`` imports it before
# ``__main__``, which turns the garbage collector off first).
_EXPORTS = {"Plan": "report", "plan": "core", "sweep": "sweep"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
