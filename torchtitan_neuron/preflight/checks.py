"""``python -m torchtitan_neuron.preflight``: every check, in one process,
before any rank starts.

``run_train.sh`` calls ``python -m torchtitan_neuron.preflight --ngpu N
--module M --config C [overrides]`` first, so every mistake below is reported
once, clearly, with exit code 2, instead of by every rank inside torchrun (or
as a hang):

- a recipe module that cannot be found (a short ``MODULE`` such as
  ``llama3`` with a SimpleFSDP recipe name: the message names the module that
  has the recipe), or that fails to import (its real error, which torchtitan
  0.3.0 turns into "Available config functions: []");
- a flag the config does not have, or a refused setting (``--compile.mode``
  other than ``jit`` on a SimpleFSDP recipe); tyro reports these;
- ``NGPU`` above the NeuronCores or GPUs present (the tutorial's hang); on
  CPU more ranks than cores run, with a one-line note;
- layout arithmetic that cannot work: a tensor-parallel degree that does not
  divide the model's query or KV heads, an expert-parallel degree that does
  not divide its experts (``model_layout``); parallel degrees that do not divide
  ``NGPU`` (torchtitan's own ``ParallelDims`` decides; its asserts are
  translated into the flags to change), a sequence length the tensor-parallel degree does not divide, a
  global batch that is not a multiple of local batch x data-parallel degree;
- tokenizer files that are not there;
- a dataset that cannot be read: a hub dataset (``c4``) with no network, a
  local folder that is missing, a JSON-lines file with a bad line or a line
  without a ``text`` field (named by file and line number).
"""

from __future__ import annotations

import argparse
import os
import sys

from torchtitan_neuron.preflight.data import check_dataset, check_endpoint, check_tokenizer
from torchtitan_neuron.preflight.errors import EXIT_USAGE, PreflightError
from torchtitan_neuron.preflight.hf_import import check_hf_import
from torchtitan_neuron.preflight.layout import check_layout, check_ngpu
from torchtitan_neuron.preflight.recipe import check_recipe

# torchtitan's --comm.mode values that run every rank in one process, on fake
# process groups (run_train.sh's COMM_MODE=fake_backend / local_tensor).
SIMULATED_COMM_MODES = ("fake_backend", "local_tensor")


def run_checks(argv: list[str], ngpu: int, nnodes: int = 1) -> list[str]:
    """Every check; returns notes to print. Raises PreflightError or exits
    with tyro's code 2 on a bad flag."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--module")
    parser.add_argument("--config")
    known, _ = parser.parse_known_args(argv)
    if known.module and known.config:
        check_recipe(known.module, known.config)

    from torchtitan.config import ConfigManager

    from torchtitan_neuron import devices

    if nnodes > 1:
        check_endpoint(os.environ.get("RDZV_ENDPOINT", ""))
    try:
        config = ConfigManager().parse_args(argv)
    except ValueError as exc:  # raised by the recipe's own function as it builds
        raise PreflightError(f"CONFIG={known.config} cannot be built: {exc}") from None
    notes = []
    if config.comm.mode in SIMULATED_COMM_MODES:
        # One process simulates the NGPU ranks: no device per rank is needed.
        check_ngpu(ngpu, "cpu", None, cpu_cores=ngpu)
    else:
        name = devices.detect().name
        note = check_ngpu(ngpu, name, devices.device_count(name))
        if note:
            notes.append(note)
    check_layout(config, ngpu, nnodes)
    if config.comm.mode not in SIMULATED_COMM_MODES and devices.detect().name == "cpu":
        from torchtitan_neuron.preflight.host_memory import check_host_memory

        refusal = check_host_memory(config, ngpu, known.module, known.config)
        if refusal:
            raise PreflightError(refusal)
    check_tokenizer(config)
    check_dataset(config)
    check_hf_import(config)
    return notes


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ngpu = os.environ.get("NGPU", "1")
    if argv[:1] == ["--ngpu"] and len(argv) > 1:
        ngpu, argv = argv[1], argv[2:]
    elif argv[:1] and argv[0].startswith("--ngpu="):
        ngpu, argv = argv[0].split("=", 1)[1], argv[1:]
    if not ngpu.isdigit():
        print(f"Error: NGPU={ngpu!r} is not a number of ranks; set NGPU to a "
              "whole number such as 2.", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    ngpu = int(ngpu)
    nnodes = os.environ.get("NNODES", "1") or "1"
    if not nnodes.isdigit() or int(nnodes) < 1:
        print(f"Error: NNODES={nnodes!r} is not a number of nodes; set NNODES to a "
              "whole number such as 2 (or leave it unset for one node).",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    nnodes = int(nnodes)

    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    from torchtitan_neuron import devices
    from torchtitan_neuron.devices import known_warnings

    known_warnings.install(devices.detect().name)
    try:
        notes = run_checks(argv, ngpu, nnodes)
    except PreflightError as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    for note in notes:
        logger.warning(note)
