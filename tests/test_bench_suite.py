"""``python -m functional_dit bench --suite gpu --out FILE`` (functional_dit/cli/bench_suite.py):
run from a shell on the CPU's small shapes, every section is in the report (or skipped with a
reason), its ratios are numbers, and the command keeps to its budget; a budget too small for
any section still writes the report; a section that runs past its share is stopped."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
from _cli import one_line_error

from functional_dit.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
TITLES = {
    "forward": "## Forward, eager",
    "compiled": "## Forward, torch.compile",
    "fp8": "## fp8-row compute, compiled, vs bf16 compiled",
    "sample": "## Sampling: fd.sample vs the stock pipeline, without and with a step cache",
    "serve": "## Serving: the server's engine vs the stock pipeline one image at a time",
}
FAMILIES = ("flux1", "flux2", "qwenimage", "flux3", "qwenimage21")


def _sections(text: str) -> dict:
    """{heading line: the lines under it, up to the next heading}."""
    out, current = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


def _table(lines: list[str]) -> list[dict]:
    """The first Markdown table in ``lines`` as {header: cell} rows."""
    rows = [ln for ln in lines if ln.startswith("| ")]
    head = [c.strip() for c in rows[0].strip("|").split(" | ")]
    return [dict(zip(head, (c.strip() for c in r.strip("|").split(" | ")))) for r in rows[1:]]


def _check_section(lines: list[str]) -> list[dict]:
    """A section either says why it was skipped or has a table whose rows each have
    numeric ratios, or say why that row was skipped; no row failed."""
    text = "\n".join(lines)
    if "Skipped: " in text:
        assert re.search(r"Skipped: needs at least \d+ s, \d+ s left of its share\.", text), text
        return []
    rows = _table(lines)
    assert rows, text
    for row in rows:
        second = list(row.values())[1]
        assert not second.startswith("failed:"), row
        if second.startswith("skipped: "):
            assert re.match(r"skipped: needs ~\d+ s, \d+ s left", second), row
            continue
        ratios = {h: v for h, v in row.items() if h.startswith("ratio")}
        assert ratios and all(float(v) > 0 for v in ratios.values()), row
    return rows


@pytest.mark.slow
def test_suite_from_a_shell_on_the_cpu(tmp_path):
    out, budget = tmp_path / "suite.md", 120
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "functional_dit", "bench", "--suite", "gpu", "--budget", str(budget)]
    start = time.perf_counter()
    done = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=budget + 120)  # fmt: skip
    took = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert took < budget + 15, took  # the budget counts from the process's start; + the report and exit
    for name in TITLES:  # each section's progress, with the elapsed seconds
        assert re.search(rf"^\[ *\d+\.\d s\] {name}: (started|skipped)", done.stdout, re.M), done.stdout
    text = out.read_text()
    sections = _sections(text)
    assert set(TITLES.values()) <= set(sections), list(sections)
    rows = {name: _check_section(sections[title]) for name, title in TITLES.items()}
    assert [r["family"] for r in rows["forward"]] == list(FAMILIES)  # the first section has room on any load
    memory = _table(sections["## Peak memory and time per section"])
    assert [r["section"] for r in memory] == list(TITLES)
    assert all(r["peak GiB (`torch.cuda.max_memory_allocated`)"] == "n/a (no CUDA)" for r in memory)
    assert "**CPU run**" in text and "`--compile-backend none`" in text


def test_a_budget_too_small_skips_every_section_and_still_writes_the_report(tmp_path, capsys):
    out = tmp_path / "suite.md"
    start = time.perf_counter()
    assert main(["bench", "--suite", "gpu", "--device", "cpu", "--budget", "0.5", "--out", str(out)]) == 0
    assert time.perf_counter() - start < 30
    printed = capsys.readouterr().out
    sections = _sections(out.read_text())
    for name, title in TITLES.items():
        assert f"{name}: skipped (needs at least" in printed
        assert _check_section(sections[title]) == []


def test_a_section_past_its_share_is_stopped_with_its_rows_kept(monkeypatch):
    from functional_dit.cli import bench_suite

    def slow(p, window):
        yield {"family": "flux1", "ratio": 1.0}
        time.sleep(30)  # the alarm interrupts it
        yield {"family": "flux2", "ratio": 1.0}

    monkeypatch.setitem(bench_suite.SECTIONS, "forward", (slow, "Forward, eager"))
    p = bench_suite.plan("cpu", 60, list(FAMILIES))
    start = time.perf_counter()
    got = bench_suite.run_section("forward", p, bench_suite.Window(time.perf_counter() + 1.0), start)
    assert time.perf_counter() - start < 10
    assert [r["family"] for r in got["rows"]] == ["flux1"]
    assert got["stopped"] == "its share of the budget ran out after 1 row(s)"


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--budget", "0"], "error: --budget: expected a positive number of seconds, got 0.0"),
        (["--families", "flux9"], "error: --families: expected a subset of"),
        (["--cache", "fbcache:0.1", "magcache:0.1"], "error: --cache: the suite takes one step-cache spec, got 2"),
        (["--cache", "nonsense"], "error: --cache: expected one of"),
        (["--no-compile", "--compile-backend", "eager"], "error: --compile-backend: expected none with --no-compile"),
    ],
)
def test_bad_suite_flags_are_one_line_errors(argv, want, capsys):
    assert one_line_error(["bench", "--suite", "gpu", *argv], capsys).startswith(want)


@pytest.mark.slow  # ~9 s: eight diffusers classes built (on the meta device)
def test_the_gpu_plan_is_the_released_widths_at_reduced_depth_and_builds():
    """What a GPU runs, checked without one: the released presets' widths at the mid
    configs' depth, bf16, a 1024² image, 28 steps; each diffusers class builds from the
    config (on the meta device: no memory) and our params read its weights back whole."""
    import dataclasses

    import torch

    import functional_dit as fd
    from functional_dit.cli import _bench_cache, _suite_common, bench_suite
    from functional_dit.pipelines.families import product as product_of

    p = bench_suite.plan("cuda", None, list(FAMILIES))
    assert (p.dtype, p.hw, p.txt_len, p.steps, p.size, p.backend) == (
        torch.bfloat16,
        (64, 64),
        512,
        28,
        1024,
        "inductor",
    )
    assert p.compiled == FAMILIES and p.sample == ("flux1", "flux2", "qwenimage") and p.serve == "flux1"
    for key, config in p.configs.items():
        product = product_of(key)
        depth = {k: getattr(product.MID_CONFIG, k) for k in ("num_layers", "num_single_layers") if hasattr(config, k)}
        assert config == dataclasses.replace(fd.PRESETS[product.RELEASED], **depth)
        module, params = _suite_common.models(config, "meta", torch.bfloat16)
        assert params.config == config and {v.dtype for v in params.flat().values()} == {torch.bfloat16}
        assert params.flat().keys() == module.state_dict().keys()
    for key in p.sample:
        config = _bench_cache.bench_config(_bench_cache.runs()[key].kind, p.configs[key])
        assert config.num_attention_heads == p.configs[key].num_attention_heads
        assert _suite_common.models(config, "meta", torch.bfloat16)[1].config == config
