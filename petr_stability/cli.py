"""The ``petr-stability`` command (``demo``, ``report``, ``patch-config``, ``check``) under the package's name.

The command itself is the top-level module :mod:`petr_stability_cli`, so that ``petr-stability --help`` and
``--version`` import neither torch nor a runner framework; importing this module imports the package, and with it
torch. ``python -m petr_stability`` and ``python -m petr_stability.cli`` run the same command.
"""
import sys

from petr_stability_cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
