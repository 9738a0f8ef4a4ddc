"""Parse and validate a run's config once, in one process, before any rank starts.

``run_train.sh`` calls this first, so a bad flag or a refused setting (for
example ``--compile.mode aot_fx_trace`` on a SimpleFSDP recipe) is reported
once, clearly, with exit code 2, instead of by every rank inside torchrun.
"""

import sys


def main(argv: list[str] | None = None) -> None:
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    # tyro prints the error panel and exits with 2 on any parse/validation error.
    ConfigManager().parse_args(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
