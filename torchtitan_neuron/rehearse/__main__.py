"""``python -m torchtitan_neuron.rehearse``: the rehearsal's command line.

Exit codes: 0 ready, 1 not ready, 2 a recipe or layout error (as the
launcher's preflight reports it).
"""

import argparse
import json
import os
import sys

import torchtitan_neuron.rehearse as package

TARGETS = ("trn2", "trn3")


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_neuron.rehearse", description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
    )
    parser.add_argument("--module", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--ngpu", type=int, default=int(os.environ.get("NGPU", "1")))
    parser.add_argument("--target", default="trn2", choices=list(TARGETS))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts, overrides = parse(argv)
    # The device comes first, as on a Trainium host where TorchNeuron is
    # loaded with torch: torchtitan's import-time device detection then
    # finds ``neuron``.
    from torchtitan_neuron.rehearse import device

    device.setup(opts.target)

    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_neuron import platform
    from torchtitan_neuron.preflight import (
        PreflightError, check_layout, check_ngpu, check_recipe)
    from torchtitan_neuron.rehearse.core import rehearse

    init_logger()
    try:
        check_recipe(opts.module, opts.config)
        config = ConfigManager().parse_args(
            ["--module", opts.module, "--config", opts.config, *overrides])
        check_ngpu(opts.ngpu, "neuron", platform.device_count("neuron"))
        check_layout(config, opts.ngpu)
    except PreflightError as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        return 2
    report = rehearse(config, ngpu=opts.ngpu, target=opts.target, recipe=opts.config)
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
