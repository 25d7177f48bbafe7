"""``python -m functional_dit <command>``: see `functional_dit.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
