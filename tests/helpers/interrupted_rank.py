"""A rank's main thread where Ctrl-C cannot reach it through Python.

``python tests/helpers/interrupted_rank.py swallow|native``: installs the
training entry point's interrupt handling, prints ``ready``, then either
- ``swallow``: loops in code that catches and drops every exception, as
  library code on a rank's call stack may (a ``KeyboardInterrupt`` raised
  there would be lost), or
- ``native``: blocks in native code that never returns to Python (a second
  lock of a pthread mutex it already holds, with the GIL released), as a
  collective whose peer is still running does.
"""

import ctypes
import sys
import threading
import time

from torchtitan.tools.logging import init_logger

from torchtitan_neuron.train import install_interrupt_handler


def main() -> None:
    init_logger()
    install_interrupt_handler()
    if sys.argv[1] == "swallow":
        print("ready", flush=True)
        while True:
            try:
                time.sleep(0.01)
            except BaseException:  # noqa: BLE001 - the point of this helper
                pass
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # a default (non-recursive) mutex
    libc.pthread_mutex_lock(mutex)
    # "ready" once the main thread is inside the second lock.
    threading.Timer(0.5, print, ("ready",), {"flush": True}).start()
    libc.pthread_mutex_lock(mutex)  # never returns


if __name__ == "__main__":
    main()
