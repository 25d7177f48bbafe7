"""``generate --lora PATH[:SCALE]`` and the ``lora`` field of ``--prompts`` JSON lines.

The oracle is ``fd.sample`` with the adapters merged (`lora.merge`) into the same tiny
checkpoint: the written PNGs equal its images within one 8-bit level (the on-the-fly and
merged latents differ by fp32 rounding, ≤ 3e-6, which can move a pixel across a rounding
boundary), and differ from the image without the adapters. Run in-process
(``main([...])``) and once as ``python -m functional_dit``; bad values are one-line errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from _cli import one_line_error
from PIL import Image

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny
from functional_dit.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = ["--height", "32", "--width", "32", "--steps", "2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_lora")
    pipe = tiny.pipeline("flux")
    pipe.save_pretrained(str(tmp / "model"))
    params = fd.from_diffusers(pipe.transformer)
    a = lora.init(params, rank=4, seed=1, zero_b=False)
    b = lora.init(params, rank=2, targets=["attn.to_q", "ff.net.2", "proj_out"], seed=2, zero_b=False)
    lora.save(a, str(tmp / "a.safetensors"))
    lora.save(b, str(tmp / "b.safetensors"))
    return dict(tmp=tmp, pipe=pipe, params=params, a=a, b=b, model=str(tmp / "model"))


def _merged_image(s, pairs, prompt, seed):
    p = s["params"]
    for ad, scale in pairs:
        p = lora.merge(p, ad, scale)
    return np.asarray(fd.sample(p, s["pipe"], prompt, height=32, width=32, steps=2, seed=seed)[0], dtype=np.int16)


def _png(path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"), dtype=np.int16)


def _close(got, want, base):
    assert np.abs(got - want).max() <= 1  # the module docstring: one 8-bit level
    assert np.abs(got - base).max() > 2  # the adapters change the image (beyond the 1-level rounding)


def test_generate_lora_flags_equal_merged(setup):
    s, out = setup, str(setup["tmp"] / "one.png")
    a, b = str(s["tmp"] / "a.safetensors"), str(s["tmp"] / "b.safetensors")
    argv = ["generate", "--model", s["model"], "--prompt", "a cube", "--out", out, "--seed", "5", *SIZE]
    assert main(argv + ["--lora", f"{a}:0.7", "--lora", b]) == 0
    want = _merged_image(s, [(s["a"], 0.7), (s["b"], 1.0)], "a cube", 5)
    _close(_png(out), want, _merged_image(s, [], "a cube", 5))
    sub = str(s["tmp"] / "sub.png")  # the same command as a user runs it
    cmd = [sys.executable, "-m", "functional_dit", *argv[: -len(SIZE) - 4], "--out", sub, "--seed", "5", *SIZE]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd + ["--lora", f"{a}:0.7", "--lora", b], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(_png(sub), _png(out))


def test_prompts_file_lora_per_request(setup):
    s, tmp = setup, setup["tmp"]
    a, b = str(tmp / "a.safetensors"), str(tmp / "b.safetensors")
    rows = [
        {"prompt": "a red cube", "lora": [f"{a}:0.5"]},
        {"prompt": "a green ball", "lora": [{"path": b, "scale": 0.8}, a]},
        {"prompt": "a dog", "lora": []},
        {"prompt": "a cat"},  # the command line's --lora
    ]
    (tmp / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp / "many"
    argv = ["generate", "--model", s["model"], "--prompts", str(tmp / "p.jsonl"), "--out-dir", str(out), *SIZE]
    assert main(argv + ["--seed", "20", "--batch-size", "4", "--lora", f"{b}:0.3"]) == 0
    pairs = [[(s["a"], 0.5)], [(s["b"], 0.8), (s["a"], 1.0)], [], [(s["b"], 0.3)]]
    for i, (r, p) in enumerate(zip(rows, pairs)):
        got = _png(out / f"{i:05d}.png")
        want = _merged_image(s, p, r["prompt"], 20 + i)
        if p:
            _close(got, want, _merged_image(s, [], r["prompt"], 20 + i))
        else:
            assert np.abs(got - want).max() <= 1
    meta = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert meta[1]["lora"] == [{"path": b, "scale": 0.8}, {"path": a, "scale": 1.0}] and meta[2]["lora"] == []


def test_bad_lora_values_are_one_line_errors(setup, tmp_path, capsys):
    s = setup
    other = lora.init(fd.init(tiny.transformer_config("qwen-image"), seed=0), rank=2, seed=1)
    lora.save(other, str(tmp_path / "qwen.safetensors"))
    base = ["generate", "--model", s["model"], "--prompt", "a", "--out", str(tmp_path / "x.png"), *SIZE]
    missing = str(tmp_path / "nope.safetensors")
    assert "is not a file" in one_line_error(base + ["--lora", f"{missing}:0.5"], capsys)
    assert main(base + ["--lora", str(tmp_path / "qwen.safetensors")]) == 2  # read after the model: its config
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --lora: " + str(tmp_path / "qwen.safetensors") + ": lora: not a LoRA for this"), last
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "lora": "x.safetensors"}) + "\n")
    many = ["generate", "--model", s["model"], "--prompts", str(tmp_path / "p.jsonl"), "--out-dir", str(tmp_path / "o")]
    assert "p.jsonl:1: lora: expected a list" in one_line_error(many, capsys)
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "o").exists()


def test_lora_errors_name_the_bad_scale_and_the_path_once(setup, tmp_path, capsys):
    """``PATH:abc`` is a bad SCALE (not "is not a file"), refused by argparse before loading;
    a file that is no safetensors names its path once (the reader's message starts with it)."""
    a = str(setup["tmp"] / "a.safetensors")
    base = ["generate", "--model", setup["model"], "--prompt", "a", "--out", str(tmp_path / "x.png"), *SIZE]
    err = one_line_error(base + ["--lora", f"{a}:abc"], capsys)
    assert err == f"error: --lora: expected a number after ':' (PATH:SCALE), got 'abc' in '{a}:abc'", err
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "lora": [f"{a}:abc"]}) + "\n")
    many = ["generate", "--model", setup["model"], "--prompts", str(tmp_path / "p.jsonl"), "--out-dir", str(tmp_path)]
    assert "p.jsonl:1: lora: expected a number after ':' (PATH:SCALE), got 'abc'" in one_line_error(many, capsys)
    fox = tmp_path / "fox.png"
    Image.new("RGB", (8, 8)).save(fox)
    assert main(base + ["--lora", str(fox)]) == 2  # read after the model (its config)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: --lora: {fox}: corrupt header") and last.count(str(fox)) == 1, last
    assert not (tmp_path / "x.png").exists()
