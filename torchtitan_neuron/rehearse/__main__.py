"""``python -m torchtitan_neuron.rehearse``: the rehearsal's command line.

Exit codes: 0 ready, 1 not ready, 2 a recipe or layout error (as the
launcher's preflight reports it).
"""

import argparse
import json
import os
import sys

import torchtitan_neuron.rehearse as package
from torchtitan_neuron.tracing.cli import checked_config, recipe_parser

TARGETS = ("trn2", "trn3")


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = recipe_parser("python -m torchtitan_neuron.rehearse", package.__doc__, TARGETS)
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts, overrides = parse(argv)
    # The device comes first, as on a Trainium host where TorchNeuron is
    # loaded with torch: torchtitan's import-time device detection then
    # finds ``neuron``.
    from torchtitan_neuron.tracing import neuron_device as device

    device.setup(opts.target)

    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_neuron import devices
    from torchtitan_neuron.preflight import PreflightError, check_ngpu
    from torchtitan_neuron.rehearse.core import rehearse

    init_logger()
    try:
        cores = devices.device_count(devices.NEURON.name)
        # Several nodes: --ngpu a multiple of a host's NeuronCores; this rank's
        # host holds one node's share of them.
        nodes = opts.ngpu // cores if opts.ngpu > cores and opts.ngpu % cores == 0 else 1
        check_ngpu(opts.ngpu // nodes, devices.NEURON.name, cores)
        config = checked_config(opts, overrides)
    except PreflightError as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        return 2
    report = rehearse(config, ngpu=opts.ngpu, target=opts.target, recipe=opts.config)
    if nodes > 1:
        report.notes["nodes"] = (f"{nodes}: rank 0's host is one of {nodes}, "
                                 f"with {opts.ngpu // nodes} of the {opts.ngpu} ranks")
    if opts.json:
        print(json.dumps(report.to_json()), flush=True)
    else:
        logger.info("\n" + report.describe())
    return 0 if report.ready else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the teardown of the traced graphs and FakeTensors (seconds at 8B).
    os._exit(code)
