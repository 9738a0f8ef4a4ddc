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
"""

import os
import signal
import sys


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


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = run.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run.run(args)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"torchtitan_neuron.launch: {name} received; every rank has stopped.",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + int(exc.sigval))
    except ChildFailedError as exc:
        print(f"torchtitan_neuron.launch: {root_cause(exc)}\n{exc.format_msg()}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
