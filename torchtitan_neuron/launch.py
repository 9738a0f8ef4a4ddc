"""torchrun, as ``run_train.sh`` uses it: a prompt Ctrl-C, and the root cause first.

``python -m torchtitan_neuron.launch [torchrun args] -m torchtitan_neuron.train ...``
runs ``torch.distributed.run`` in this process, with two differences a user
sees:

- Interrupted (SIGINT or SIGTERM): torchrun forwards the signal to every
  rank and waits for them; this module then exits at once with
  ``128 + signal`` and one line, instead of torchrun's traceback and its
  interpreter teardown.
- A rank fails: torchrun stops the others (SIGTERM) as soon as it sees the
  failure. This module prints the first failure (which rank, its exception
  and where it was raised) before torchrun's per-rank table, and exits 1.
  A rank killed by a signal leaves no error file: then the signal is named in
  words and that rank's last lines of output are printed, whatever
  ``--local-ranks-filter`` (``LOG_RANK``) hid. Every rank's output is kept in
  torchrun's log folder (``--log-dir``, or a fresh ``torchelastic_*`` folder
  in the temporary directory), whose path the failure message gives.
- ``--preflight`` (first, as ``run_train.sh`` passes it): the config checks
  of ``torchtitan_neuron.preflight`` run in their own process while this one
  loads torchrun, and no rank starts unless they pass; a failing check's
  message and exit code are the launch's.
- CPU ranks run on jemalloc when the host has it, keeping freed memory for
  the next step (``torchtitan_neuron.devices.cpu_allocator``).
- Several nodes: when the nodes do not all join torchrun's c10d rendezvous
  within ``join_timeout``, or the rendezvous endpoint cannot be reached, it
  says which, with the endpoint and what to check, and exits 1.
"""

import glob
import os
import signal
import sys
import tempfile

# What a signal that ended a rank usually means, in words.
SIGNAL_MEANINGS = {
    "SIGABRT": "the process aborted, usually a failed check or heap corruption "
               "inside the C++ runtime",
    "SIGSEGV": "the process read or wrote memory it does not own, a crash inside "
               "native code",
    "SIGBUS": "a memory access the hardware refused, often a file mapped into "
              "memory that shrank or a full /dev/shm",
    "SIGILL": "the CPU met an instruction it does not have: code built for another "
              "processor",
    "SIGFPE": "an arithmetic fault in native code, such as an integer division by zero",
    "SIGKILL": "killed from outside, most often by the kernel's out-of-memory killer "
               "(see dmesg) or a job scheduler",
    "SIGTERM": "asked to stop from outside, by a job scheduler or a user",
    "SIGINT": "interrupted (Ctrl-C)",
}
TAIL_LINES = 30


def root_cause(exc) -> str:
    """One line for the first failure of a ``ChildFailedError``."""
    import re

    rank, failure = exc.get_first_failure()
    message, where = failure.message, ""
    if isinstance(message, dict):  # an error file: {"message": ..., "extraInfo": ...}
        stack = str(message.get("extraInfo", {}).get("py_callstack", ""))
        frames = re.findall(r'File "([^"]+)", line (\d+)', stack)
        if frames:
            where = f" (raised at {frames[-1][0]}:{frames[-1][1]})"
        message = message.get("message", message)
    text = str(message).strip().splitlines()[0] if str(message).strip() else ""
    if not text or text.startswith("To enable traceback"):
        text = f"exit code {failure.exitcode}" + (
            f" ({failure.signal_name()})" if failure.exitcode < 0 else "")
    return f"rank {rank} failed first: {text}{where}"


def signal_words(name: str) -> str:
    """``SIGABRT: the process aborted, ...``: the signal and what it usually means."""
    meaning = SIGNAL_MEANINGS.get(name)
    return f"{name}: {meaning}" if meaning else name


def rank_log_tail(log_dir: str, local_rank: int, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of each of ``local_rank``'s output files in
    torchrun's ``log_dir`` (its newest attempt), each under a header with the
    file's path; empty when there are none."""
    attempts = sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*")),
                      key=os.path.getmtime)
    if not attempts:
        return ""
    parts = []
    for stream in ("stderr", "stdout"):
        path = os.path.join(attempts[-1], str(local_rank), f"{stream}.log")
        try:
            with open(path, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            continue
        if tail:
            parts.append(f"--- last {len(tail)} lines of {path}\n" + "\n".join(tail))
    return "\n".join(parts)


def signal_report(exc, log_dir: str) -> str:
    """For a first failure that was a signal: what the signal means, and the
    rank's last lines of output; empty otherwise."""
    rank, failure = exc.get_first_failure()
    if failure.exitcode >= 0:
        return ""
    name = failure.signal_name()
    tail = rank_log_tail(log_dir, failure.local_rank)
    return (f"rank {rank} (local rank {failure.local_rank}, PID {failure.pid}) was ended by "
            f"{signal_words(name)}. Every rank's output: {log_dir}\n"
            + (tail or f"(no output of local rank {failure.local_rank} in {log_dir})"))


def rendezvous_failure(args, exc) -> str:
    """One line for a rendezvous that did not complete."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
    timeout = conf.get("join_timeout", "600")
    nodes = args.nnodes
    where = f"the rendezvous at {args.rdzv_endpoint} (id {args.rdzv_id})"
    if isinstance(exc, RendezvousTimeoutError):
        return (
            f"NNODES={nodes}, but not every node joined {where} within "
            f"{timeout} s (RDZV_TIMEOUT). Start ./run_train.sh on each node with "
            "the same NNODES, RDZV_ENDPOINT and RDZV_ID, or raise RDZV_TIMEOUT."
        )
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = reason.rstrip(".")
    return (
        f"could not reach {where}: {reason}. Check that RDZV_ENDPOINT (or "
        "MASTER_ADDR:MASTER_PORT) names the first node and a port open between "
        "the nodes, and that the first node is running."
    )


def preflight_command(argv: list[str]) -> list[str]:
    """The preflight for a torchrun command line ``[torchrun args] -m
    torchtitan_neuron.train [training args]``: the same training arguments,
    with ``--nproc_per_node`` as the number of ranks."""
    ngpu = "1"
    for i, arg in enumerate(argv):
        if arg.startswith(("--nproc_per_node=", "--nproc-per-node=")):
            ngpu = arg.split("=", 1)[1]
        elif arg in ("--nproc_per_node", "--nproc-per-node") and i + 1 < len(argv):
            ngpu = argv[i + 1]
        elif arg == "-m":
            return [sys.executable, "-m", "torchtitan_neuron.preflight",
                    "--ngpu", ngpu, *argv[i + 2:]]
    raise SystemExit("torchtitan_neuron.launch --preflight: no '-m <module>' to check")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    preflight = None
    if argv[:1] == ["--preflight"]:
        import subprocess

        argv = argv[1:]
        # On two or more cores the checks and torchrun's own imports overlap.
        preflight = subprocess.Popen(preflight_command(argv))
    try:
        from torch.distributed import run

        code = preflight.wait() if preflight is not None else 0
    except KeyboardInterrupt:  # Ctrl-C reached both processes
        if preflight is not None:
            preflight.wait()
        code = 128 + signal.SIGINT
    if code:
        sys.stdout.flush()
        os._exit(code)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = run.parse_args(argv)
    if not args.log_dir:
        # torchrun's own default, made here so that a failure can name it.
        args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    try:
        _choose_cpu_allocator()
    except ValueError as exc:
        print(f"torchtitan_neuron.launch: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)
    try:
        run.run(args)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"torchtitan_neuron.launch: {name} received; every rank has stopped.",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + int(exc.sigval))
    except RendezvousError as exc:
        print(f"torchtitan_neuron.launch: {rendezvous_failure(args, exc)}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    except ChildFailedError as exc:
        report = signal_report(exc, args.log_dir)
        print(f"torchtitan_neuron.launch: {root_cause(exc)}\n"
              + (f"{report}\n" if report else "") + exc.format_msg(),
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _choose_cpu_allocator() -> None:
    """On a CPU host, the ranks' allocator (``cpu_allocator.rank_environment``)
    goes into the environment torchrun starts them with; ValueError names a
    bad ``TORCHTITAN_NEURON_CPU_ALLOCATOR``."""
    from torchtitan_neuron.devices import cpu_allocator
    from torchtitan_neuron.devices import detect

    if detect().name == "cpu":
        os.environ.update(cpu_allocator.rank_environment())


if __name__ == "__main__":
    main()
