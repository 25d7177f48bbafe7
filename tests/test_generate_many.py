"""``generate --prompts FILE --out-dir DIR``: the prompts file's errors (one line, nothing
written), and a torchrun ``--dp 2`` run killed midway and started again with the same
command: exactly one complete, correct PNG and one manifest line per request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _cli import one_line_error
from PIL import Image

import functional_dit as fd
from functional_dit import tiny
from functional_dit.cli import _many

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 10  # requests; on dp=2 five rounds of two images


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_flux_many"))
    tiny.pipeline("flux").save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "text, extra, match",
    [
        ('{"prompt": "a", "steps": 0}\n', [], "p.jsonl:1: steps: expected a positive int, got 0"),
        ('{"prompt": "a"}\n{"promt": "b"}\n', [], "p.jsonl:2: expected a JSON object with a 'prompt'"),
        ('{"prompt": "a", "cfg": 2}\n', [], "p.jsonl:1: unknown keys ['cfg']"),
        ('{"prompt": "a", "size": "64x40"}\n', [], "--height: expected a multiple of 16"),
        ('{"prompt": "a"\n', [], "p.jsonl:1, column 15: not JSON (Expecting ',' delimiter)"),
        ('{"prompt": "a"}\n  {"prompt": "b",, "seed": 1}\n', [], "p.jsonl:2, column 18: not JSON"),  # indented by 2
        ('{"prompt": "a", "guidance": NaN}\n', [], "guidance: expected a finite number >= 0 or null, got nan"),
        ('{"prompt": "a", "true_cfg": -2}\n', [], "true_cfg: expected a finite number >= 0 or null, got -2"),
        ("\n\n", [], "holds no prompts"),
        ("a\n", ["--out", "x.png"], "--out-dir: expected with --prompts"),
        ("a\n", ["--prompt", "b"], "--prompt, --prompts: expected exactly one"),
    ],
)
def test_prompts_file_errors_are_one_line(folder, tmp_path, capsys, text, extra, match):
    (tmp_path / "p.jsonl").write_text(text)
    argv = ["generate", "--model", folder, "--prompts", str(tmp_path / "p.jsonl"), *extra]
    argv += [] if "--out" in extra else ["--out-dir", str(tmp_path / "out")]
    assert match in one_line_error(argv, capsys)
    assert not (tmp_path / "out").exists()


def _requests_file(tmp_path) -> str:
    """Plain lines would do; JSON lines exercise the per-request fields."""
    rows = [{"prompt": f"a cube, number {i}"} for i in range(N)]
    rows[3] |= {"seed": 123, "size": "64x32", "steps": 3, "guidance": 5.0}
    rows[7] |= {"negative_prompt": "blurry", "true_cfg": 2.0}
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _command(folder, prompts, out_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "functional_dit", "generate", "--model", folder, "--prompts", prompts, "--out-dir", out_dir]
    return cmd + ["--height", "32", "--width", "32", "--steps", "8", "--seed", "40", "--dp", "2"]


def _pngs(out_dir) -> list[str]:
    return (
        sorted(n for n in os.listdir(out_dir) if n.endswith(".png") and not n.startswith("."))
        if os.path.isdir(out_dir)
        else []
    )


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its ranks in sessions of their own)."""
    children: dict = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def test_prompts_run_killed_and_resumed_gives_one_correct_image_per_request(folder, tmp_path):
    prompts, out_dir = _requests_file(tmp_path), str(tmp_path / "out")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = subprocess.Popen(_command(folder, prompts, out_dir), cwd=str(tmp_path), env=env, **quiet)
    deadline = time.monotonic() + 400
    while first.poll() is None and not _pngs(out_dir) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in [*_descendants(first.pid), first.pid]:  # both ranks and torchrun, mid-run
        os.kill(pid, signal.SIGKILL)
    first.wait()
    time.sleep(1)  # the kernel reaps the orphaned ranks
    done = _pngs(out_dir)
    assert 0 < len(done) < N, f"the kill came {'too late' if done else 'too early'}: {done}"
    # a damaged image (truncated) and a killed run's temporary file: both must be handled
    with open(os.path.join(out_dir, done[0]), "r+b") as f:
        f.truncate(200)
    open(os.path.join(out_dir, ".00009.partial-1.png"), "wb").close()

    second = subprocess.run(_command(folder, prompts, out_dir), cwd=str(tmp_path), env=env, capture_output=True,
                            text=True, timeout=400)  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"{N - len(done) + 1} images" in second.stdout, second.stdout  # the truncated one redone, the rest kept
    assert sorted(os.listdir(out_dir)) == sorted([f"{i:05d}.png" for i in range(N)] + [_many.MANIFEST])
    manifest = [json.loads(line) for line in open(os.path.join(out_dir, _many.MANIFEST))]
    assert [m["index"] for m in manifest] == list(range(N))
    _check_images(folder, prompts, out_dir, manifest)


def _check_images(folder, prompts, out_dir, manifest):
    """Each PNG carries its request and equals fd.sample for it in this process."""
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    params = fd.from_diffusers(pipe.transformer)
    for m in manifest:
        img = Image.open(os.path.join(out_dir, m["file"]))
        meta = json.loads(img.text[_many.META_KEY])
        assert dict(meta, file=m["file"]) == m and meta["model"] == folder
        assert meta["seed"] == (123 if m["index"] == 3 else 40 + m["index"])
        kw = {k: m[k] for k in ("height", "width", "steps", "guidance", "true_cfg", "negative_prompt")}
        want = fd.sample(params, pipe, m["prompt"], seed=m["seed"], batch_size=1, **kw)[0]
        # another process, other thread counts: the latents agree to ~1e-6, a pixel may round
        # to the next uint8 level
        diff = np.abs(np.asarray(img, dtype=int) - np.asarray(want, dtype=int))
        assert img.size == (m["width"], m["height"]) and diff.max() <= 1, m
