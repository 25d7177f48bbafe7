"""``python -m functional_dit``: the demo (shortened) and ``generate`` on a tiny pipeline
folder saved to disk, its errors (one line, status 2, nothing written)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from _cli import one_line_error
from PIL import Image
from safetensors.torch import save_file

import functional_dit as fd
from functional_dit import tiny
from functional_dit.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    """A tiny FluxPipeline saved as a diffusers folder, and its stock image (seed 3)."""
    folder = str(tmp_path_factory.mktemp("tiny_flux"))
    pipe = tiny.pipeline("flux")
    pipe.save_pretrained(folder)
    stock = pipe("a cube", height=32, width=48, num_inference_steps=2, generator=torch.Generator().manual_seed(3))
    return folder, np.asarray(stock.images[0]), fd.from_diffusers(pipe.transformer)


GEN = ["--prompt", "a cube", "--height", "32", "--width", "48", "--steps", "2", "--seed", "3"]


def test_help_lists_the_commands():
    """Every command in the description and the list (each one's defaults: test_cli_output)."""
    from functional_dit.cli import COMMANDS

    out = subprocess.run([sys.executable, "-m", "functional_dit", "--help"], capture_output=True, text=True, cwd=ROOT)
    said = " ".join(out.stdout.split())
    assert out.returncode == 0 and "Commands: " + ", ".join(COMMANDS) + ";" in said, said
    assert all(f"{name} " in out.stdout for name in ("demo", "generate", "bench", "serve", "check"))
    assert "from a checkpoint" not in said and "an offline tiny pipeline by name" in said


def test_generate_pipeline_folder_writes_the_stock_image(flux_folder, tmp_path, capsys):
    folder, stock, _ = flux_folder
    out = tmp_path / "new" / "cube.png"
    assert main(["generate", "--model", folder, *GEN, "--out", str(out)]) == 0
    assert np.array_equal(np.asarray(Image.open(out)), stock)
    said = capsys.readouterr().out
    assert re.search(r"wrote .*cube\.png \(48x32, 2 steps, seed 3\).* s/step.*peak memory [\d.]+ GiB", said), said
    assert os.listdir(out.parent) == ["cube.png"]  # no temporary file left


def test_generate_transformer_file_with_base(flux_folder, tmp_path):
    folder, stock, params = flux_folder
    file = tmp_path / "transformer.safetensors"
    save_file(fd.to_state_dict(params), str(file))
    out = tmp_path / "cube.png"
    assert main(["generate", "--model", str(file), "--base", folder, *GEN, "--out", str(out)]) == 0
    assert np.array_equal(np.asarray(Image.open(out)), stock)


@pytest.mark.parametrize(
    "model, extra, match",
    [
        ("{tmp}/missing", [], "--model: {tmp}/missing does not exist"),
        ("{tmp}/empty", [], "--model: {tmp}/empty is not a checkpoint: no model_index.json"),
        ("{tmp}/w.bin", [], "--model: {tmp}/w.bin is not a checkpoint: expected a .safetensors file"),
        ("{tmp}/t.safetensors", [], "is a transformer file; add --base"),
        ("{folder}", ["--base", "{tmp}/empty"], "--base: {tmp}/empty is not a checkpoint: no model_index.json"),
        ("flux1-dev", [], "preset 'flux1-dev' has no weights on this machine"),
        ("flux1-tiny", [], "preset 'flux1-tiny' is a transformer shape without released weights"),
        ("no-such-model", [], "'no-such-model' is no file or folder, nor a model name"),
        ("{folder}", ["--height", "40"], "--height: expected a multiple of 16 (VAE scale 8 x 2x2 packing), got 40"),
        ("{folder}", ["--width", "8"], "--width: expected a multiple of 16"),
        ("{folder}", ["--tp", "2"], "--tp*--sp*--dp: expected 1 for a single process"),
        (
            "{folder}",
            ["--sp", "2", "--ring", "2"],
            "--tp*--sp*--dp*--ring: expected 1 for a single process (no torchrun), got 1*2*1*2 = 4",
        ),
        ("{folder}", ["--fsdp", "2"], "--tp*--sp*--dp*--fsdp: expected 1 for a single process (no torchrun), got "),
        ("{folder}", ["--fsdp", "2", "--quantize", "fp8-row"], "--quantize: fp8 compute (fp8-row) is not supported"),
        ("{folder}", ["--image", "{tmp}/nope.png"], "--image: {tmp}/nope.png does not exist"),
    ],
)
def test_generate_errors_are_one_line_and_write_nothing(
    flux_folder, tmp_path, capsys, monkeypatch, model, extra, match
):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    (tmp_path / "empty").mkdir()
    (tmp_path / "w.bin").write_bytes(b"")
    (tmp_path / "t.safetensors").write_bytes(b"")
    fill = lambda s: s.format(tmp=tmp_path, folder=flux_folder[0])  # noqa: E731
    out = tmp_path / "out" / "x.png"
    argv = ["generate", "--model", fill(model), *GEN, *[fill(a) for a in extra], "--out", str(out)]
    # argparse keeps an option's last value: extra --height/--width override GEN's
    assert fill(match) in one_line_error(argv, capsys)
    assert not (tmp_path / "out").exists()


def test_generate_refuses_an_output_that_is_not_an_image(flux_folder, tmp_path, capsys):
    err = one_line_error(["generate", "--model", flux_folder[0], *GEN, "--out", str(tmp_path / "x.txt")], capsys)
    assert "--out: expected an image file name ending in .png" in err


def test_generate_under_torchrun_tp2_writes_the_stock_image(flux_folder, tmp_path):
    """The offline tiny name (``--model flux``: built on every rank, then sharded) under
    torchrun; a checkpoint folder under torchrun: tests/test_generate_many.py."""
    _, stock, _ = flux_folder  # the stock image of the same tiny pipeline (seed 0)
    out = tmp_path / "cube.png"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "functional_dit", "generate", "--model", "flux", *GEN, "--tp", "2", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 only
    assert np.array_equal(np.asarray(Image.open(out)), stock)


def test_generate_under_torchrun_fsdp2_with_fsdp_encoders_writes_the_stock_image(flux_folder, tmp_path):
    """``--fsdp 2``: the transformer fully sharded over both ranks (each block gathered just in
    time) and ``--encoders fsdp``: the text encoders too; the image equals the stock one."""
    _, stock, _ = flux_folder
    out = tmp_path / "cube.png"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "functional_dit", "generate", "--model", "flux", *GEN, "--fsdp", "2", "--encoders", "fsdp"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 only
    assert np.array_equal(np.asarray(Image.open(out)), stock)


def test_demo_shortened_writes_pngs_a_table_and_nothing_else_on_stderr(tmp_path):
    """The FLUX.1 row, the inpainting row (FluxInpaintPipeline) and the FLUX.1 tp=2 run on
    2 spawned CPU ranks, as a user runs it (a fresh process: every notice a library prints
    once per process would show). stderr must be empty: no library notices, loading bars
    or stock progress bars (the full demo has a row per family; every family's fd.sample
    is checked against its stock pipeline in test_sample)."""
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "functional_dit", "demo", "--out", str(out), "--only", "flux1-dev", "flux1-inpaint"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([*cmd, "--steps", "2", "--size", "32"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    for name in ("flux1-dev", "flux1-inpaint", "flux1-dev-tp2", "contact_sheet"):
        path = out / f"{name}.png"
        assert path.stat().st_size > 0 and Image.open(path).size[0] >= 32
    table = done.stdout
    rows = [line for line in table.splitlines() if line.startswith(("FLUX", "Qwen"))]
    assert len(rows) == 3 and "FluxInpaintPipeline" in rows[1] and "FluxPipeline, tp=2 on 2 CPU ranks" in rows[2], table
    assert re.search(r"max \|latent diff\| vs stock\s+<= 1e-05\s+ours\s+stock", table), table
    assert "ours, stock: one call each, prompt to image" in table and "after an untimed warm-up call" in table
    for line in rows:
        cells = re.split(r"\s{2,}", line)
        assert cells[2] == "0 (bitwise)" or float(cells[2]) <= 1e-5, line  # fd.sample vs stock at the fp32 bound
        assert cells[3] == "pass" and re.fullmatch(r"[\d.]+ s", cells[4]) and re.fullmatch(r"[\d.]+ s", cells[5])
    # the tp row timed against one rank under the same conditions (1 thread, a fresh process)
    assert re.search(r"like against like .*: FLUX.1 on 1 rank [\d.]+ s, tp=2 on 2 ranks [\d.]+ s", table), table


def test_demo_bad_arguments(tmp_path, capsys):
    assert "--only: unknown rows ['nope']" in one_line_error(["demo", "--out", str(tmp_path), "--only", "nope"], capsys)
    assert "--size: expected a multiple of 16" in one_line_error(
        ["demo", "--out", str(tmp_path), "--size", "40"], capsys
    )
    assert "--ranks: expected 0" in one_line_error(["demo", "--out", str(tmp_path), "--ranks", "1"], capsys)


# ----------------------------------------------------------------------------- check, bench


def test_check_on_cpu_compiles_without_recompiling(capsys):
    """`check`'s compile mode, end to end, on FLUX.3 (``--only``): FLUX.1, FLUX.2 and
    Qwen-Image compile with fullgraph and take a new timestep without recompiling in
    test_compile.py::test_a_new_timestep_does_not_recompile, the same calls check makes."""
    code = main(["check", "--device", "cpu", "--backend", "aot_eager", "--only", "flux3"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line for line in out.splitlines() if line.endswith("fallbacks: none")]
    assert len(rows) == 1 and rows[0].startswith("flux3-tiny") and "recompiled on a new timestep: False" in rows[0], out


def test_bench_smoke_writes_the_report(tmp_path, capsys):
    out = tmp_path / "BENCHMARKS.md"
    args = ["bench", "--preset", "flux1-tiny", "--runs", "1", "--no-compile", "--no-tp", "--out", str(out)]
    assert main(args) == 0
    text = out.read_text()
    for want in ("- date:", "- machine:", "- command: `python -m functional_dit", "| flux1-tiny |", "GFLOP/s"):
        assert want in text, want
    assert "| flux1-tiny |" in capsys.readouterr().out


def test_unknown_bench_choices_are_refused(capsys):
    assert main(["bench", "--preset", "nope", "--no-compile", "--no-tp", "--out", ""]) == 2
    assert re.fullmatch(r"error: --preset: expected one of .*\n", capsys.readouterr().err)
    assert main(["bench", "--families", "flux9", "--no-compile", "--no-tp", "--out", ""]) == 2
    assert re.fullmatch(r"error: --families: expected a subset of .*\n", capsys.readouterr().err)


def test_check_eager_mode_runs_the_prepared_fast_path(capsys):
    assert main(["check", "--device", "cpu", "--mode", "eager"]) == 0
    out = capsys.readouterr().out
    tiny = [name for name in fd.PRESETS if name.endswith("-tiny")]  # every family, FLUX.3 and Qwen-Image 2.1 too
    assert "mode eager" in out and out.count(" ok ") == len(tiny) == 5, out
    rows = [line for line in out.splitlines() if line.endswith("fallbacks: none")]
    assert len(rows) == 5 and not any("recompiled" in r for r in rows), out  # nothing compiled: not asked
    assert len({r.index(" ok ") for r in rows}) == 1, out  # one column, sized from the longest name


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 10),
    reason="torch 2.9's inductor CPU code generator crashes with emulate_precision_casts",
)
def test_check_compiles_bf16_with_eager_rounding():
    """bf16 under inductor: with `check`'s precision-cast setting the compiled FLUX.1 equals
    eager (without it inductor keeps t in fp32 before ``* 1000`` and the timestep embedding
    moves: ~0.9 off at |y| ~ 3, diffusers' module alike)."""
    from functional_dit.cli import check

    # one block of each kind: the timestep embedding is before the blocks, and inductor's C++
    # build grows with the graph (80 s for the 2 + 2 blocks of flux1-tiny on 2 idle cores)
    config = dataclasses.replace(fd.PRESETS["flux1-tiny"], num_layers=1, num_single_layers=1)
    report = check.check_family("flux1-tiny", config, "cpu", torch.bfloat16, "compile", "inductor", 5e-2)
    assert report["ok"] and report["max_abs_err"] <= 2e-2, report


def test_bench_refuses_bad_token_counts(capsys):
    base = ["bench", "--families", "flux1", "--no-compile", "--no-tp", "--out", ""]
    assert main([*base, "--image-tokens", "1000"]) == 2
    assert "--image-tokens: expected a square number of latent tokens, got 1000" in capsys.readouterr().err
    assert main([*base, "--text-tokens", "0"]) == 2
    assert "--text-tokens: expected a positive number of text tokens, got 0" in capsys.readouterr().err


def test_bench_released_depth_keeps_the_mid_width():
    import argparse

    from functional_dit.cli import bench

    args = argparse.Namespace(preset=None, families="flux1,flux2,qwenimage,flux3,qwenimage21", depth="released")
    configs, mids = bench._configs(args), bench.mid_configs()
    assert (configs["flux1"].num_layers, configs["flux1"].num_single_layers) == (19, 38)
    assert (configs["flux2"].num_layers, configs["flux2"].num_single_layers) == (8, 48)
    assert configs["qwenimage"].num_layers == 60
    assert (configs["flux3"].num_layers, configs["flux3"].num_single_layers) == (5, 28)  # flux3-klein
    assert configs["qwenimage21"].num_layers == 32
    assert set(configs) == set(mids) and all(configs[n].inner_dim == mids[n].inner_dim for n in mids)
