"""What the command-line tools that take a recipe share (the planner,
``python -m torchtitan_neuron.plan``, and the rehearsal,
``python -m torchtitan_neuron.rehearse``): the recipe arguments, and the
recipe parsed and checked as the launcher's preflight checks it."""

from __future__ import annotations

import argparse
import os


def recipe_parser(prog: str, description: str | None,
                  targets: tuple[str, ...]) -> argparse.ArgumentParser:
    """--module, --config, --ngpu (default $NGPU, else 1), --target, --json;
    every other argument is a torchtitan override (``parse_known_args``)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
    )
    parser.add_argument("--module", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--ngpu", type=int, default=int(os.environ.get("NGPU", "1")))
    parser.add_argument("--target", default=targets[0], choices=list(targets))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def checked_config(opts: argparse.Namespace, overrides: list[str]):
    """The recipe with ``overrides``, refused with a ``PreflightError`` (the
    launcher's message) when the module, the name or the layout is wrong."""
    from torchtitan.config import ConfigManager

    from torchtitan_neuron import devices
    from torchtitan_neuron.devices import known_warnings
    from torchtitan_neuron.preflight import check_layout, check_recipe

    known_warnings.install(devices.detect().name)
    check_recipe(opts.module, opts.config)
    config = ConfigManager().parse_args(
        ["--module", opts.module, "--config", opts.config, *overrides])
    check_layout(config, opts.ngpu)
    return config
