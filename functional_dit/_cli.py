"""The command line: a small dispatcher over subcommands.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; `COMMANDS` maps its name to (module, one-line help). A new
command is one more entry here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "bench": ("functional_dit.bench", "speed and memory side by side with diffusers; writes BENCHMARKS.md"),
    "check": ("functional_dit.check", "hardware check: fd.apply on a device vs CPU eager at a tiny config"),
}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m functional_dit", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return top


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.argv = argv  # the exact command line, for reports
    sys.exit(importlib.import_module(args._module).run(args))
