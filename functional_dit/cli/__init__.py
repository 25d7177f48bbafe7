"""``python -m functional_dit <command>``: a small dispatcher over subcommands.

`COMMANDS` names each command's module, which provides ``add_arguments(parser)`` and
``run(args) -> int``. Expected failures (bad arguments, missing files, a ``ValueError``
naming a refused value, and argparse's own errors, without its usage) print one line,
``error: ...``, and exit with status 2; Ctrl-C
prints ``interrupted`` and exits with status 130. Under torchrun only rank 0 prints, and
the other ranks give it time to (torchrun ends every rank once one has exited, and a
faster rank's exit could end rank 0 before its line is out).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import time

from ._args import CLIError

COMMANDS = {  # name -> (module with add_arguments / run, one-line help)
    "demo": (
        "functional_dit.cli.demo",
        "tiny offline models: one image per family with fd.sample, compared with diffusers",
    ),
    "generate": (
        "functional_dit.cli.generate",
        "images from a model: an offline tiny pipeline by name, a preset in the Hugging Face cache, a "
        "diffusers pipeline folder, or a transformer file + --base",
    ),
    "bench": ("functional_dit.cli.bench", "speed and memory side by side with diffusers; --out FILE writes a report"),
    "serve": (
        "functional_dit.cli.serve",
        "an OpenAI-compatible image server: continuous batching, a LoRA per request",
    ),
    "check": ("functional_dit.cli.check", "hardware check: fd.apply on a device vs CPU eager at a tiny config"),
    "train": ("functional_dit.train", "a LoRA fine-tune on an image-caption folder, fully sharded, resumable"),
}


class _Help(argparse.HelpFormatter):
    """Every option that takes a value shows its default, ``(default: X)`` (inside the help
    line's closing parenthesis, if it ends with one), unless the line already says it (a
    default that depends on the model or the machine is written there); an unset default
    (None, an empty list) reads ``none``. An option needs a help line to show one."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if not action.option_strings or action.nargs == 0 or action.required or action.default is argparse.SUPPRESS:
            return text
        if "(default" in text or "default:" in text:
            return text
        shown = "none" if action.default is None or action.default == [] else "%(default)s"
        return f"{text[:-1]}; default: {shown})" if text.endswith(")") else f"{text} (default: {shown})"


class _Parser(argparse.ArgumentParser):
    """argparse's errors as the commands' own: one line naming the flag, no usage
    (``--help`` shows it). Subcommand parsers are made of the same class."""

    def error(self, message: str):
        raise CLIError(re.sub(r"^argument (\S+?)(/\S+)?: ", r"\1: ", message))


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m functional_dit",
        description="FLUX.1, FLUX.2, FLUX.3, Qwen-Image and Qwen-Image 2.1 as pure functions. Commands: "
        + ", ".join(COMMANDS)
        + "; COMMAND --help for each one's flags and defaults.",
        formatter_class=_Help,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        description = getattr(module, "DESCRIPTION", help_text)
        command = sub.add_parser(name, help=help_text, description=description, formatter_class=_Help)
        command.set_defaults(_module=module_name)
        module.add_arguments(command)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser().parse_args(argv)
        args.argv = argv  # the exact command line, for reports (bench writes it)
        return importlib.import_module(args._module).run(args) or 0
    except (CLIError, ValueError) as e:
        _say(f"error: {e}")
        _let_rank0_report()
        return 2
    except KeyboardInterrupt:
        _say("interrupted")
        return 130


def _say(line: str) -> None:
    """One line on stderr, from rank 0 only under torchrun (every rank exits alike)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


REPORT_GRACE_S = 20.0  # how long a rank other than 0 waits, after an error, before it exits


def _let_rank0_report() -> None:
    """Under torchrun, a rank other than 0 waits before exiting: every rank meets the same
    error, rank 0 prints it and exits, and torchrun then ends this rank (SIGTERM)."""
    if os.environ.get("RANK", "0") != "0" and "LOCAL_RANK" in os.environ:
        time.sleep(REPORT_GRACE_S)


__all__ = ["COMMANDS", "CLIError", "main", "parser"]
