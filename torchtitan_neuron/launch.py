"""torchrun, as ``run_train.sh`` uses it, with a prompt and quiet Ctrl-C.

``python -m torchtitan_neuron.launch [torchrun args] -m torchtitan_neuron.train ...``
runs ``torch.distributed.run`` in this process. When the launcher is
interrupted (SIGINT or SIGTERM), torchrun forwards the signal to every rank and
waits for them; this module then exits at once with ``128 + signal`` and one
line, instead of torchrun's traceback and its interpreter teardown.
"""

import os
import signal
import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run.main(sys.argv[1:] if argv is None else argv)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"torchtitan_neuron.launch: {name} received; every rank has stopped.",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + int(exc.sigval))


if __name__ == "__main__":
    main()
