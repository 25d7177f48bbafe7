"""``python -m functional_dit demo``: the project's main job on its embedded default.

Builds the tiny offline model set (`functional_dit.pipelines.tiny`: random weights, byte-level
tokenizers, no network), generates one image per family with `fd.sample`, runs the stock
diffusers pipeline with the stock transformer at the same seed and reports the largest
latent difference, then runs FLUX.1 again on local CPU ranks with tp=2 (processes
spawned here, gloo). Writes one PNG per row and a contact sheet to the output folder
and prints a table: family, pipeline, max latent difference vs stock against `TOLERANCE`,
the time of our call and of the stock one (each after an untimed warm-up call: `_timed`),
file. Exit status 1 if a row is over it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw

import functional_dit as fd
import sharding

from .. import families
from ..pipelines.cache import label
from . import _cache_report, _models, _quiet
from ._args import CLIError, positive
from ._bench_cache import diffusers_config

PROMPT = "a red fox sitting in fresh snow, soft morning light, detailed fur"
NEGATIVE = "blurry, low quality"
# The bound every row's max |latent difference| vs the stock pipeline must meet: the
# project's fp32 parity bound (the FLUX rows are bitwise; Qwen-Image and the tp row differ
# from stock by fp32 rounding, a few 1e-6 at the demo's sizes: docs/status.md#the-demo).
TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # also the PNG's name
    kind: str  # functional_dit.pipelines.tiny kind (the stock pipeline class)
    ours: dict  # fd.sample keyword arguments beyond prompt, size, steps, seed
    stock: dict  # the same for the stock pipeline call
    cache: str | None = None  # a step cache (fd.sample's cache=; diffusers' same on the stock side)
    stock_class: str | None = None  # another stock pipeline over the tiny kind's components

    @property
    def family(self) -> str:
        """The family's name (the registry's) of the transformer this row's pipeline runs."""
        return families.TINY_KINDS[self.kind][0].NAME


def reference_image(size: int = 96) -> Image.Image:
    """A deterministic reference picture for the editing rows: a disc on a gradient."""
    y, x = np.mgrid[0:size, 0:size] / size
    img = np.stack([x, y, 1 - x], -1)
    img[(x - 0.5) ** 2 + (y - 0.55) ** 2 < 0.08] = (0.95, 0.45, 0.1)
    return Image.fromarray((img * 255).astype("uint8"))


def inpaint_mask(size: int = 96) -> Image.Image:
    """The inpainting row's mask: white (repaint) over the disc's upper half."""
    m = np.zeros((size, size), "uint8")
    m[size // 5 : size // 2, size // 4 : 3 * size // 4] = 255
    return Image.fromarray(m)


def rows() -> list[Row]:
    ref = reference_image()
    inpaint = dict(image=ref, mask_image=inpaint_mask(), strength=0.8)
    cfg = dict(true_cfg=4.0, negative_prompt=NEGATIVE)
    return [
        Row("flux1-dev", "flux", dict(guidance=3.5), dict(guidance_scale=3.5)),
        Row(
            "flux1-inpaint",
            "flux",
            dict(inpaint, guidance=3.5),
            dict(inpaint, guidance_scale=3.5),
            stock_class="FluxInpaintPipeline",
        ),
        Row("flux2-dev", "flux2", dict(guidance=4.0), dict(guidance_scale=4.0)),
        Row("flux2-klein-kv", "flux2-klein-kv", dict(image=ref), dict(image=ref)),
        Row("qwen-image", "qwen-image", cfg, dict(true_cfg_scale=4.0, negative_prompt=NEGATIVE)),
        Row(
            "qwen-image-fbcache",
            "qwen-image",
            cfg,
            dict(true_cfg_scale=4.0, negative_prompt=NEGATIVE),
            cache="fbcache:1.1",  # random tiny weights: their first-block changes are 1.06-2.1
        ),
        Row("qwen-image-edit", "qwen-image-edit", dict(image=ref), dict(image=ref, true_cfg_scale=1.0)),
    ]


def _stock_latents(pipe, seed: int, **kw) -> torch.Tensor:
    """The stock pipeline's packed latents after its last step (the call decodes its image,
    as ``fd.sample`` does: both sides are timed prompt to image)."""
    got = {}

    def grab(_pipe, _i, _t, tensors):
        got["latents"] = tensors["latents"]
        return {}

    pipe(**kw, generator=torch.Generator().manual_seed(seed), callback_on_step_end=grab)
    return got["latents"]


def _ours(params, pipe, row: Row, args, cache=None):
    """fd.sample's image and its final latents."""
    got = {}
    image = fd.sample(
        params,
        pipe,
        PROMPT,
        height=args["size"],
        width=args["size"],
        steps=args["steps"],
        seed=args["seed"],
        callback=lambda i, x: got.update(latents=x),
        cache=cache,
        **row.ours,
    )[0]
    return image, got["latents"]


WARMUP_STEPS = 2  # each side's untimed first call (img2img's strength 0.8 still runs a step of 2)


def _timed(call, warm):
    """``(call(), its wall time in s)``, ``warm()`` run first and untimed: a first call pays
    one-off costs (lazy set-up, allocator growth, kernel choices) that would otherwise land
    on whichever side runs first, so both sides of a row are timed this way."""
    warm()
    start = time.perf_counter()
    out = call()
    return out, time.perf_counter() - start


def _warm(args: dict) -> dict:
    """The demo's arguments for a warm-up call: at most `WARMUP_STEPS` steps."""
    return dict(args, steps=min(args["steps"], WARMUP_STEPS))


def _pipeline(row: Row):
    """The row's tiny pipeline, as the command line names it (`_models.tiny_pipeline`)."""
    return _models.tiny_pipeline(_models.PREFIX + row.kind, pipeline_class=row.stock_class)


def run_row(row: Row, args: dict) -> dict:
    """One row: fd.sample and the stock pipeline at the same seed, each timed after its
    warm-up (`_timed`), and the largest latent difference."""
    pipe = _pipeline(row)
    params = fd.from_diffusers(pipe.transformer)
    run = None if row.cache is None else fd.CacheRun(row.cache)
    (image, latents), seconds = _timed(
        lambda: _ours(params, pipe, row, args, run), lambda: _ours(params, pipe, row, _warm(args))
    )
    name = type(pipe).__name__
    if run is not None:
        name += f" + {label(run.config)}: {_cache_report.line([run], params.config)}"
    stock, stock_seconds = _timed(*_stock_calls(pipe, row, args, run))
    diff = (latents - stock).abs().max().item()
    return dict(image=image, diff=diff, seconds=seconds, stock_seconds=stock_seconds, pipeline=name, latents=latents)


def _stock_calls(pipe, row: Row, args: dict, run=None):
    """(the stock call, its warm-up) for `_timed`; with a step cache, diffusers' same cache
    goes on the stock transformer after the warm-up (which runs without, as ours does)."""

    def call(steps):
        size = dict(height=args["size"], width=args["size"], num_inference_steps=steps)
        return _stock_latents(pipe, args["seed"], prompt=PROMPT, **size, **row.stock)

    def warm():
        call(_warm(args)["steps"])
        if run is not None:
            pipe.transformer.enable_cache(diffusers_config(run.config, args["steps"]))

    return lambda: call(args["steps"]), warm


# ----------------------------------------------------------------------------- tp ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, args: dict, out: str) -> None:
    """One CPU rank of the tp run: the FLUX.1 row with params sharded tp=world."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        mesh = sharding.make_mesh(tp=world, device_type="cpu", timeout=300)
        row = rows()[0]
        with _quiet.loading():
            pipe = _pipeline(row)
        params = sharding.shard_params(fd.from_diffusers(pipe.transformer), mesh)
        (image, latents), seconds = _timed(
            lambda: _ours(params, pipe, row, args), lambda: _ours(params, pipe, row, _warm(args))
        )
        record = dict(ok=True, image=np.asarray(image), latents=latents, seconds=seconds)
    except Exception as e:  # noqa: BLE001 - reported by the parent
        record = dict(ok=False, error=f"{type(e).__name__}: {e}")
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_tp(args: dict, world: int) -> dict:
    """The FLUX.1 row on ``world`` spawned CPU processes (1 thread each) with tp=world;
    rank 0's result (every rank's latents must be bitwise equal)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fd_demo_") as out:
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.is_alive():
                p.kill()
        records = []
        for r in range(world):
            path = os.path.join(out, f"rank{r}.pt")
            records.append(torch.load(path, weights_only=False) if os.path.exists(path) else dict(ok=False))
    failed = [f"rank {r}: {rec.get('error', 'no result')}" for r, rec in enumerate(records) if not rec["ok"]]
    if failed:
        raise RuntimeError("the tp run failed: " + "; ".join(failed))
    if not all(torch.equal(rec["latents"], records[0]["latents"]) for rec in records):
        raise RuntimeError("the tp run's ranks returned different latents")
    first = records[0]
    return dict(image=Image.fromarray(first["image"]), latents=first["latents"], seconds=first["seconds"])


# ----------------------------------------------------------------------------- output


def contact_sheet(tiles: list[tuple[str, str, Image.Image]], tile: int = 160) -> Image.Image:
    """The images side by side, scaled to ``tile`` px (nearest), two caption lines each."""
    pad, caption = 8, 30
    sheet = Image.new("RGB", (len(tiles) * (tile + pad) + pad, tile + caption + 2 * pad), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (title, sub, img) in enumerate(tiles):
        x = pad + i * (tile + pad)
        sheet.paste(img.convert("RGB").resize((tile, tile), Image.NEAREST), (x, pad))
        draw.text((x, pad + tile + 3), title, fill="black")
        draw.text((x, pad + tile + 16), sub, fill="dimgray")
    return sheet


def table(lines: list[tuple]) -> str:
    """Rows (family, pipeline, diff, our seconds, stock seconds, output) as aligned text."""
    head = ("family", "pipeline", "max |latent diff| vs stock", f"<= {TOLERANCE:g}", "ours", "stock", "output")
    cells = [head] + [
        (f, p, f"{d:.1e}" if d else "0 (bitwise)", "pass" if d <= TOLERANCE else "FAIL", f"{s:.2f} s", f"{t:.2f} s", o)
        for f, p, d, s, t, o in lines
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(cells[0]), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in cells[1:]])


def timing_note(steps: int) -> str:
    """What the ours and stock columns time: the same thing on both sides."""
    return (
        f"ours, stock: one call each, prompt to image (text encoding, {steps} steps, VAE decode), "
        f"timed after an untimed warm-up call of the same side ({min(steps, WARMUP_STEPS)} steps)"
    )


DESCRIPTION = (
    "Builds the tiny offline model set, generates one image per family with fd.sample, "
    "compares the latents with the stock diffusers pipeline at the same seed, runs FLUX.1 again on "
    "2 local CPU ranks with tp=2, writes PNGs and a contact sheet, and prints a table."
)


def add_arguments(p) -> None:
    p.add_argument("--out", default="demo_out", help="output folder (default: demo_out)")
    p.add_argument("--steps", type=positive, default=4, help="denoising steps (default: 4)")
    p.add_argument("--size", type=positive, default=64, help="image height and width in pixels (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="the noise seed of every row")
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these rows, e.g. flux1-dev qwen-image (default: every row)",
    )
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks for the tp run (0 skips it; default: 2)")


def _selected_rows(args) -> list[Row]:
    """The rows ``--only`` names (all by default); bad flags are refused before any work."""
    selected = rows()
    if args.only:
        known = [r.name for r in selected] + ["flux1-dev-tp"]
        unknown = [n for n in args.only if n not in known]
        if unknown:
            raise CLIError(f"--only: unknown rows {unknown}; expected some of {known}")
        selected = [r for r in selected if r.name in args.only]
    if args.ranks == 1 or args.ranks < 0:
        raise CLIError(f"--ranks: expected 0 (skip the tp run) or at least 2, got {args.ranks}")
    multiple = 16  # every tiny VAE is x8, and latents pack 2x2
    if args.size % multiple:
        raise CLIError(f"--size: expected a multiple of {multiple} (VAE scale 8 x 2x2 packing), got {args.size}")
    return selected


def _tp_row(args, cfg: dict, lines: list, tiles: list) -> str:
    """The FLUX.1 row again on ``--ranks`` CPU ranks with tp; returns the like-for-like line."""
    stock, stock_seconds = _timed(*_stock_calls(_pipeline(rows()[0]), rows()[0], cfg))
    res = run_tp(cfg, args.ranks)
    diff = (res["latents"] - stock).abs().max().item()
    name = f"flux1-dev-tp{args.ranks}"
    path = os.path.join(args.out, f"{name}.png")
    res["image"].save(path)
    where = f"FluxPipeline, tp={args.ranks} on {args.ranks} CPU ranks"
    lines.append(("FLUX.1", where, diff, res["seconds"], stock_seconds, path))
    tiles.append((name, f"diff {diff:.0e}", res["image"]))
    print(f"  {name}: done", flush=True)
    return _like_against_like(cfg, args.ranks, res["seconds"])


def run(args) -> int:
    selected = _selected_rows(args)
    cfg = dict(size=args.size, steps=args.steps, seed=args.seed)
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    lines, tiles = [], []
    with _quiet.loading():
        for row in selected:
            res = run_row(row, cfg)
            path = os.path.join(args.out, f"{row.name}.png")
            res["image"].save(path)
            lines.append((row.family, res["pipeline"], res["diff"], res["seconds"], res["stock_seconds"], path))
            tiles.append((row.name, f"diff {res['diff']:.0e}", res["image"]))
            print(f"  {row.name}: done", flush=True)
        tp_wanted = args.ranks >= 2 and (not args.only or "flux1-dev-tp" in args.only or "flux1-dev" in args.only)
        like = _tp_row(args, cfg, lines, tiles) if tp_wanted else None
    sheet = os.path.join(args.out, "contact_sheet.png")
    contact_sheet(tiles).save(sheet)
    print()
    print(table(lines))
    print(timing_note(args.steps))
    print(
        f"\ncontact sheet: {sheet}; {args.size}x{args.size} px, {args.steps} steps, seed {args.seed}; "
        f"wall time {time.perf_counter() - start:.1f} s"
    )
    if like:
        print(like)
    over = [f"{line[1]} ({line[2]:.1e})" for line in lines if line[2] > TOLERANCE]
    if over:
        print(f"over the tolerance {TOLERANCE:g}: {'; '.join(over)}", file=sys.stderr)
    return 1 if over else 0


def _like_against_like(cfg: dict, ranks: int, tp_seconds: float) -> str:
    """The tp row's time next to the same call on one rank in the same conditions (a
    fresh process, 1 thread): the rows above run at torch's default thread count, so
    comparing them with the tp row would credit tp with a thread-count difference."""
    one = run_tp(cfg, 1)["seconds"]
    return (
        f"like against like (fresh process, 1 thread per rank): FLUX.1 on 1 rank {one:.2f} s, "
        f"tp={ranks} on {ranks} ranks {tp_seconds:.2f} s; the rows above use {torch.get_num_threads()} threads"
    )
