"""Upstream warnings known to be harmless, hidden in one place.

Each entry names the message, where it comes from, the platforms where it is
harmless and why; docs/upstream-workarounds.md has a row for each, and
tests/test_known_warnings.py fails when upstream stops emitting the text (so
a filter never outlives its message). ``install()`` runs once per process
(launcher checks and every rank); a rank says once what it hid.
``TORCHTITAN_NEURON_SHOW_ALL_WARNINGS=1`` hides nothing.

Warnings this project caused are fixed at their root instead (the OpenMP
banner, complex RoPE); nothing else is hidden.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

SHOW_ALL_ENV = "TORCHTITAN_NEURON_SHOW_ALL_WARNINGS"
ALL = ("cpu", "cuda", "neuron")


@dataclass(frozen=True)
class Known:
    name: str
    text: str
    """A substring of the message."""
    source: str
    """``warnings`` (Python's warnings module) or the logger's name
    (``""`` is the root logger torchtitan logs to)."""
    upstream: str
    """The installed file, relative to site-packages, that emits it."""
    platforms: tuple[str, ...]
    why: str
    literals: tuple[str, ...] = ()
    """Where the message is built at run time: the fragments of it that the
    upstream file spells out (default: ``text`` itself)."""


KNOWN = (
    Known("initial-load-model-only",
          "initial_load_model_only=True has no effect without an initial_load_path",
          "", "torchtitan/components/checkpointer/base.py", ALL,
          "torchtitan's own default (True) warns on every config built without a "
          "load path; it only matters once --checkpoint.initial_load_path is given"),
    Known("nccl-async-error-handling",
          "TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3",
          "", "torchtitan/distributed/utils.py", ALL,
          "torchrun sets 1 for every launch and torchtitan sets 3, as it always "
          "does; on gloo and neuron the variable is unused",
          ("will be overridden to {val} based on job config",
           '"TORCH_NCCL_ASYNC_ERROR_HANDLING"')),
    Known("hf-index-missing",
          "model.safetensors.index.json not found at hf_assets_path",
          "", "torchtitan/protocols/state_dict_adapter.py", ALL,
          "a tokenizer-only asset folder has no weight index; an HF export then "
          "writes one safetensors file, which from_pretrained opens"),
    Known("sac-context-fn",
          "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile",
          "torch._higher_order_ops.wrap", "torch/_higher_order_ops/wrap.py", ALL,
          "an advice printed for every selective-AC region; the recipes' regions "
          "have no in-place ops, and the compiled-against-eager parity tests "
          "(tests/test_correctness.py) hold with selective AC"),
    Known("dtensor-random-cpu-mesh",
          "may not have complete support on cpu device mesh",
          "warnings", "torch/distributed/tensor/_random.py", ("cpu",),
          "no recipe draws DTensor random numbers inside a step (no dropout); the "
          "initial weights come from torchtitan_neuron.seeded_init, per parameter",
          ("DTensor random operators may not have complete support on {device_mesh.",
           "DTensor manual_seed() may not have complete support ")),
    Known("cuda-graph-notice",
          "CUDA graph capture is only supported on NVIDIA CUDA; using eager execution",
          "", "torchtitan/distributed/cudagraph.py", ("cpu", "neuron"),
          "torchtitan's default (training.disable_cuda_graphs=False) asks for CUDA "
          "graphs; elsewhere it runs eagerly, as these platforms should. Setting "
          "disable_cuda_graphs instead is not equivalent: it also makes zero_grad "
          "free the gradients every step (set_to_none) where they are otherwise "
          "zeroed in place",
          ("CUDA graph capture is only supported on NVIDIA CUDA; ",
           "using eager execution.")),
    Known("cuda-home-without-runtime",
          "No CUDA runtime is found, using CUDA_HOME",
          "torch.utils.cpp_extension", "torch/utils/cpp_extension.py", ("cpu",),
          "inductor's C++ codegen imports cpp_extension, which finds a CUDA "
          "toolkit on the host; CPU kernels do not use it"),
)


class _Hide(logging.Filter):
    def __init__(self, texts: list[str]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


_hidden: list[Known] | None = None


def install(platform_name: str) -> list[Known]:
    """Hide the known warnings of ``platform_name`` in this process, once;
    returns what is hidden (nothing with ``TORCHTITAN_NEURON_SHOW_ALL_WARNINGS=1``)."""
    global _hidden
    if _hidden is not None:
        return _hidden
    _hidden = []
    if os.environ.get(SHOW_ALL_ENV) == "1":
        return _hidden
    _hidden = [k for k in KNOWN if platform_name in k.platforms]
    by_logger: dict[str, list[str]] = {}
    for known in _hidden:
        if known.source == "warnings":
            warnings.filterwarnings("ignore", message=".*" + re.escape(known.text))
        else:
            by_logger.setdefault(known.source, []).append(known.text)
    for name, texts in by_logger.items():
        logging.getLogger(name).addFilter(_Hide(texts))
    return _hidden


def describe(hidden: list[Known], platform_name: str) -> str | None:
    """The start-up line that says what was hidden."""
    if not hidden:
        return None
    return (f"{len(hidden)} known {platform_name} warnings hidden "
            f"({', '.join(k.name for k in hidden)}; see docs/upstream-workarounds.md); "
            f"{SHOW_ALL_ENV}=1 shows them")
