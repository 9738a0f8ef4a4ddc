"""``python -m torchtitan_neuron.plan``: the planner's command line."""

import gc

if __name__ == "__main__":
    # torchtitan's trainer turns automatic garbage collection off when it is
    # built; the planner's process turns it off from the start, so importing
    # torch and torchtitan (over a thousand collections) does not pay for it
    # either, and storages are freed at the same points in every plan.
    gc.disable()

import argparse
import json
import os
import sys

import torchtitan_neuron.plan as package
from torchtitan_neuron.plan.report import TARGETS, Plan
from torchtitan_neuron.tracing.cli import checked_config, recipe_parser
from torchtitan_neuron.tracing.world import DEFAULT_EP_IMBALANCE, EP_IMBALANCE_ENV


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = recipe_parser("python -m torchtitan_neuron.plan", package.__doc__, TARGETS)
    parser.add_argument("--capacity-gib", type=float, default=None,
                        help="device memory per rank, in place of the target's figure")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="also list the N largest groups of tensors live at the peak")
    parser.add_argument("--sweep", action="store_true",
                        help="also plan TP 1, 2, 4, 8 x selective/full AC at the same global batch "
                             "(an EP or CP degree given is held in every cell)")
    parser.add_argument("--every-block", action="store_true",
                        help="trace every transformer block, not two shallow copies of the model")
    parser.add_argument(
        "--ep-imbalance", type=float, default=None, metavar="F",
        help="under expert parallelism, size the token all-to-all for an EP rank that "
             "receives F times the mean routed tokens (default "
             f"{DEFAULT_EP_IMBALANCE}: the expert_imbalance the debug MoE recipes print)")
    # One of the two shallow traces (plan/depth.py), run in its own process.
    parser.add_argument("--layers-traced", type=int, default=0, help=argparse.SUPPRESS)
    # The rank traced, for the last pipeline stage's plan (last_stage_plan).
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_known_args(argv)


def last_stage_plan(opts, overrides: list[str], config):
    """Under pipeline parallelism rank 0 holds the first stage (the most
    microbatches in flight under 1F1B) and another rank the last (the
    logits and the loss): that rank's plan starts here in its own process,
    traced while this one traces rank 0. Returns (its rank, a function that
    waits for it: ``start_plan``'s), or None without stages."""
    from torchtitan_neuron.plan.sweep import plan_command, start_plan
    from torchtitan_neuron.tracing.world import last_stage_rank

    rank = last_stage_rank(config, opts.ngpu)
    if opts.rank is not None or rank == 0:
        return None
    extra = [f"--capacity-gib={opts.capacity_gib}"] if opts.capacity_gib is not None else []
    return rank, start_plan(plan_command(opts, "--json", f"--rank={rank}", *extra, *overrides))


def main(argv: list[str] | None = None) -> int:
    opts, overrides = parse(argv)

    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_neuron.plan import depth
    from torchtitan_neuron.plan.core import plan, segment_trace
    from torchtitan_neuron.plan.sweep import sweep
    from torchtitan_neuron.preflight import PreflightError

    init_logger()
    if opts.ep_imbalance is not None:
        if opts.ep_imbalance < 1.0:
            print(f"Error: --ep-imbalance {opts.ep_imbalance}: an EP rank receives at least "
                  "the mean routed tokens when they are spread evenly; use 1.0 (perfect "
                  "balance) or more", file=sys.stderr, flush=True)
            return 2
        # Read by the traces, the shallow ones in their own processes included.
        os.environ[EP_IMBALANCE_ENV] = str(opts.ep_imbalance)
    if opts.rank is not None:
        os.environ["RANK"] = str(opts.rank)
    try:
        config = checked_config(opts, overrides)
    except PreflightError as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        return 2
    if opts.layers_traced:
        head, layers, period = depth.truncate(config, opts.layers_traced)
        print(json.dumps(segment_trace(config, ngpu=opts.ngpu, target=opts.target,
                                       head=head, layers=layers, period=period)), flush=True)
        return 0
    result, why = None, depth.why_every_block(config, opts.every_block, max(opts.top, 0))
    if why is None:
        first, second = depth.traced_layers(config)
        logger.info(f"Planning the {depth.layer_run(config)[1]}-block model from traces of "
                    f"its first {first} and {second} blocks (--every-block traces all of them)")
        result, why = depth.shallow_plan(opts, overrides, config)
        if result is None:
            logger.warning(f"Tracing every block: {why}")
    if result is None:
        last_stage = last_stage_plan(opts, overrides, config)
        result = plan(config, ngpu=opts.ngpu, target=opts.target, recipe=opts.config,
                      top=max(opts.top, 0))
        if last_stage is not None:
            rank, wait = last_stage
            other, error = wait()
            if other is None:
                print(f"Error: the plan of rank {rank} (the last pipeline stage's) failed: "
                      f"{error}", file=sys.stderr, flush=True)
                return 1
            result = result.with_stage_rank(Plan.from_json(other), rank)
    if opts.capacity_gib is not None:
        result.capacity_gib = opts.capacity_gib
    if opts.json:
        print(json.dumps(result.to_json()), flush=True)
    else:
        logger.info("\n" + result.describe())
    if opts.sweep:
        print("\n".join(sweep(opts, overrides, result)), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Nothing is left to release: skip the teardown of the traced graphs and
    # FakeTensors, which takes seconds at 8B.
    os._exit(code)
