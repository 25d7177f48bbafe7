"""What the commands print, as a new user reads it: every ``--help`` shows the defaults,
``generate`` says what ran (fp8 included) and draws its progress bar's last line once, and
the demo times its two columns the same way (each side after an untimed warm-up call)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time

import pytest
from tqdm import tqdm

from functional_dit.__main__ import main
from functional_dit.cli import COMMANDS, _progress, parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def _cli(*argv, cwd=ROOT, timeout=300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "functional_dit", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=ENV, timeout=timeout)


def _value_options(command: str) -> list[str]:
    """The command's optional flags that take a value (``--help`` must show their default)."""
    sub = next(a for a in parser()._actions if a.dest == "command").choices[command]
    return [a.option_strings[-1] for a in sub._actions if a.option_strings and a.nargs != 0 and not a.required]


def _help(command: str, capsys) -> str:
    """``python -m functional_dit COMMAND --help`` through the CLI's entry point, in process
    (each fresh process pays ~5 s of imports)."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_command_help_shows_the_defaults(capsys):
    """(The top-level ``--help`` from a shell: test_cli.py::test_help_lists_the_commands.)"""
    for command in COMMANDS:
        blocks = re.split(r"\n  (?=-)", _help(command, capsys).split("\noptions:\n", 1)[1])  # one per option
        for flag in _value_options(command):
            block = " ".join(next(b for b in blocks if re.match(rf"(-\w, )?{flag}\b", b)).split())
            assert "(default" in block or "default:" in block, (command, block)
    generate = " ".join(_help("generate", capsys).split())
    for flag, real, small in (("--height", 1024, 64), ("--width", 1024, 64), ("--steps", 28, 4)):
        assert (
            f"{flag} {flag[2:].upper()} " in generate and f"(default: {real}; {small} for a tiny pipeline)" in generate
        )


@pytest.mark.slow  # a subprocess: what a user sees
def test_generate_fp8_says_so_and_draws_the_last_bar_line_once(tmp_path):
    """A tiny model left at its own small default (64x64, 4 steps); the line says fp8 ran
    and that a CPU emulates it; stderr holds the progress bar alone, its 100% line once."""
    out = tmp_path / "fox.png"
    done = _cli("generate", "--model", "flux", "--prompt", "a fox", "--quantize", "fp8-row", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip()
    assert re.match(r"wrote .*fox\.png \(64x64, 4 steps, seed 0, fp8 compute fp8-row, emulated on the CPU: ", line)
    assert "slower than without --quantize" in line and out.stat().st_size > 0
    drawn = [s for s in re.split(r"[\r\n]+", done.stderr) if s.strip()]
    assert drawn and all(s.startswith("denoising:") for s in drawn), done.stderr[-3000:]
    assert sum("100%" in s for s in drawn) == 1, drawn


def test_advance_draws_the_final_line_once():
    """Slow steps (each past tqdm's redraw interval) into a file, as a log sees them: the
    last update and ``close()`` both drew the 100% line before."""
    file = io.StringIO()
    bar = tqdm(total=3, desc="denoising", file=file, mininterval=0)
    for _ in range(3):
        _progress.advance(bar)
    bar.close()
    lines = [s for s in re.split(r"[\r\n]+", file.getvalue()) if s.strip()]
    assert [s.split("|")[0].split()[-1] for s in lines] == ["0%", "33%", "67%", "100%"], lines


def test_demo_times_both_sides_after_a_warm_up(monkeypatch):
    """A first call that costs 100 s more (a clock jump, no sleep) on each side: neither
    column may hold it, as each side is timed after its own untimed warm-up call."""
    import diffusers

    import functional_dit as fd
    from functional_dit.cli import demo

    offset, calls = [0.0], []
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset[0])

    def first_call_costs(side, fn):
        def wrapped(*a, **kw):
            if side not in calls:
                offset[0] += 100.0
            calls.append(side)
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(fd, "sample", first_call_costs("ours", fd.sample))
    monkeypatch.setattr(diffusers.FluxPipeline, "__call__", first_call_costs("stock", diffusers.FluxPipeline.__call__))
    res = demo.run_row(demo.rows()[0], dict(size=32, steps=2, seed=0))
    assert calls == ["ours", "ours", "stock", "stock"] and res["diff"] == 0
    assert res["seconds"] < 100 and res["stock_seconds"] < 100, res
    assert "timed after an untimed warm-up call of the same side" in demo.timing_note(4)
