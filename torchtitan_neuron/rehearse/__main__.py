"""``python -m torchtitan_neuron.rehearse``: the rehearsal's command line.

Exit codes: 0 ready, 1 not ready, 2 a recipe or layout error (as the
launcher's preflight reports it).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torchtitan_neuron.rehearse as package
from torchtitan_neuron.tracing.cli import checked_config, recipe_parser

TARGETS = ("trn2", "trn3")


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = recipe_parser("python -m torchtitan_neuron.rehearse", package.__doc__, TARGETS)
    parser.add_argument("--one-rank", action="store_true",
                        help="trace rank 0 alone, not the host's last rank beside it: "
                             "half the CPU, no count of the programs per host")
    return parser.parse_known_args(argv)


# Set in the process that traces the host's last rank, so it starts no other.
HOST_PEER_ENV = "TORCHTITAN_NEURON_REHEARSAL_PEER"


def start_host_peer(argv: list[str], rank: int) -> subprocess.Popen:
    """The same rehearsal as rank ``rank`` (the host's last), in a process of
    its own that runs beside this one; its report comes back as JSON. Its
    output goes to files: a pipe nobody reads until the end would fill and
    stall it."""
    env = dict(os.environ, RANK=str(rank), **{HOST_PEER_ENV: "1"})
    out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_neuron.rehearse", *argv, "--json"],
        env=env, stdout=out, stderr=err, text=True)
    proc.files = out, err
    return proc


def host_peer_report(proc: subprocess.Popen) -> dict:
    proc.wait()
    out, err = proc.files
    with out, err:
        out.seek(0)
        reports = [l for l in out.read().splitlines() if l.startswith("{")]
        if reports:
            return json.loads(reports[-1])
        err.seek(0)
        lines = [l for l in err.read().splitlines() if l.strip()]
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
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
    host_ranks = opts.ngpu // nodes
    # The host's last rank, traced beside rank 0: how many distinct programs
    # the host's ranks hand neuronx-cc.
    peer = (start_host_peer([a for a in argv if a != "--json"], host_ranks - 1)
            if host_ranks > 1 and not opts.one_rank and not os.environ.get(HOST_PEER_ENV)
            else None)
    report = rehearse(config, ngpu=opts.ngpu, target=opts.target, recipe=opts.config)
    report.host_ranks = host_ranks
    if peer is not None:
        report.add_host_peer(host_ranks - 1, host_peer_report(peer))
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
