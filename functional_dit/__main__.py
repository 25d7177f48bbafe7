"""``python -m functional_dit <command>``: see `functional_dit._cli` for the commands."""

from ._cli import main

if __name__ == "__main__":
    main()
