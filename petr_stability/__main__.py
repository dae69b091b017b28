"""``python -m petr_stability``: the ``petr-stability`` command without its console script."""
import sys

from .cli import main

__all__ = []

if __name__ == "__main__":
    sys.exit(main())
