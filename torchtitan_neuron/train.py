"""Entry point: ``python -m torchtitan_neuron.train --module M --config C [overrides]``.

Installs the platform layer, then runs torchtitan's own ``torchtitan.train``
main with the same arguments. A config that cannot be parsed (an unknown
flag, a refused setting) is reported in one line with exit code 2.
"""

import sys


def main() -> None:
    from torchtitan.tools.logging import init_logger

    from torchtitan_neuron import platform

    init_logger()  # so install()'s report is printed; torchtitan's main re-inits
    platform.install()

    import torchtitan.train

    torchtitan.train.main()


if __name__ == "__main__":
    sys.exit(main())
