"""``bench`` writes a report only where it is told to: run from the repository root it
used to overwrite the committed BENCHMARKS.md."""

from __future__ import annotations

import os
import re

from functional_dit.__main__ import main


def test_bench_without_out_writes_no_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "BENCHMARKS.md").write_text("committed")
    assert main(["bench", "--preset", "flux1-tiny", "--runs", "1", "--no-compile", "--no-tp"]) == 0
    out = capsys.readouterr().out
    assert "| flux1-tiny |" in out and "no report written: pass --out FILE.md" in out
    # one table, no raw dict before it, and one peak figure (the table's), said what it is
    assert "{" not in out and out.count("GFLOP/s") == 1 and not re.search(r"matmul peak [\d.]+ GFLOP", out), out
    assert "FLOP/s vs peak: ours' model FLOP/s / the matmul peak (a 2048x2048x2048 GEMM timed in the same" in out
    assert os.listdir(tmp_path) == ["BENCHMARKS.md"] and (tmp_path / "BENCHMARKS.md").read_text() == "committed"
