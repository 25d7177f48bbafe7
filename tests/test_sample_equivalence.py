"""examples/sample_equivalence.py, the old-tree-against-new-tree tool, kept working: its
cases cover every tiny kind and job; a few of them (a CFG + LoRA run, the klein KV
cache with a step cache, Qwen-Image inpainting) written twice in one process compare
bitwise equal; and ``--compare`` from a shell reports a changed result and exits 1."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

from functional_dit import tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import sample_equivalence as eq  # noqa: E402

FAST = ["flux-cfg-lora", "flux2-klein-kv-cache", "qwen-image-inpaint-cfg"]


def test_the_cases_cover_every_tiny_kind_and_job():
    cases = eq.cases()
    kinds = {c.kind for c in cases}
    assert set(tiny.KINDS) <= kinds and set(eq.IMAGE_PIPELINES) <= kinds
    assert len(cases) >= 96 and sum(c.static for c in cases) >= 10
    for job in ("cfg", "generator", "lora-per-prompt", "callback", "latent", *(f"cache-{m}" for m in eq.CACHES)):
        assert sum(c.name.endswith(job) for c in cases) >= 5, job


def test_two_runs_of_a_few_cases_compare_bitwise_equal(tmp_path, capsys):
    for d in ("a", "b"):
        for name in FAST:
            assert eq.write(tmp_path / d, name) == 0
    assert sorted(p.stem for p in (tmp_path / "a").iterdir()) == sorted(FAST)
    assert eq.compare(tmp_path / "a", tmp_path / "b") == 0
    assert "3 of 3 cases bitwise equal, 0 differ" in capsys.readouterr().out


@pytest.mark.slow  # a subprocess importing the library: ~20 s on 2 busy cores
def test_compare_from_a_shell_reports_a_difference(tmp_path):
    x = torch.arange(6.0).reshape(2, 3)
    for d, result in (("a", x), ("b", x + torch.tensor([0, 0, 0.25]))):
        (tmp_path / d).mkdir()
        torch.save({"result": x}, tmp_path / d / "same.pt")
        torch.save({"result": result}, tmp_path / d / "moved.pt")
    torch.save({"error": "ValueError: bad"}, tmp_path / "b" / "broken.pt")
    argv = [sys.executable, "examples/sample_equivalence.py", "--compare", str(tmp_path / "a"), str(tmp_path / "b")]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert "same: equal" in lines and "moved: max abs difference 0.25" in lines
    assert "broken: missing in A" in lines and lines[-1] == "1 of 3 cases bitwise equal, 2 differ"
