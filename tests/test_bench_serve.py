"""``examples/bench_serve.py --arrivals poisson``, run as a user runs it (a subprocess that
starts its two servers): a couple of seconds of Poisson arrivals at one offered load write
a Markdown table with sane figures and a PNG. No timing is asserted."""

from __future__ import annotations

import math
import os
import subprocess
import sys

from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(text: str) -> dict:
    """The table's rows: mode -> the figures after it."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 9 and cells[1] in ("batching", "off"):
            rows[cells[1]] = [float(cells[0]), *map(float, cells[2:])]
    return rows


def test_poisson_mode_writes_a_table_and_a_picture(tmp_path):
    md, png = tmp_path / "serve.md", tmp_path / "serve.png"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "bench_serve.py"), "--arrivals", "poisson", "--rate", "4"]
    cmd += ["--duration", "2", "--rounds", "1", "--steps", "1", "--sizes", "32x32,48x48"]
    cmd += ["--out-md", str(md), "--out-png", str(png)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    text = md.read_text()
    assert "1-minute load average" in text and "--rate 4" in text
    rows = _rows(text)
    assert set(rows) == {"batching", "off"}, text
    for mode, (offered, images_s, cpu_ms, p50, p95, p99, answered, errors) in rows.items():
        assert all(math.isfinite(v) for v in (offered, images_s, cpu_ms, p50, p95, p99)), (mode, text)
        assert offered > 0 and images_s > 0 and cpu_ms > 0 and answered >= 1 and errors == 0, (mode, text)
        assert 0 < p50 <= p95 <= p99, (mode, text)
        assert answered == round(offered * 2), (mode, text)  # every arrival of the 2 s answered
    assert rows["batching"][0] == rows["off"][0]  # the same seeded arrivals for both
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (1000, 400)
