"""A rank that dies of SIGABRT, as heap corruption in native code ends one.

``ABORT_RANK=<r>``: every rank prints a few numbered lines to stdout and
stderr; rank r then calls ``os.abort()`` (no Python exception, no error
file), and the other ranks wait to be stopped.
"""

import os
import sys
import time


def main() -> None:
    rank = int(os.environ["RANK"])
    for i in range(40):
        print(f"rank {rank} line {i}", flush=True)
        print(f"rank {rank} err {i}", file=sys.stderr, flush=True)
    if rank == int(os.environ["ABORT_RANK"]):
        os.abort()
    time.sleep(120)


if __name__ == "__main__":
    main()
