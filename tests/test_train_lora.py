"""examples/train_lora.py, run as users run it, on a tiny image-caption folder.

- Bad arguments exit (argparse's code 2) naming the argument, the expected and the actual
  value, before anything is loaded (no output folder appears).
- Under ``torchrun --nproc-per-node 2 ... --fsdp 2`` (fp32, so the comparisons below are
  exact) with every optimisation and caption option on (`OPTIM`): the eval loss (fixed
  items, noise and times) decreases; the logged rates are the schedule's and the clipping
  bites; a run killed while saving the checkpoint of step 4 (its ``.tmp`` folder left
  half-written) and resumed with ``--resume`` from step 2 ends with the LoRA and EMA
  tensors and the loss log bitwise equal to the uninterrupted run's (2 gloo ranks,
  fsdp=2); one process gives the same (norms, losses 1e-5; files fp32 1e-5); the saved
  files (``run``, ``run/ema``) are loaded by a stock FluxPipeline through
  ``pipe.load_lora_weights(folder)`` and give what our merged LoRA gives (fp32 1e-5),
  which differs from the pipeline without it.
- FLUX.2-klein and Qwen-Image (``--pipeline tiny:<kind>``) in one process: the eval loss
  decreases and the stock Flux2KleinPipeline / QwenImagePipeline loads the file, as above.
- An earlier run in ``--output-dir``: a ``--steps`` below its checkpoint's step with
  ``--resume``, a rerun without ``--resume`` or ``--overwrite``, and both flags are refused in
  one line before the pipeline loads, nothing written; from a shell, the resumed step and
  the paths written go to stdout, DCP's one-process save and load print no warning,
  ``loss.png`` is drawn, ``--overwrite`` (``python -m functional_dit train``) starts over.
  ``--help`` shows every default; the CLI command's errors are its one line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest
import torch
from _dist import spawn
from _train_data import image_folder, one_thread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_lora.py")
FP32 = dict(rtol=1e-5, atol=1e-5)  # diffusers' PEFT layers vs our merged weights: fp32 sums in another order
ARGS = ["--resolution", "32", "--max-sequence-length", "64", "--rank", "2", "--alpha", "4", "--batch-size", "2"]
ARGS += ["--lr", "1e-2", "--checkpoint-every", "2", "--steps", "4", "--dtype", "float32", "--no-progress"]
OPTIM = ["--lr-scheduler", "cosine", "--warmup-steps", "1", "--grad-accum", "2", "--max-grad-norm", "0.05"]
OPTIM += ["--ema-decay", "0.5", "--lr", "2e-2", "--caption-dropout", "0.3", "--trigger", "sks"]  # folded in one run


def _script() -> dict:
    return runpy.run_path(SCRIPT, run_name="train_lora")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """Four 40x48 PNGs (cropped to 32x32 by the script) with captions."""
    folder = image_folder(
        tmp_path_factory.mktemp("images"),
        ("a red square", "a blue circle", "a green stripe", "a yellow dot"),
        hw=(40, 48),
    )
    (pathlib.Path(folder) / "notes.txt").write_text("a caption without an image is ignored")
    return folder


one_thread = pytest.fixture(one_thread)


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--resolution", "40"], "--resolution: expected a multiple of 16 (the VAE's 8 x FLUX's 2x2 packing), got 40"),
        (["--fsdp", "2"], "--fsdp x --tp: expected the world size 1 (WORLD_SIZE), got '2 x 1 = 2'"),
        (["--lr", "0"], "--lr: expected a positive float, got 0.0"),
        (["--bucket-step", "24"], "--bucket-step: expected a multiple of 16 (>= 16), got 24"),
        (["--max-aspect-ratio", "0.5"], "--max-aspect-ratio: expected a float >= 1, got 0.5"),
        (["--pipeline", "tiny:qwen-image-2.1", "--bucket-step", "16"], "--bucket-step: expected a multiple of 32 for"),
        (["--resume"], "--resume: expected a complete checkpoint in"),
        (["--pipeline", "/nowhere"], "--pipeline: expected one of ('tiny', 'tiny:flux', 'tiny:flux2-klein', "),
    ],
)
def test_bad_arguments_fail_before_loading(data, tmp_path, capsys, monkeypatch, bad, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        _script()["main"](["--data", data, "--output-dir", str(out), *bad])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_an_empty_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _script()["main"](["--data", str(tmp_path), "--output-dir", str(tmp_path / "run")])
    assert "--data: expected images (.png, .jpg, .jpeg, .webp) each with a same-name .txt caption" in (
        capsys.readouterr().err
    )


def _previous_run(out) -> dict:
    """A folder as a run to step 12 leaves it (what the checks read: names), and its
    listing with each file's mtime, to show that nothing was written."""
    ckpt = out / "checkpoints" / "step_00000012"
    ckpt.mkdir(parents=True)
    for f in (ckpt / ".metadata", out / "losses.jsonl", out / "pytorch_lora_weights.safetensors"):
        f.write_text("x")
    return _listing(out)


def _listing(folder) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def _error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if "error:" in ln]


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--resume", "--steps", "8"],
            "--steps: expected an int >= 12 (the step of {ckpt}, which --resume continues), got 8",
        ),
        (
            [],
            "--output-dir: expected a folder without a previous run, got '{out}' holding checkpoints, losses.jsonl, "
            "pytorch_lora_weights.safetensors: pass --resume to continue that run or --overwrite to start over",
        ),
        (["--resume", "--overwrite"], "--resume, --overwrite: expected one of them (one continues the run, the other "),
    ],
)
def test_a_previous_run_is_kept_unless_resumed_to_a_later_step_or_overwritten(
    data, tmp_path, capsys, monkeypatch, extra, message
):
    """A --steps below the checkpoint's step (the old script trained -4 steps and rewrote
    the LoRA file), a rerun into a run's folder without --resume or --overwrite (it
    overwrote the run), and both flags: one error line each, exit 2, before the pipeline
    loads (it raises here) and with nothing written."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    before = _previous_run(out)
    ns = _script()

    def not_loaded(path):
        raise AssertionError("the pipeline was loaded")

    monkeypatch.setattr("functional_dit.train._data.load_pipeline", not_loaded)
    with pytest.raises(SystemExit) as e:
        ns["main"](["--data", data, "--output-dir", str(out), *extra])
    err = capsys.readouterr().err
    want = message.format(ckpt=out / "checkpoints" / "step_00000012", out=out)
    lines = _error_lines(err)
    assert e.value.code == 2 and len(lines) == 1 and lines[0].split("error: ", 1)[1].startswith(want), err
    assert _listing(out) == before


@pytest.mark.parametrize("cli", [False, True])
def test_help_shows_every_default(capsys, monkeypatch, cli):
    """``--help`` gives each option's default (the old help gave none: --resolution's 512
    was nowhere), from the script and from ``python -m functional_dit train --help``."""
    from functional_dit.cli import main as cli_main

    monkeypatch.setenv("COLUMNS", "200")  # (no default wrapped across lines)
    ns = _script()
    with pytest.raises(SystemExit) as e:
        cli_main(["train", "--help"]) if cli else ns["main"](["--help"])
    text = capsys.readouterr().out
    assert e.value.code == 0 and "buckets of about this squared pixels; a multiple of 16 (default: 512)" in text
    shown = [a for a in ns["parser"]()._actions if a.option_strings and a.default is not argparse.SUPPRESS]
    for action in shown:  # (-h, --data, --output-dir: none)
        assert f"(default: {action.default})" in text, action.option_strings
    assert text.count("(default: ") == len(shown)  # each once, not twice


def _shell(data, out, *extra, cli: bool = False) -> subprocess.CompletedProcess:
    """``python examples/train_lora.py`` (``cli``: ``python -m functional_dit train``) in one
    process (no torchrun), as a user runs it."""
    cmd = [sys.executable, *(["-m", "functional_dit", "train"] if cli else [SCRIPT])]
    cmd += ["--data", data, "--output-dir", str(out), *ARGS, "--checkpoint-every", "1", *extra]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ", re.M)  # how Python prints a warning


def _ran(done, out, *lines) -> None:
    """Exit 0; stdout is the buckets and the cache lines, ``lines``, the two files written
    and the peak memory; no Python warning (the old script printed torch's "torch.distributed is
    disabled ..." at each DCP save / load)."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert PY_WARNING.search(done.stderr) is None and "torch.distributed is disabled" not in done.stderr, done.stderr
    start = [
        "buckets (height x width: images): 32x32: 4 (of 1 buckets of about 32^2 pixels",
        f"cache {out / 'cache'}: ",
    ]
    wrote = [f"wrote {out / 'pytorch_lora_weights.safetensors'}", f"wrote {out / 'eval.json'} (eval loss "]
    wrote += ["rank 0: peak memory "]
    got, want = done.stdout.splitlines(), [*start, *lines, *wrote]
    assert len(got) == len(want) and all(g.startswith(w) for g, w in zip(got, want)), done.stdout


@pytest.mark.slow
def test_one_process_from_a_shell_resumes_refuses_and_overwrites_saying_so(data, tmp_path):
    """Steps 0-1, resumed to 3 (stdout: the step and checkpoint resumed, the LoRA file and
    eval.json written; stderr: no warning from DCP's saves and load); then --steps 1, a
    rerun without --resume and --ema-decay on a checkpoint without an EMA are refused in
    one line before the pipeline loads (its "[transformers]" lines never appear) with
    nothing written; --steps 3 again has nothing to train and leaves the file; loss.png is
    drawn; --overwrite (``python -m functional_dit train``) starts over, the old
    checkpoints gone."""
    out = tmp_path / "run"
    _ran(_shell(data, out, "--steps", "2"), out)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the loss curve, drawn at each checkpoint
    _ran(
        _shell(data, out, "--steps", "3", "--resume"),
        out,
        f"resumed from step 2 ({out / 'checkpoints' / 'step_00000002'})",
    )
    assert json.loads((out / "eval.json").read_text())["steps"] == 1
    assert (out / "losses.jsonl").read_text().count("\n") == 3
    before = _listing(out)
    for extra, want in (
        (["--steps", "1", "--resume"], f"--steps: expected an int >= 3 (the step of {out / 'checkpoints'}"),
        (["--steps", "1"], "--output-dir: expected a folder without a previous run, got"),
        (["--steps", "3", "--resume", "--ema-decay", "0.9"], "--ema-decay: expected None: "),  # no EMA saved
    ):
        done = _shell(data, out, *extra)
        assert done.returncode == 2 and done.stdout == "" and "[transformers]" not in done.stderr, done.stderr
        assert [ln.split("error: ", 1)[1][: len(want)] for ln in _error_lines(done.stderr)] == [want], done.stderr
        assert _listing(out) == before
    done = _shell(data, out, "--steps", "3", "--resume")
    assert done.returncode == 0 and done.stdout.startswith("nothing to train: "), done.stdout + done.stderr
    assert _listing(out) == before
    overwrite = _shell(data, out, "--steps", "1", "--overwrite", cli=True)  # the same trainer as a CLI command
    _ran(overwrite, out, "--overwrite: removed the previous run's checkpoints")
    assert os.listdir(out / "checkpoints") == ["step_00000001"]
    assert (out / "losses.jsonl").read_text().count("\n") == 1


def _killed_then_resumed(rank, world, data, out):
    """Steps 0-3 with a kill while the checkpoint of step 4 is being written (after step
    2's is complete), then ``--resume``."""
    from functional_dit.train import _checkpoint

    ns = _script()
    save = _checkpoint.save_checkpoint

    class Killed(Exception):
        pass

    def dies_at_4(state, output_dir, step, rank, barrier):
        if step < 4:
            return save(state, output_dir, step, rank, barrier)
        if rank == 0:  # what a kill mid-save leaves: a partial .tmp folder, no step_4
            os.makedirs(os.path.join(output_dir, "checkpoints", f"step_{step:08d}.tmp"))
            open(os.path.join(output_dir, "checkpoints", f"step_{step:08d}.tmp", ".metadata"), "w").write("partial")
        raise Killed

    _checkpoint.save_checkpoint = dies_at_4  # (a rank's own process: nothing to restore)
    args = ["--data", data, "--output-dir", out, *ARGS, *OPTIM, "--fsdp", "2"]
    try:
        ns["main"](args)
    except Killed:
        pass
    _checkpoint.save_checkpoint = save
    return ns["main"]([*args, "--resume"])


@pytest.mark.slow
def test_torchrun_fsdp2_learns_resumes_bitwise_and_writes_a_file_diffusers_loads(
    data, tmp_path, one_thread, monkeypatch
):
    """Every optimisation and caption option on (`OPTIM`: cosine schedule with warmup, 2
    accumulated micro-batches, clipping that bites, EMA, caption dropout, a trigger), under
    torchrun on fsdp=2: it learns; killed
    and resumed it ends bitwise as the straight run (LoRA, EMA, log); it equals one process
    (the clipped norm computed over both ranks' shards: the logged norms to 1e-5, the LoRA
    to fp32 1e-5); both files load in the stock pipeline."""
    from safetensors.torch import load_file

    straight = str(tmp_path / "straight")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT]
    cmd += ["--data", data, "--output-dir", straight, *ARGS, *OPTIM, "--fsdp", "2"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ev = json.load(open(os.path.join(straight, "eval.json")))
    assert ev["eval_loss_after"] < 0.95 * ev["eval_loss_before"], ev  # seen: 2.543 -> 2.296 (EMA 2.372) in 4 steps
    assert sorted(os.listdir(os.path.join(straight, "checkpoints"))) == ["step_00000002", "step_00000004"]
    lines = [json.loads(ln) for ln in open(os.path.join(straight, "losses.jsonl"))]
    assert [ln["lr"] for ln in lines] == pytest.approx([0.0, 2e-2, 1.5e-2, 5e-3], abs=1e-12)  # warmup 1, cosine
    assert ev["eval_loss_after_ema"] < ev["eval_loss_before"], ev
    assert max(ln["grad_norm"] for ln in lines) > 0.05  # the clipping bites

    resumed = str(tmp_path / "resumed")
    results = spawn(_killed_then_resumed, 2, data, resumed, timeout=600)
    assert results[0]["start"] == 2  # from step 2's checkpoint; the partial step_4.tmp was not read
    logs = [open(os.path.join(d, "losses.jsonl")).read() for d in (straight, resumed)]
    assert logs[0] == logs[1] and logs[0].count("\n") == 4, logs
    for sub in ("", "ema"):
        a, b = (load_file(os.path.join(d, sub, "pytorch_lora_weights.safetensors")) for d in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one = str(tmp_path / "one")
    _script()["main"](["--data", data, "--output-dir", one, *ARGS, *OPTIM])
    for x, y in zip(lines, (json.loads(ln) for ln in open(os.path.join(one, "losses.jsonl"))), strict=True):
        assert x["lr"] == y["lr"] and x["loss"] == pytest.approx(y["loss"], rel=1e-5), (x, y)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), (x, y)
    for sub in ("", "ema"):
        a, b = (load_file(os.path.join(d, sub, "pytorch_lora_weights.safetensors")) for d in (straight, one))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], **FP32)

    _check_diffusers_loads(straight)
    _check_diffusers_loads(os.path.join(straight, "ema"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, max_len, extra",
    [
        ("flux2-klein", "64", ["--max-grad-norm", "1"]),
        ("qwen-image", "256", ["--max-grad-norm", "1", "--caption-dropout", "0.3", "--trigger", "sks"]),
    ],
)
def test_other_families_one_process_learn_and_write_a_file_diffusers_loads(
    data, tmp_path, one_thread, kind, max_len, extra
):
    """FLUX.2-klein and Qwen-Image (``--pipeline tiny:<kind>``), one process, in-process
    ``main`` (Qwen-Image's template needs >= 256 tokens to reach the caption), with
    clipping (the tiny Qwen-Image leaves a factor without a gradient) and, for
    Qwen-Image, caption dropout (the empty caption's embeddings padded and masked) and a
    trigger."""
    out = str(tmp_path / kind)
    args = ["--pipeline", f"tiny:{kind}", "--data", data, "--output-dir", out, *ARGS, "--max-sequence-length", max_len]
    args += extra
    got = _script()["main"](args)
    # seen: klein 1.893 -> 1.806, Qwen-Image (dropout, trigger) 2.474 -> 2.246 in 4 steps
    assert got["eval_loss_after"] < 0.98 * got["eval_loss_before"], got
    _check_diffusers_loads(out, kind, int(max_len))


def _latents(pipe, max_len: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    kw = dict(height=32, width=32, num_inference_steps=2, max_sequence_length=max_len, output_type="latent")
    return pipe(prompt="a red square", generator=gen, **kw).images


def _check_diffusers_loads(folder: str, kind: str = "flux", max_len: int = 64) -> None:
    import functional_dit as fd
    import functional_dit.lora as lora
    from functional_dit import tiny

    stock = tiny.pipeline(kind, seed=0)
    plain = _latents(stock, max_len)
    stock.load_lora_weights(folder)  # the user's call: diffusers + PEFT read our file
    theirs = _latents(stock, max_len)
    params = fd.from_diffusers(tiny.stock_transformer(kind, seed=0))
    merged = lora.merge(params, lora.load(folder, params))
    module = tiny.stock_transformer(kind, seed=0)
    module.load_state_dict(fd.to_state_dict(merged))
    ours = _latents(tiny.pipeline(kind, seed=0, transformer=module), max_len)
    torch.testing.assert_close(theirs, ours, **FP32)
    assert (theirs - plain).abs().max() > 1e-3  # the trained LoRA changes the output


def test_the_cli_command_checks_its_arguments_in_one_line(data, tmp_path, capsys, monkeypatch):
    """``python -m functional_dit train``: the trainer's checks as the CLI's one error line
    (exit 2), nothing written."""
    from _cli import one_line_error

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    err = one_line_error(["train", "--data", data, "--output-dir", str(out), "--resolution", "40"], capsys)
    assert err == "error: --resolution: expected a multiple of 16 (the VAE's 8 x FLUX's 2x2 packing), got 40"
    assert not out.exists()
