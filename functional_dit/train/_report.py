"""The run's logs besides ``losses.jsonl``: a loss-curve PNG redrawn at each checkpoint
(when matplotlib is installed) and TensorBoard event files (``--report-to tensorboard``,
when tensorboard is installed)."""

from __future__ import annotations

import importlib.util
import json
import os

LOSS_PNG = "loss.png"
TENSORBOARD = "tensorboard"


def plot_losses(output_dir: str) -> str | None:
    """``output_dir/loss.png``: the loss (and its running mean over 10 steps) and the
    learning rate per step of ``losses.jsonl``, written whole then renamed over the old one;
    its path, or None without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    # optional: matplotlib, the plots only
    import matplotlib

    matplotlib.use("Agg")  # (files only, no display)
    # optional: matplotlib, the plots only
    from matplotlib.figure import Figure

    with open(os.path.join(output_dir, "losses.jsonl")) as f:
        lines = [json.loads(ln) for ln in f if ln.strip()]
    steps, losses = [ln["step"] for ln in lines], [ln["loss"] for ln in lines]
    mean = [sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="loss")
    ax.plot(steps, mean, lw=1.5, label="mean of 10 steps")
    ax.set(xlabel="step", ylabel="loss", title=f"{output_dir}: {len(lines)} steps")
    ax.legend(loc="upper left")
    ax.twinx().plot(steps, [ln["lr"] for ln in lines], color="gray", lw=1, ls="--")
    fig.axes[-1].set_ylabel("learning rate (dashed)")
    path = os.path.join(output_dir, LOSS_PNG)
    fig.savefig(path + ".tmp.png", dpi=100)
    os.replace(path + ".tmp.png", path)
    return path


def tensorboard_writer(a, start: int):
    """With ``--report-to tensorboard``: a ``SummaryWriter`` on ``output_dir/tensorboard``
    whose events from ``start`` on are purged (a resumed run rewrites them, as it does
    ``losses.jsonl``); else None."""
    if a.report_to != "tensorboard":
        return None
    # optional: tensorboard, --report-to tensorboard only
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(os.path.join(a.output_dir, TENSORBOARD), purge_step=start)


def tensorboard_line(writer, line: dict) -> None:
    """The step's scalars (loss, lr, grad_norm) as TensorBoard events."""
    for name in ("loss", "lr", "grad_norm"):
        if name in line:
            writer.add_scalar(f"train/{name}", line[name], line["step"])
