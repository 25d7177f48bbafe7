"""The trainer's optimisation options (`functional_dit.train`), in process on the tiny model:
the learning-rate schedules equal diffusers' ``get_scheduler`` float for float; a step with
``--grad-accum N`` equals one step on a batch N times larger (fp32, 1e-6 relative on the
LoRA); the global gradient norm and its clipping equal torch's ``clip_grad_norm_`` in one
process; the EMA is ``decay * ema + (1 - decay) * factors``. The logs: ``loss.png`` from
``losses.jsonl``; ``--report-to tensorboard`` refused without tensorboard, its events where
it is installed. Under fsdp=2 the same options equal one process and resume bitwise:
tests/test_train_lora.py (torchrun)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from functional_dit.train import _loop, _optim, _report, check_args


@pytest.mark.parametrize("schedule, warmup", [("constant", 0), ("constant", 3), ("linear", 3), ("cosine", 3)])
def test_schedules_are_diffusers_get_scheduler(schedule, warmup):
    from diffusers.optimization import get_scheduler

    total, base = 10, 3e-4
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    name = "constant_with_warmup" if schedule == "constant" and warmup else schedule
    theirs = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total):
        assert _optim.lr_at(step, base, schedule, warmup, total) == theirs.get_last_lr()[0], (step, schedule)
        opt.step()
        theirs.step()
    assert _optim.lr_at(0, base, schedule, warmup, total) == (0.0 if warmup else base)


def _grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in ((4, 8), (8,), (3, 5, 2))]


def test_global_norm_and_clipping_are_torchs_in_one_process():
    ours, theirs = _grads(0), _grads(0)
    norm = _optim.clip_([*ours, None], 1.5)  # (None: a factor the loss does not reach, as torch skips it)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in theirs]
    for p, g in zip(params, theirs):
        p.grad = g
    want = torch.nn.utils.clip_grad_norm_(params, 1.5)  # (scales theirs in place)
    assert norm == pytest.approx(float(want), rel=1e-6) and norm > 1.5
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    small = _grads(0)
    assert _optim.clip_(small, 1e6) == pytest.approx(norm) and all(torch.equal(a, b) for a, b in zip(small, _grads(0)))


def test_ema_is_the_decayed_average():
    import functional_dit as fd
    from functional_dit import lora, tiny

    params = fd.from_diffusers(tiny.stock_transformer("flux", seed=0))
    adapter = lora.init(params, rank=2, seed=0)
    ema = _optim.ema_init(adapter)
    moved = [x + 1 for x in adapter.leaves()]
    later = lora.Adapter(adapter.config, _tree_like(adapter, moved))
    _optim.ema_update_(ema, later, 0.75)
    for e, a in zip(ema.leaves(), adapter.leaves()):
        torch.testing.assert_close(e, a + 0.25, rtol=0, atol=1e-6)


def _tree_like(adapter, leaves):
    import sharding

    it = iter(leaves)
    return sharding.tree.map_tree(lambda _, v: next(it), adapter.tree)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """Four 32x40 PNGs with captions."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(1)
    for i, caption in enumerate(("a red square", "a blue circle", "a green stripe", "a yellow dot")):
        Image.fromarray((rng.random((32, 40, 3)) * 255).astype(np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(caption)
    return str(folder)


def _cat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


def test_grad_accum_equals_the_larger_batch(data, tmp_path, monkeypatch):
    """Step 0 with 4 items in one batch, and 2 x 2 and 4 x 1 accumulated (fp32): the same
    loss, the same summed gradients (5e-6 relative: fp32 sums over the items in another
    order; seen 6.5e-7) and the same LoRA after the AdamW step, 1e-6 relative over all its
    factors (seen 3.8e-8; element by element B's first step ``g / (|g| + eps)`` magnifies
    the gradients' rounding where they are near 0: seen 1.4e-5 of B's largest)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.set_num_threads(1)
    base = ["--data", data, "--output-dir", str(tmp_path / "run"), "--resolution", "32", "--rank", "2"]
    base += ["--max-sequence-length", "64", "--lr", "1e-2", "--dtype", "float32"]
    got = []
    for batch, accum in ((4, 1), (2, 2), (1, 4)):
        a = check_args([*base, "--batch-size", str(batch), "--grad-accum", str(accum)])
        r, _ = _loop.begin(a)
        line, _ = _loop.train_step(r, a, 0)
        leaves = list(r.adapter.leaves())
        got.append((line["loss"], _cat(x.grad for x in leaves), _cat(leaves)))
    (loss, grads, lora), *others = got
    assert grads.abs().max() > 0 and not torch.equal(lora, _cat(_loop.begin(a)[0].adapter.leaves()))  # it moved
    for other_loss, other_grads, other_lora in others:
        assert other_loss == pytest.approx(loss, rel=1e-6)
        assert (other_grads - grads).norm() <= 5e-6 * grads.norm()
        assert (other_lora - lora).norm() <= 1e-6 * lora.norm()


def test_loss_png_is_redrawn_from_the_log(tmp_path):
    """``loss.png`` from ``losses.jsonl`` (matplotlib, installed here): a PNG, replaced whole."""
    (tmp_path / "losses.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / (s + 1), "lr": 1e-4}) + "\n" for s in range(12))
    )
    path = _report.plot_losses(str(tmp_path))
    assert path == str(tmp_path / "loss.png") and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["loss.png", "losses.jsonl"]  # no temporary left


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_report_to_tensorboard_without_tensorboard_is_refused(data, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        check_args(["--data", data, "--output-dir", str(tmp_path / "run"), "--report-to", "tensorboard"])
    assert e.value.code == 2 and "--report-to: expected 'none' unless the tensorboard package is installed" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_report_to_tensorboard_writes_the_steps_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    a = argparse.Namespace(report_to="tensorboard", output_dir=str(tmp_path))
    writer = _report.tensorboard_writer(a, 0)
    for s in range(3):
        _report.tensorboard_line(writer, {"step": s, "loss": 2.0 - s, "lr": 1e-4, "grad_norm": 0.5})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [2.0, 1.0, 0.0]
    assert sorted(events.Tags()["scalars"]) == ["train/grad_norm", "train/loss", "train/lr"]
