"""Entry point: ``python -m torchtitan_neuron.train --module M --config C [overrides]``.

Installs the platform layer, then runs torchtitan's own ``torchtitan.train``
main with the same arguments. A config that cannot be parsed (an unknown
flag, a refused setting) is reported in one line with exit code 2.

Ctrl-C (SIGINT, which torchrun forwards to every rank) ends the rank at once
with exit code 130: the log is flushed, and the interpreter's teardown of the
compiled graphs and the process group, which takes seconds and holds nothing
the user needs, is skipped. A checkpoint being written when the signal comes
is never mistaken for a good one: checkpoints are written under a temporary
name and renamed when complete.
"""

import logging
import os
import sys

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def _exit_interrupted() -> None:
    from torchtitan.tools.logging import logger

    logger.warning(
        "Interrupted (SIGINT): this rank stops now, without finishing the step. "
        "Checkpoints already written are complete; resume from the last one "
        "with --checkpoint.enable."
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(INTERRUPTED_EXIT_CODE)


def main() -> None:
    from torchtitan.tools.logging import init_logger

    from torchtitan_neuron import platform

    init_logger()  # so install()'s report is printed; torchtitan's main re-inits
    platform.install()

    import torchtitan.train

    try:
        torchtitan.train.main()
    except KeyboardInterrupt:
        _exit_interrupted()


if __name__ == "__main__":
    sys.exit(main())
