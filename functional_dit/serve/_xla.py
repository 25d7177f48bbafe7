"""The engine's fixed-shape backend (``serve --device xla``, ``--xla-buckets``): each step of
a running batch is one `pipelines.sampler_xla_batch` graph, padded to a bucket, so no request
mix compiles after `Fixed.warmup` (docs/xla.md "Serving").

The engine (`_engine.Engine`) calls ``init`` / ``step`` / ``decode`` of its backend; this one
keeps every item as a `sampler_xla_batch.Slot` (its latents and schedule on the device), cuts
the lazy graph after each step (``torch_xla.sync``), and counts torch_xla's compilations and
host-device transfers for /metrics. Off torch_xla (``--xla-buckets`` on the CPU) the same
padded steps run eagerly: a check of a deployment's batching and padding without a TPU.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
from torch.utils import _pytree

from ..nn import values as _values
from ..pipelines import sampler_xla as _xla
from ..pipelines import sampler_xla_batch as _batch
from ..pipelines import sampling
from . import XLA_MISSING, XLA_SHARDED


def device(name: str) -> torch.device:
    """``--device``: the CPU, or torch_xla's device (a ValueError naming what to install)."""
    if name == "cpu":
        return torch.device("cpu")
    try:
        # optional: torch_xla, XLA devices only
        import torch_xla
    except ImportError:
        raise ValueError(XLA_MISSING) from None
    return torch_xla.device()


def buckets(text: str) -> tuple[int, ...]:
    """``--xla-buckets``: distinct positive ints, comma-separated, ascending."""
    try:
        out = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        out = ()
    if not out or out[0] < 1:
        raise ValueError(f"--xla-buckets: expected positive batch sizes such as 1,2,4,8, got {text!r}")
    return out


class _Counters:
    """torch_xla's compile and transfer counts (zeros off torch_xla)."""

    NAMES = {"compiles": "CompileTime", "to_device": "TransferToDeviceTime", "to_host": "TransferFromDeviceTime"}

    def __init__(self, dev: torch.device):
        self.met = None
        if dev.type == "xla":
            # optional: torch_xla, XLA devices only
            import torch_xla.debug.metrics as met

            self.met = met

    def read(self) -> dict:
        if self.met is None:
            return dict.fromkeys(self.NAMES, 0)
        data = {k: self.met.metric_data(v) for k, v in self.NAMES.items()}
        return {k: 0 if v is None else v[0] for k, v in data.items()}


@dataclasses.dataclass
class Stats:
    """What /metrics shows of the backend: compiles in all and since warm-up, the last step's
    transfers, padded rows stepped, warm-up seconds and graphs."""

    compiles: int = 0
    warm_compiles: int | None = None
    last_to_device: int = 0
    last_to_host: int = 0
    rows: int = 0
    padded_rows: int = 0
    warmup_seconds: float = 0.0
    bucket_steps: dict = dataclasses.field(default_factory=dict)  # {bucket: steps run at that bucket}


class Fixed:
    """The fixed-shape backend over ``ctx``: batches padded to ``buckets``, ``adapters``
    every adapter the server holds (fixed at start-up: they are part of the graph),
    ``strict``: a size not warmed is refused (`refuse`), nor one of ``sizes`` (those the
    server warms before it listens, ``--xla-sizes``: its defaults are checked against them
    first); ``text``: the token count a masked text (Qwen-Image's) is padded to (the
    server's ``--max-sequence-length``, else 512)."""

    def __init__(self, ctx, adapters, buckets, strict: bool = False, text: int = 512, sizes=()):
        self.ctx, self.adapters, self.buckets, self.strict = ctx, list(adapters), tuple(buckets), strict
        self.text, self.sizes = text, tuple(sizes)
        _batch.check_context(ctx, self.adapters)
        self.counters, self.stats = _Counters(torch.device(ctx.device)), Stats()
        self.pads: dict = {}  # key -> the zero slots of that key (the largest bucket less one)
        self.warmed: set = set()  # (width, height) compiled for every bucket
        self.others = list  # rank 0 under --dp: () -> the other groups' `Stats` (`_ranks.Ranks.backend_stats`)

    def refuse(self, req) -> tuple[str, str] | None:
        """(field, what it expects) when ``req`` cannot run in these graphs (a 400), else None."""
        if req.cache is not None:
            return "cache", "null or 'none' (step caches decide on the host: not under --device xla)"
        taken = self.warmed | set(self.sizes)
        if self.strict and (req.width, req.height) not in taken:
            sizes = ", ".join(f"{w}x{h}" for w, h in sorted(taken))
            return "size", f"one of the warmed sizes {sizes} (--xla-strict)"
        return None

    def init(self, params, ctx, requests, tags=None) -> sampling.State:
        """`sampling.init`, each item a `Slot` whose device data is in place (graph cut)."""
        state = sampling.init(params, ctx, requests, tags, host_schedule=True)
        slots = tuple(_batch.slot(ctx, it, self.adapters, self.text) for it in state.items)
        del state  # its unpadded tables (Qwen-Image's RoPE for the prompt's own length) are not computed
        _sync(self.ctx.device)
        return sampling.State(ctx, slots)

    def step(self, params, state: sampling.State) -> sampling.State:
        """One padded step of the state's unfinished slots (no host read inside it)."""
        slots = [s for s in state.items if not s.done]
        if not slots:
            return state
        n = _batch.bucket(len(slots), self.buckets)
        before = self.counters.read()
        moved = self._run(params, slots, n)
        self._count(before, len(slots), n)
        new = dict(zip(map(id, slots), moved))
        return sampling.State(state.ctx, tuple(new.get(id(s), s) for s in state.items))

    def _run(self, params, slots, n: int) -> list:
        """``slots`` stepped in bucket ``n`` (padded with the key's zero slots), the graph
        cut; strict: a host read of tensor data inside the step raises."""
        pad = self._pads(slots[0])
        with _values.skipped(), _xla.NoHostSync():
            moved, rest = _batch.step(params, self.ctx, slots, _batch.Pads(pad.slots[: n - len(slots)]), self.adapters)
            _sync(self.ctx.device)  # every row is an output: `rest` lives until here
        return moved

    def decode(self, state: sampling.State, output_type: str = "pil"):
        """The finished slots' images: their latents moved to the host once, then
        `sampling.decode` (the VAE where the pipeline has it)."""
        items = tuple(dataclasses.replace(s.item, x=s.item.x.cpu()) for s in state.items if s.done)
        return sampling.decode(sampling.State(state.ctx, items), output_type)

    def _pads(self, template):
        key = template.key
        if key not in self.pads:
            self.pads[key] = _batch.pads(template, max(self.buckets) - 1)
            _sync(self.ctx.device)
        return self.pads[key]

    def _count(self, before: dict, rows: int, bucket: int) -> None:
        after, s = self.counters.read(), self.stats
        s.compiles += after["compiles"] - before["compiles"]
        s.last_to_device = after["to_device"] - before["to_device"]
        s.last_to_host = after["to_host"] - before["to_host"]
        s.rows, s.padded_rows = s.rows + rows, s.padded_rows + bucket - rows
        s.bucket_steps = {**s.bucket_steps, bucket: s.bucket_steps.get(bucket, 0) + 1}

    def warmup(self, params, sizes, cfg: bool, max_sequence_length=None) -> None:
        """Compile every bucket's step for each (width, height) of ``sizes``, without and
        (``cfg``) with true CFG, and each size's preparation (`init`): one throwaway item per
        size and mode, stepped alone in every bucket (its pads are data: any k items in a
        bucket are this graph). Afterwards those sizes are ``warmed``."""
        start = time.perf_counter()
        for w, h in sizes:
            for true_cfg in (None, 2.0) if cfg else (None,):
                neg = None if true_cfg is None else "warm-up"  # (Qwen-Image runs CFG only with one)
                req = sampling.Request(
                    "warm-up", h, w, 2, true_cfg=true_cfg, negative_prompt=neg, max_sequence_length=max_sequence_length
                )
                (item,) = self.init(params, self.ctx, [req]).items
                for n in self.buckets:  # the item stays at step 0: `step` is pure
                    self._run(params, [item], n)
            self.warmed.add((w, h))
        self.stats.warm_compiles = self.counters.read()["compiles"]
        self.stats.warmup_seconds = time.perf_counter() - start

    def xla_stats(self) -> Stats:
        """This backend's `Stats`, ``compiles`` torch_xla's count in all (a dp group's leader
        sends them to rank 0 each turn)."""
        return dataclasses.replace(self.stats, compiles=self.counters.read()["compiles"])

    def metrics(self) -> list[str]:
        """Prometheus lines: torch_xla's compiles (in all, and since warm-up's end), the last
        step's host-device transfers, the padding, warm-up seconds; under ``--dp`` (``others``:
        the other groups' `Stats`, set on rank 0) summed over the groups (transfers and
        warm-up seconds: the largest)."""
        s = _summed([self.xla_stats(), *self.others()])
        now = s.compiles
        since = 0 if s.warm_compiles is None else now - s.warm_compiles
        lines = [
            "# TYPE fd_serve_xla_compiles_total counter",
            f"fd_serve_xla_compiles_total {now}",
            "# TYPE fd_serve_xla_compiles_after_warmup_total counter",
            f"fd_serve_xla_compiles_after_warmup_total {since}",
            "# TYPE fd_serve_xla_step_transfers gauge",
            f'fd_serve_xla_step_transfers{{direction="to_device"}} {s.last_to_device}',
            f'fd_serve_xla_step_transfers{{direction="to_host"}} {s.last_to_host}',
            "# TYPE fd_serve_xla_rows_total counter",
            f'fd_serve_xla_rows_total{{kind="item"}} {s.rows}',
            f'fd_serve_xla_rows_total{{kind="pad"}} {s.padded_rows}',
            "# TYPE fd_serve_xla_bucket_steps_total counter",
            *(f'fd_serve_xla_bucket_steps_total{{bucket="{b}"}} {n}' for b, n in sorted(s.bucket_steps.items())),
            "# TYPE fd_serve_xla_warmup_seconds gauge",
            f"fd_serve_xla_warmup_seconds {s.warmup_seconds:.6g}",
        ]
        return lines


def _summed(stats: list) -> Stats:
    """Several groups' `Stats` as one: counts summed, transfers and warm-up seconds the largest."""
    warm = [s.warm_compiles for s in stats]
    buckets: dict = {}
    for s in stats:
        buckets.update({b: buckets.get(b, 0) + n for b, n in s.bucket_steps.items()})
    return Stats(
        compiles=sum(s.compiles for s in stats),
        warm_compiles=None if None in warm else sum(warm),
        last_to_device=max(s.last_to_device for s in stats),
        last_to_host=max(s.last_to_host for s in stats),
        rows=sum(s.rows for s in stats),
        padded_rows=sum(s.padded_rows for s in stats),
        warmup_seconds=max(s.warmup_seconds for s in stats),
        bucket_steps=buckets,
    )


def _sync(dev) -> None:
    """``torch_xla.sync()`` on xla (cuts the lazy graph: everything pending runs), else nothing."""
    if torch.device(dev).type == "xla":
        # optional: torch_xla, XLA devices only
        import torch_xla

        torch_xla.sync()


# ----------------------------------------------------------------------------- serve's set-up


def options(args, run_time: dict) -> dict | None:
    """``serve``'s fixed-shape flags checked before anything loads: {device, buckets, sizes}
    or None (the usual engine). ValueErrors name the flag."""
    name, text = getattr(args, "device", "cpu"), getattr(args, "xla_buckets", None)
    warm, strict = getattr(args, "xla_warmup", False), getattr(args, "xla_strict", False)
    if name == "cpu" and text is None:
        if warm or strict:
            raise ValueError("--xla-warmup/--xla-strict: expected with --device xla or --xla-buckets")
        return None
    if run_time.get("root") or run_time.get("token"):
        raise ValueError(
            "--lora-dir/--admin-token: the adapters held are part of the XLA step graphs, fixed at start-up; "
            "load them with --lora NAME=PATH"
        )
    if strict and not warm:
        raise ValueError("--xla-strict: expected with --xla-warmup (it refuses the sizes not warmed)")
    if name == "xla" and args.tp * args.sp != 1:
        raise ValueError(XLA_SHARDED.format(tp=args.tp, sp=args.sp))
    sizes = [_size(v) for v in (getattr(args, "xla_sizes", None) or args.size).split(",")]
    found = dict(device=device(name), buckets=buckets(text or "1,2,4,8"), sizes=sizes)
    _persistent_cache(getattr(args, "xla_cache", None), found["device"])
    return found


def _persistent_cache(folder, dev) -> None:
    """``--xla-cache DIR``: torch_xla's persistent compilation cache there, set before any
    XLA computation (as ``XLA_PERSISTENT_CACHE_PATH`` would); a restarted server's warm-up
    then loads its programs (TPU, CUDA; the CPU runtime writes but cannot reload them).
    Under torchrun each rank its own ``DIR/rank-N`` (no two writers of one file)."""
    if folder is None:
        return
    if dev.type != "xla":
        raise ValueError(f"--xla-cache: expected with --device xla, got --device {dev.type}")
    # optional: torch_xla, XLA devices only
    import torch_xla.runtime as xr

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        folder = os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}")
    xr.initialize_cache(folder, readonly=False)


def _size(text: str) -> tuple[int, int]:
    w, sep, h = text.strip().partition("x")
    if not (sep and w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
        raise ValueError(f"--xla-sizes: expected sizes WxH[,WxH...] such as 1024x1024, got {text!r}")
    return int(w), int(h)


def to_device(tree, dev):
    """Params or an adapter with every tensor on ``dev``."""
    return _pytree.tree_map(lambda v: v.to(dev) if isinstance(v, torch.Tensor) else v, tree)


def param_device(params) -> torch.device:
    return next(iter(params.flat().values())).device


def backend(fixed: dict, args):
    """The engine's fixed-shape backend maker (`_engine.Engine`'s ``backend``): ``(ctx,
    adapters) -> Fixed`` over the found ``fixed`` buckets and the server's flags."""
    text = args.max_sequence_length or 512
    b, sizes = fixed["buckets"], fixed["sizes"]
    return lambda ctx, adapters: Fixed(ctx, adapters.values(), b, args.xla_strict, text, sizes)


def max_batch(fixed: dict, args) -> int:
    """The engine's ``max_batch`` under XLA: its batches at most the largest bucket."""
    return min(args.max_batch, max(fixed["buckets"]))


def warm(engine, fixed: dict, args) -> None:
    """With ``--xla-warmup``, every bucket and size of the engine's `Fixed` backend compiled
    now, before the server listens."""
    if not args.xla_warmup:
        return
    b = engine.backend
    b.warmup(engine.params, fixed["sizes"], cfg=True, max_sequence_length=args.max_sequence_length)
    s = b.stats
    print(
        f"xla warm-up: sizes {', '.join(f'{w}x{h}' for w, h in fixed['sizes'])}, buckets "
        f"{','.join(map(str, fixed['buckets']))}, with and without CFG: {s.warm_compiles} compiles in "
        f"{s.warmup_seconds:.1f} s",
        flush=True,
    )
