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

A rank that finishes (trainer closed: checkpoints, metrics and the process
group done) flushes its log and exits 0 the same way, skipping about two
seconds of teardown.

A rank that native code ends with a fatal signal (SIGABRT, SIGSEGV, SIGBUS,
SIGILL, SIGFPE) first writes the Python stack of every thread to stderr
(``faulthandler``), which ``torchtitan_neuron.launch`` prints with that rank's
last lines.

A rank whose collective fails because another rank died (gloo's "Connection
closed by peer") waits quietly for torchrun to stop it, so the first error a
user sees is the failing rank's own, which ``torchtitan_neuron.launch``
prints first.
"""

import logging
import os
import sys
import time

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# What a rank's collective reports when another rank has died under it.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited", "communicator was aborted")
# How long such a rank waits, silent, for torchrun to stop it.
PEER_FAILURE_GRACE_S = 10.0


def _peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer rank died: the
    symptom on this rank, not the cause."""
    import torch.distributed as dist

    if isinstance(exc, (dist.DistNetworkError,)):
        return True
    return any(text in str(exc) for text in _PEER_GONE)


def _exit_interrupted() -> None:
    from torchtitan.tools.logging import logger

    logger.warning(
        "Interrupted (SIGINT): this rank stops now, without finishing the step. "
        "Checkpoints already written are complete; resume from the last one "
        "with --checkpoint.enable."
    )
    _exit_now(INTERRUPTED_EXIT_CODE)


def _exit_now(code: int) -> None:
    """Flush the log and leave, skipping the interpreter's teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main() -> None:
    import faulthandler

    from torchtitan.tools.logging import init_logger

    faulthandler.enable(all_threads=True)

    from torchtitan_neuron import platform

    init_logger()  # so install()'s report is printed; torchtitan's main re-inits
    platform.install()

    import torchtitan.train

    try:
        torchtitan.train.main()
    except KeyboardInterrupt:
        _exit_interrupted()
    except Exception as exc:
        if "TORCHELASTIC_RUN_ID" in os.environ and _peer_failure(exc):
            # Another rank failed first. torchrun stops this one within a
            # second of seeing that; staying quiet until then keeps this
            # rank's secondary traceback from being printed before the root
            # cause (torchtitan_neuron.launch prints that first).
            time.sleep(PEER_FAILURE_GRACE_S)
        raise
    _exit_now(0)


if __name__ == "__main__":
    sys.exit(main())
