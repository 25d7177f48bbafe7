"""``python -m functional_dit <command>``: a small dispatcher over subcommands.

Each command group lives in its own module and registers its subparsers through
``add_commands(subparsers)``, setting ``run`` (a function of the parsed arguments that
returns an exit status). Expected failures (bad arguments, missing files, a ``ValueError``
naming a refused value) print one line, ``error: ...``, and exit with status 2; Ctrl-C
prints ``interrupted`` and exits with status 130. Under torchrun only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import cli as _cli


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m functional_dit",
        description="FLUX.1, FLUX.2 and Qwen-Image as pure functions: demo, generation.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _cli.add_commands(sub)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.argv = argv  # the exact command line, for reports (bench writes it)
    try:
        return args.run(args) or 0
    except (_cli.CLIError, ValueError) as e:
        _say(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        _say("interrupted")
        return 130


def _say(line: str) -> None:
    """One line on stderr, from rank 0 only under torchrun (every rank exits alike)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
