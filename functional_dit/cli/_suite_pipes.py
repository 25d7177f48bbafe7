"""The pipeline sections of ``bench --suite gpu`` (`functional_dit.cli.bench_suite`):
``fd.sample`` against the stock diffusers pipeline, without and with a step cache, and the
server's engine (`functional_dit.serve`, in-process) at several concurrencies against the
stock pipeline making one image at a time.

The pipelines are the offline tiny ones (`functional_dit.tiny`: tokenizers, text
encoders, VAE, scheduler; random weights) around a transformer with the forward
sections' widths, heads and blocks (`functional_dit.cli._bench_cache.bench_config`: the
text and latent widths are the tiny encoders' and VAE's), so what is timed is the
transformer loop at that shape; the images are noise."""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
import uuid

import torch

from ..pipelines import cache as _cache
from . import _bench_cache
from ._suite_common import describe, each, models, rel_err, run_timed

PROMPT = "a red cube on a table"


def sampled_families() -> tuple:
    """The families with a step-cache bench run (`_bench_cache.runs`: their tiny pipeline)."""
    return tuple(_bench_cache.runs())


def _pipeline(kind: str, config, p):
    """(the stock tiny ``kind`` pipeline around the diffusers module of ``config``, on the
    device, and our params sharing that module's weights)."""
    # imported here: this module's own functions are named sample and serve
    from .. import tiny

    module, params = models(config, p.device, p.dtype)
    pipe = tiny.pipeline(kind, dtype=p.dtype, transformer=module).to(p.device)
    return pipe, params


def _ours(params, pipe, p, run, steps: int, cache=None):
    # imported here: this module's own functions are named sample and serve
    from ..pipelines.sampler import sample

    kw = dict(height=p.size, width=p.size, seed=0, output_type="latent", **run.our_kw)
    return sample(params, pipe, PROMPT, steps=steps, cache=cache, **kw)


def _stock(pipe, p, run, steps: int):
    gen = torch.Generator().manual_seed(0)
    kw = dict(height=p.size, width=p.size, generator=gen, output_type="latent", **run.stock_kw)
    return pipe(prompt=PROMPT, num_inference_steps=steps, **kw).images


def _cached(params, pipe, p, run) -> dict:
    """Ours and the stock pipeline with diffusers' same cache (``enable_cache``)."""
    cache_run = _cache.CacheRun(_cache.parse(p.cache))
    ours, ours_s = run_timed(lambda: _ours(params, pipe, p, run, p.steps, cache_run), p.device)
    pipe.transformer.enable_cache(_bench_cache.diffusers_config(cache_run.config, p.steps, pipe))
    try:
        stock, stock_s = run_timed(lambda: _stock(pipe, p, run, p.steps), p.device)
    finally:
        pipe.transformer.disable_cache()
    computed = sum(d[0] for d in cache_run.decisions)
    return dict(latents=ours, stock=stock, ours_s=ours_s, stock_s=stock_s, computed=computed)


def _sample_row(fam: str, p) -> dict:
    run = _bench_cache.runs()[fam]
    config = _bench_cache.bench_config(run.kind, p.configs[fam])
    pipe, params = _pipeline(run.kind, config, p)
    _ours(params, pipe, p, run, 2), _stock(pipe, p, run, 2)  # warm-up (kernel choices, allocator)
    plain, plain_s = run_timed(lambda: _ours(params, pipe, p, run, p.steps), p.device)
    stock, stock_s = run_timed(lambda: _stock(pipe, p, run, p.steps), p.device)
    c = _cached(params, pipe, p, run)
    return dict(
        family=f"{fam} ({run.kind})",
        shape=describe(config),
        cache=p.cache,
        computed=f"{c['computed']} of {p.steps}",
        ours_s=plain_s,
        stock_s=stock_s,
        ratio=plain_s / stock_s,
        ours_cached_s=c["ours_s"],
        stock_cached_s=c["stock_s"],
        ratio_cached=c["ours_s"] / c["stock_s"],
        ratio_cache_speedup=c["ours_s"] / plain_s,
        rel_err=rel_err(plain, stock),
        rel_err_cached=rel_err(c["latents"], c["stock"]),
    )


def sample(p, window):
    """``fd.sample`` vs the stock pipeline (same settings, same weights), then both cached."""
    yield from each(p.sample, window, p.need["sample"], lambda fam: _sample_row(fam, p))


# ----------------------------------------------------------------------------- serve


def _request(engine, i: int, p) -> float:
    """Seconds from submitting image ``i`` (seed ``i``) to its delivery."""
    # imported here: this module's own functions are named sample and serve
    from .. import sampling, serve

    done, box = threading.Event(), []

    def deliver(images, error):
        box.append(error)
        done.set()

    req = sampling.Request(f"a scene number {i}", height=p.size, width=p.size, steps=p.steps, seed=i)
    start = time.perf_counter()
    engine.submit(serve.Job(uuid.uuid4().hex, [req], deliver), force=True)
    done.wait()
    if box[0] is not None:
        raise box[0]
    return time.perf_counter() - start


def drive(engine, concurrency: int, n: int, p) -> dict:
    """``n`` requests from ``concurrency`` client threads, each one after another:
    images/s and the p50 / p95 latency (as examples/bench_serve.py, without HTTP)."""
    lat, errors, lock, counter = [], [], threading.Lock(), iter(range(n))

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                took = _request(engine, i, p)
            except Exception as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(e)
                return
            with lock:
                lat.append(took)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    q = statistics.quantiles(lat, n=20, method="inclusive") if len(lat) > 1 else lat * 19
    return dict(images_s=n / wall, p50_s=statistics.median(lat), p95_s=q[18])


@contextlib.contextmanager
def _engines(params, pipe, p):
    """{"batching": an engine batching up to the largest concurrency, "off": one image at a
    time}, started and warmed up; stopped on exit."""
    # imported here: this module's own functions are named sample and serve
    from .. import serve

    engines = {}
    try:
        for mode, max_batch in (("batching", max(p.concurrency)), ("off", 1)):
            engines[mode] = serve.Engine(params, pipe, max_batch=max_batch, max_queue=1024).start()
            drive(engines[mode], 1, 1, p)
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()


def _stock_image_s(pipe, p) -> float:
    """Seconds per image of the stock pipeline, one PIL image a call (median of 2, warm)."""
    call = functools.partial(pipe, PROMPT, num_inference_steps=p.steps, height=p.size, width=p.size)
    call(num_inference_steps=2)
    return statistics.median(run_timed(call, p.device)[1] for _ in range(2))


def _serve_row(c: int, engines: dict, stock_s: float, p) -> dict:
    n = max(c, 4)
    got = {mode: drive(engine, c, n, p) for mode, engine in engines.items()}
    b, off = got["batching"], got["off"]
    return dict(
        concurrency=c,
        requests=n,
        batching_images_s=b["images_s"],
        p50_s=b["p50_s"],
        p95_s=b["p95_s"],
        off_images_s=off["images_s"],
        diffusers_images_s=1 / stock_s,
        ratio_diffusers=b["images_s"] * stock_s,
        ratio_off=b["images_s"] / off["images_s"],
    )


def serve(p, window):
    """The engine batching and not, at each concurrency, vs the stock pipeline serially."""
    if p.serve is None:
        yield dict(
            concurrency="-",
            skipped=f"no family here has a tiny pipeline (those that do: {', '.join(sampled_families())})",
        )
        return
    run = _bench_cache.runs()[p.serve]
    config = _bench_cache.bench_config(run.kind, p.configs[p.serve])
    pipe, params = _pipeline(run.kind, config, p)
    stock_s = _stock_image_s(pipe, p)
    model = f"{p.serve} ({run.kind}), {describe(config)}"
    with _engines(params, pipe, p) as engines:
        rows = each(p.concurrency, window, p.need["serve"], lambda c: _serve_row(c, engines, stock_s, p), "concurrency")
        yield from ({"model": model, **row} for row in rows)
