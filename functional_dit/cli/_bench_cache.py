"""``bench --cache SPEC ...``: the sampling rows of step caching. Per family and cache, a
full `fd.sample` run (latents) cached and uncached, and the stock pipeline with the stock
transformer, uncached and with diffusers' same cache (``enable_cache``), side by side:
per-image seconds, block calls run and skipped, our cached latents against the stock
cached ones and against our uncached ones.

The pipelines are the offline tiny ones (`functional_dit.pipelines.tiny`: encoders, VAE, scheduler)
around a transformer with the mid configs' blocks and width (random weights), so the
figures measure speed only; what a skipped step costs in image quality needs real
weights (`docs/caching.md` gives the command).
"""

from __future__ import annotations

import dataclasses
import time

import torch

import functional_dit as fd

from .. import api as _api
from .. import families
from ..pipelines import cache as _cache
from ..pipelines import tiny
from ..pipelines.families import product as _product


def runs() -> dict:
    """Row name -> the family's cache bench run (`functional_dit.pipelines.families._common.BenchCache`:
    tiny pipeline kind, stock kwargs, fd.sample kwargs, CFG where the models use it), by
    mid config (family key), for the families whose product declares one (``BENCH_CACHE``)."""
    products = {fam.KEY: _product(fam) for fam in families.FAMILIES}
    return {key: p.BENCH_CACHE for key, p in products.items() if p.BENCH_CACHE is not None}


_WIDTH_KEYS = ("num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads", "axes_dims_rope")


def bench_config(kind: str, mid):
    """The tiny pipeline's transformer config (its encoders' widths) with ``mid``'s blocks and width."""
    cfg = tiny.transformer_config(kind)
    return dataclasses.replace(cfg, **{k: getattr(mid, k) for k in _WIDTH_KEYS if hasattr(cfg, k)})


def diffusers_config(cache, steps: int, pipe=None):
    """diffusers' config for our ``cache`` (MagCache at ``steps``; FasterCache reading
    ``pipe``'s current timestep)."""
    # diffusers: seconds to import, loaded when first used
    from diffusers.hooks import FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if isinstance(cache, _cache.FirstBlockCache):
        return FirstBlockCacheConfig(cache.threshold)
    if isinstance(cache, _cache.TaylorSeer):
        kw = {k: v for k, v in dataclasses.asdict(cache).items() if k not in ("modules", "skip_modules")}
        if cache.modules is None:
            return TaylorSeerCacheConfig(use_lite_mode=True, **kw)
        skip = list(cache.skip_modules) or None
        return TaylorSeerCacheConfig(cache_identifiers=list(cache.modules), skip_predict_identifiers=skip, **kw)
    if isinstance(cache, _cache.FasterCache):
        weight = cache.weight
        return FasterCacheConfig(
            spatial_attention_block_skip_range=cache.block_skip_range,
            spatial_attention_timestep_skip_range=cache.timestep_skip_range,
            spatial_attention_block_identifiers=cache.modules,
            attention_weight_callback=None if callable(weight) else (lambda _: weight),
            current_timestep_callback=cache.timestep or (lambda: pipe.current_timestep),
            is_guidance_distilled=True,
            tensor_format="BCHW",
        )
    kw = dataclasses.asdict(cache) | dict(num_inference_steps=steps, mag_ratios=list(cache.mag_ratios))
    return MagCacheConfig(**kw)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _stock(pipe, steps: int, size: int, kw: dict) -> tuple[float, torch.Tensor]:
    """(seconds, the stock ``output_type="latent"`` result: what fd.sample returns for it)."""
    gen = torch.Generator().manual_seed(0)
    kw = dict(prompt="a red cube", num_inference_steps=steps, height=size, width=size, generator=gen, **kw)
    out, seconds = _timed(lambda: pipe(**kw, output_type="latent").images)
    return seconds, out


def _stock_cached(pipe, cache, steps, size, kw):
    """The stock pipeline with diffusers' cache: (seconds, latents), or (None, why) where
    diffusers cannot run it (FLUX.2's First-Block Cache tail crash)."""
    pipe.transformer.enable_cache(diffusers_config(cache, steps, pipe))
    try:
        return _stock(pipe, steps, size, kw)
    except (TypeError, ValueError) as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    finally:
        pipe.transformer.disable_cache()


def family_rows(fam: str, mid, caches: list, steps: int, size: int) -> list[dict]:
    """One row per cache for family ``fam`` (see the module docstring)."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    run = next(r for r in runs().values() if r.row == fam)
    kind, stock_kw, our_kw = run.kind, run.stock_kw, run.our_kw
    config = bench_config(kind, mid)
    params = fd.init(config, seed=0)
    cfg = _api.config_to_diffusers(config)
    module = getattr(diffusers, cfg.pop("_class_name"))(**cfg)
    module.load_state_dict(fd.to_state_dict(params))
    module = module.eval().requires_grad_(False)
    pipe = tiny.pipeline(kind, transformer=module)
    kw = dict(steps=steps, seed=0, height=size, width=size, output_type="latent", **our_kw)
    sample = lambda cache=None: fd.sample(params, pipe, "a red cube", cache=cache, **kw)  # noqa: E731
    sample()  # warm-up
    plain, t_plain = _timed(sample)
    t_stock, _ = _stock(pipe, steps, size, stock_kw)
    n_blocks = config.num_layers + getattr(config, "num_single_layers", 0)
    return [_row(fam, c, sample, plain, t_plain, t_stock, pipe, steps, size, stock_kw, n_blocks) for c in caches]


def _row(fam, cache, sample, plain, t_plain, t_stock, pipe, steps, size, stock_kw, n_blocks) -> dict:
    run = _cache.CacheRun(cache)
    cached, t_cached = _timed(lambda: sample(run))
    # with true CFG (two transformer calls per step) the stock FasterCache's one state sees
    # both calls (and crashes where their text lengths differ), while ours batches them, so
    # its stock row is not comparable
    true_cfg = any(r.true_cfg for r in runs().values() if r.row == fam)
    if isinstance(run.config, _cache.FasterCache) and true_cfg:
        t_stock_cached, stock_cached = None, "n/a: stock FasterCache shares one state across true CFG's two calls"
    else:
        t_stock_cached, stock_cached = _stock_cached(pipe, run.config, steps, size, stock_kw)
    per_skip = n_blocks - 1 if isinstance(run.config, _cache.FirstBlockCache) else n_blocks
    if _cache.attention_level(run.config):
        per_skip = 0  # inside the blocks: no block call is skipped, attention calls are
    branch_steps = sum(len(d) for d in run.decisions)
    vs_stock = (cached - stock_cached).abs().max().item() if isinstance(stock_cached, torch.Tensor) else stock_cached
    return dict(
        family=fam,
        cache=_cache.label(run.config),
        steps_computed=[sum(d[b] for d in run.decisions) for b in range(len(run.decisions[0]))],
        steps=steps,
        block_calls=branch_steps * n_blocks,
        block_calls_skipped=run.skipped() * per_skip,
        ours_s=t_cached,
        ours_uncached_s=t_plain,
        stock_s=t_stock_cached,
        stock_uncached_s=t_stock,
        vs_stock_cached=vs_stock,
        vs_uncached=((cached - plain).abs().max() / plain.abs().max()).item(),
    )


def section(mids: dict, specs: list[str], steps: int, size: int) -> list[dict]:
    """The rows for every mid config in ``mids`` and every cache spec."""
    caches = [_cache.parse(s) for s in specs]
    rows = []
    bench = runs()
    for name, mid in mids.items():
        if name in bench:
            print(f"{name}: sampling with {', '.join(specs)} ...", flush=True)
            rows += family_rows(bench[name].row, mid, caches, steps, size)
    return rows


def table(rows: list[dict]) -> list[str]:
    head = ["family", "cache", "steps computed (per branch)", "block calls skipped", "ours cached / uncached s",
            "stock+diffusers cached / uncached s", "ours / stock cached", "max |ours - stock cached|",
            "max |cached - uncached| / max |uncached|"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        stock = "n/a" if r["stock_s"] is None else f"{r['stock_s']:.2f}"
        ratio = "n/a" if r["stock_s"] is None else f"{r['ours_s'] / r['stock_s']:.2f}"
        vs = r["vs_stock_cached"] if isinstance(r["vs_stock_cached"], str) else f"{r['vs_stock_cached']:.1e}"
        lines.append(
            f"| {r['family']} | {r['cache']} | {'/'.join(map(str, r['steps_computed']))} of {r['steps']} | "
            f"{r['block_calls_skipped']} of {r['block_calls']} | {r['ours_s']:.2f} / {r['ours_uncached_s']:.2f} | "
            f"{stock} / {r['stock_uncached_s']:.2f} | {ratio} | {vs} | {r['vs_uncached']:.3f} |"
        )
    return lines
