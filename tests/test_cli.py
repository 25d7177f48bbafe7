"""``python -m functional_dit``: the dispatcher, `check` on the CPU and a one-round `bench`
smoke run at a tiny preset (figures are not asserted: timings are the benchmark's job)."""

from __future__ import annotations

import pytest

from functional_dit import _cli


def test_check_on_cpu_passes_for_every_family(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["check", "--device", "cpu", "--backend", "aot_eager"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    for name in ("flux1-tiny", "flux2-tiny", "qwen-image-tiny"):
        assert f"{name}" in out and "recompiled on a new timestep: False" in out


def test_bench_smoke_writes_the_report(tmp_path, capsys):
    out = tmp_path / "BENCHMARKS.md"
    args = ["bench", "--preset", "flux1-tiny", "--runs", "1", "--no-compile", "--no-tp", "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        _cli.main(args)
    assert e.value.code == 0
    text = out.read_text()
    for want in ("- date:", "- machine:", "- command: `python -m functional_dit", "| flux1-tiny |", "GFLOP/s"):
        assert want in text, want
    assert "| flux1-tiny |" in capsys.readouterr().out


def test_unknown_choices_are_refused():
    with pytest.raises(ValueError, match="--preset: expected one of"):
        _cli.main(["bench", "--preset", "nope", "--no-compile", "--no-tp", "--out", ""])
    with pytest.raises(ValueError, match="--families: expected a subset of"):
        _cli.main(["bench", "--families", "flux3", "--no-compile", "--no-tp", "--out", ""])
