"""Command-line errors that must come before anything heavy loads, as one line: a broken
or mismatched checkpoint, reference images, flags the model would ignore, the device;
Ctrl-C; errors under torchrun (once, from rank 0, status 2 on every rank)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import functional_dit as fd
import weights
from functional_dit.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = ["--height", "32", "--width", "32", "--steps", "1"]


def _pipeline_folder(path, pipeline: str, preset: str):
    """What generate reads before loading: model_index.json, vae/config.json and the
    transformer checkpoint (a real one); the encoders and VAE weights are never reached."""
    (path / "vae").mkdir(parents=True)
    (path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    vae = {"temperal_downsample": [False, True, True]} if "Qwen" in pipeline else {"block_out_channels": [8, 8, 8, 8]}
    (path / "vae" / "config.json").write_text(json.dumps(vae))
    weights.save(fd.init(preset, seed=0), path / "transformer")
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_errors")
    flux = _pipeline_folder(root / "flux", "FluxPipeline", "flux1-tiny")
    qwen = _pipeline_folder(root / "qwen", "QwenImagePipeline", "qwen-image-tiny")
    edit = _pipeline_folder(root / "edit", "QwenImageEditPipeline", "qwen-image-tiny")
    (root / "not.png").write_bytes(b"no image in here")
    truncated = root / "truncated.safetensors"
    data = open(os.path.join(flux, "transformer", "diffusion_pytorch_model.safetensors"), "rb").read()
    truncated.write_bytes(data[: len(data) // 2])
    return dict(root=str(root), flux=flux, qwen=qwen, edit=edit)


CASES = [  # (argv with {placeholders}, the line's expected text)
    (["--model", "{root}/truncated.safetensors", "--base", "{flux}"], "--model: {root}/truncated.safetensors"),
    (["--model", "{flux}", "--image", "{root}/not.png"], "--image: {root}/not.png is not an image PIL can read"),
    (["--model", "{flux}", "--image", "{flux}/model_index.json"], "is not an image PIL can read"),
    (["--model", "{qwen}/transformer", "--base", "{flux}"], "--base: a FluxPipeline runs a flux1 transformer, but"),
    (["--model", "{flux}", "--config", "qwen-image-tiny"], "--model: config: QwenImageConfig differs from"),
    (["--model", "{qwen}", "--guidance", "4"], "--guidance: this QwenImageConfig has no embedded guidance"),
    (["--model", "{flux}", "--negative-prompt", "blur"], "--negative-prompt: used only with classifier-free"),
    (["--model", "{edit}"], "--image: a QwenImageEditPipeline edits a reference image"),
    (["--model", "{flux}", "--device", "nonsense"], "--device: expected a device such as cpu, cuda"),
]
if not torch.cuda.is_available():
    CASES.append((["--model", "{flux}", "--device", "cuda"], "--device: cuda is not available here"))


@pytest.mark.parametrize("argv, match", CASES, ids=[c[1][:40] for c in CASES])
def test_generate_refuses_before_loading_anything(folders, tmp_path, capsys, monkeypatch, argv, match):
    import diffusers

    def heavy(*args, **kw):
        raise AssertionError("the pipeline was loaded before the error")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", heavy)
    monkeypatch.setattr(weights, "load", heavy)
    fill = lambda s: s.format(**folders)  # noqa: E731
    out = tmp_path / "x.png"
    code = main(["generate", *[fill(a) for a in argv], "--prompt", "a cube", *SIZE, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert fill(match) in err, err
    assert "Traceback" not in err and not out.exists()


def test_load_with_a_config_of_another_family_names_both(folders):
    with pytest.raises(ValueError, match=r"config: QwenImageConfig differs .* the family \(Flux1Config in the file\)"):
        weights.load(folders["flux"], config="qwen-image-tiny")


@pytest.mark.parametrize("device", ["nonsense", "cuda", "xla"])
def test_check_device_errors_are_one_line(capsys, device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    try:
        import torch_xla  # noqa: F401

        if device == "xla":
            pytest.skip("torch_xla is installed")
    except ImportError:
        pass
    assert main(["check", "--device", device]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --device: {device}" if device != "nonsense" else "error: --device: expected")
    assert "\n" not in err


def test_sample_qwen_edit_without_image_names_image():
    from functional_dit import tiny

    pipe = tiny.pipeline("qwen-image-edit")
    params = fd.from_diffusers(pipe.transformer)
    with pytest.raises(ValueError, match=r"^image: a QwenImageEditPipeline edits a reference image.*got None"):
        fd.sample(params, pipe, "a cube", height=32, width=32, steps=1, seed=0)


_INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, time
    import weights
    # An interactive shell's Ctrl-C: the parent (a pytest-xdist worker) may ignore SIGINT,
    # and an ignored signal stays ignored in its children.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    def inspect(*args, **kw):  # Ctrl-C while the checkpoint is being read
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    weights.inspect = inspect
    from functional_dit.__main__ import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_ctrl_c_prints_one_line_and_exits_130(folders, tmp_path):
    argv = ["generate", "--model", folders["flux"], "--prompt", "a", *SIZE, "--out", str(tmp_path / "x.png")]
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED, *argv], capture_output=True, text=True, env=env)
    assert done.returncode == 130 and done.stderr.strip() == "interrupted", (done.returncode, done.stderr[-2000:])


def test_torchrun_error_prints_once_and_every_rank_exits_2(folders, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    cmd += ["functional_dit", "generate", "--model", folders["flux"], "--prompt", "a", "--tp", "2"]
    cmd += ["--height", "40", "--width", "32", "--out", str(tmp_path / "x.png")]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300)
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert lines == ["error: --height: expected a multiple of 16 (VAE scale 8 x 2x2 packing), got 40"], done.stderr
    assert done.returncode != 0
    # torchrun's report: each rank exited with 2, or was ended by torchrun (SIGTERM) once another had
    codes = re.findall(r"exitcode\s*: (-?\d+)", done.stderr)
    assert codes and "2" in codes and set(codes) <= {"2", "-15"}, done.stderr[-3000:]
