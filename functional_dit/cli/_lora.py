"""``generate --lora PATH[:SCALE]`` and the ``lora`` field of a ``--prompts`` JSON line.

An adapter is named by its file (read with ``functional_dit.lora.load``) and a scale (1 by
default): ``PATH[:SCALE]`` on the command line (repeatable; every prompt), and in a JSON
line either such strings or ``{"path": ..., "scale": ...}`` objects (that request only; it
replaces the command line's). Both become the request's ``lora``: a list of
``{"path": str, "scale": float}`` (what the PNG metadata records). Each distinct file is
loaded once, onto the params' mesh, and the requests' lists go to ``fd.sample(...,
lora=...)`` as one list per prompt. docs/cli.md.
"""

from __future__ import annotations

import argparse
import math
import os

import functional_dit.lora as lora

from ._args import CLIError


def _parse(text: str) -> dict:
    """``PATH[:SCALE]`` -> ``{"path", "scale"}``: an existing file is a PATH whole; otherwise a
    tail after the last ``:`` is the SCALE and must be a number (ValueError naming it), unless
    it holds a path separator (then the whole text is a PATH, checked by `_checked`)."""
    path, sep, tail = text.rpartition(":")
    if os.path.isfile(text) or not sep or not path or os.sep in tail:
        return {"path": text, "scale": 1.0}
    try:
        return {"path": path, "scale": float(tail)}
    except ValueError:
        raise ValueError(f"expected a number after ':' (PATH:SCALE), got {tail!r} in {text!r}") from None


def _checked(entry: dict) -> dict:
    """``entry`` if its scale is finite and its path a file; ValueError with the reason."""
    if not math.isfinite(entry["scale"]):
        raise ValueError(f"expected a finite scale, got {entry['scale']!r} for {entry['path']}")
    if not os.path.isfile(entry["path"]):
        raise ValueError(f"{entry['path']} is not a file (expected a LoRA .safetensors file, PATH[:SCALE])")
    return entry


def spec(text: str) -> dict:
    """argparse type of ``--lora``: parsed here (a bad SCALE is argparse's one-line error),
    checked by `check`."""
    try:
        return _parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check(args) -> None:
    """``--lora``'s files exist and its scales are finite, before anything is loaded."""
    for entry in getattr(args, "lora", None) or ():
        try:
            _checked(entry)
        except ValueError as e:
            raise CLIError(f"--lora: {e}") from None


def field(value, where: str) -> list[dict]:
    """A JSON line's ``lora``: a list of "PATH[:SCALE]" strings or {"path", "scale"} objects."""
    if not isinstance(value, list):
        raise CLIError(
            f'--prompts: {where}: lora: expected a list of "PATH[:SCALE]" or {{"path", "scale"}}, got {value!r}'
        )
    out = []
    for item in value:
        try:
            if isinstance(item, str):
                out.append(_checked(_parse(item)))
            elif isinstance(item, dict) and set(item) <= {"path", "scale"} and isinstance(item.get("path"), str):
                scale = item.get("scale", 1.0)
                if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                    raise ValueError(f"expected a number as scale, got {scale!r}")
                out.append(_checked({"path": item["path"], "scale": float(scale)}))
            else:
                raise ValueError(f'expected "PATH[:SCALE]" or {{"path": ..., "scale": ...}}, got {item!r}')
        except ValueError as e:
            raise CLIError(f"--prompts: {where}: lora: {e}") from None
    return out


def load(params, lists) -> dict:
    """``{path: adapter}`` for every distinct path in ``lists`` (lists of ``{"path", "scale"}``),
    each read once with ``lora.load`` onto ``params``' mesh."""
    out = {}
    for entries in lists:
        for e in entries or ():
            if e["path"] not in out:
                try:
                    out[e["path"]] = lora.load(e["path"], params)
                except ValueError as err:
                    raise CLIError(f"--lora: {_naming(e['path'], str(err).splitlines()[0])}") from None
    return out


def _naming(path: str, message: str) -> str:
    """``message`` naming ``path`` once (the file readers' errors often start with it)."""
    return message if message.startswith(path) else f"{path}: {message}"


def argument(lists, adapters: dict):
    """``fd.sample``'s ``lora=``: one list of (adapter, scale) per prompt, None when none has any."""
    per_prompt = [[(adapters[e["path"]], e["scale"]) for e in entries or ()] for entries in lists]
    return per_prompt if any(per_prompt) else None
