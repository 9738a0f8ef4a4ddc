"""Entry point: ``python -m torchtitan_neuron.train --module M --config C [overrides]``.

Installs the platform layer, then runs torchtitan's own ``torchtitan.train``
main with the same arguments. A config that cannot be parsed (an unknown
flag, a refused setting) is reported in one line with exit code 2.

Ctrl-C (SIGINT, which torchrun forwards to every rank) ends the rank at once
with exit code 130: the log is flushed, and the interpreter's teardown of the
compiled graphs and the process group, which takes seconds and holds nothing
the user needs, is skipped. The rank exits from the signal handler itself, not
through a ``KeyboardInterrupt`` that library code on the way up could catch
and drop; and where the main thread is held inside native code that does not
return to Python (a collective whose peer is still running), a watcher thread
woken by the signal ends the rank within ``INTERRUPT_GRACE_S``. A checkpoint being written when the signal comes
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
import signal
import sys
import threading
import time

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
# How long the watcher thread lets the main thread's handler act on Ctrl-C
# before ending the rank itself.
INTERRUPT_GRACE_S = 1.0

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


INTERRUPTED_MESSAGE = (
    "Interrupted (SIGINT): this rank stops now, without finishing the step. "
    "Checkpoints already written are complete; resume from the last one "
    "with --checkpoint.enable."
)


def _exit_interrupted() -> None:
    from torchtitan.tools.logging import logger

    logger.warning(INTERRUPTED_MESSAGE)
    _exit_now(INTERRUPTED_EXIT_CODE)


def _on_sigint(signum, frame) -> None:
    """The main thread's SIGINT handler: leave now, whatever was running."""
    _exit_interrupted()


def _watch_interrupts(read_fd: int) -> None:
    """Woken by the C-level signal handler through the wakeup fd, even while
    the main thread is inside native code; ends the rank if the main thread's
    handler has not within ``INTERRUPT_GRACE_S``."""
    while True:
        try:
            received = os.read(read_fd, 64)
        except OSError:
            return
        if signal.SIGINT in received:
            time.sleep(INTERRUPT_GRACE_S)
            # The main thread is held in native code and may hold the logging
            # lock, so the line is written to the file descriptor directly.
            os.write(2, f"{INTERRUPTED_MESSAGE} (main thread held in native "
                        "code; ended by the interrupt watcher)\n".encode())
            os._exit(INTERRUPTED_EXIT_CODE)


def install_interrupt_handler() -> None:
    """Ctrl-C ends this process at once with exit code 130 (main thread only)."""
    signal.signal(signal.SIGINT, _on_sigint)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:
        # Someone else reads the wakeup fd; keep theirs and rely on the
        # main-thread handler alone.
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    threading.Thread(target=_watch_interrupts, args=(read_fd,), daemon=True,
                     name="interrupt-watcher").start()


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
    install_interrupt_handler()

    from torchtitan_neuron import devices

    init_logger()  # so install()'s report is printed; torchtitan's main re-inits
    devices.install()

    import torchtitan.train

    try:
        torchtitan.train.main()
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
