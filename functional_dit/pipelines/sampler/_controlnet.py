"""ControlNet for `fd.sample`: ``controlnet=(params, image, scale)`` (or a list of them),
as diffusers' ``FluxControlNetPipeline`` and ``QwenImageControlNetPipeline`` run it.

What the stock ControlNet pipelines add around the text-to-image loop of
`functional_dit.pipelines.families.flux1._Flux1` / `functional_dit.pipelines.families.qwenimage._Qwen`:

- each control image is preprocessed at the output size, repeated to the batch and
  VAE-encoded in *sample* mode: its posterior draw takes the image's generator before the
  noise does (all control images in order, then the noise); FLUX.1 normalises it with the
  VAE's shift and scale, Qwen-Image with its per-channel mean and std; both pack it as the
  latents. An XLabs ControlNet (an ``input_hint_block``) takes the preprocessed pixels
  instead, and draws nothing;
- every step, before the transformer, each ControlNet runs on the latents and the
  *conditional* prompt only (`functional_dit.controlnet.apply`), its residuals scaled by its
  scale and summed over the ControlNets (the multi-ControlNet wrappers); under true CFG the
  unconditional branch takes the same residuals.

- ``control_guidance_start`` / ``control_guidance_end`` (one fraction, or one per ControlNet):
  step ``i`` of ``n`` keeps ControlNet ``k`` unless ``i / n < start[k]`` or ``(i + 1) / n >
  end[k]`` (the stock ``controlnet_keep``), its scale multiplied by that keep (0 or 1). A step
  where every keep is 0 skips the ControlNets (their residuals would all be zero);
- ``latents=``: the given noise, each generator still drawing the control images' posterior
  samples (so ``seed`` is needed, unless every ControlNet is an XLabs one);
- step caching: the attention-level caches (TaylorSeer with ``modules``, FasterCache), every
  block's residual added after it as under diffusers' hooks; the block-skipping ones are
  refused (`check_cache`, docs/controlnet.md "Step caching").

FLUX.1's guidance defaults to the stock ControlNet pipeline's 7.0.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ... import controlnet as _cn
from ... import families as _families
from ...params import Params
from .. import cache as _cache
from ..families import product as _product
from ..families import tables
from . import _requests


@dataclasses.dataclass(frozen=True)
class Control:
    """One ControlNet of a `fd.sample` call: its params, control image, scale, (FLUX.1
    Union) control mode and the fractions of the schedule it acts in."""

    params: Params
    image: object
    scale: float
    mode: int | None = None
    start: float = 0.0
    end: float = 1.0

    def keep(self, i: int, n: int) -> float:
        """1.0 where step ``i`` of ``n`` is in [start, end], else 0.0 (the stock ``controlnet_keep``)."""
        return 1.0 - float(i / n < self.start or (i + 1) / n > self.end)


@dataclasses.dataclass(frozen=True)
class Controls:
    """The checked ControlNets of a call and its ``seed`` (with ``latents=``, the source of
    the control images' posterior draws)."""

    nets: list
    seed: object = None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _one(item, fam: str, i: int) -> Control:
    if not isinstance(item, tuple) or len(item) not in (3, 4):
        raise ValueError(
            f"controlnet[{i}]: expected (params, image, scale) or (params, image, scale, mode), got {item!r:.80}"
        )
    params, image, scale, *mode = item
    kind = _cn.kind(params) if _cn.is_controlnet(params) else None
    if kind is None or kind.TRANSFORMER is not _families.BY_KEY[fam]:
        got = kind.NAME if kind else type(getattr(params, "config", params)).__name__
        raise ValueError(f"controlnet[{i}]: expected ControlNet params for a {fam} transformer, got {got}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"controlnet[{i}]: scale: expected a real number, got {scale!r}")
    mode = mode[0] if mode else None
    num_mode = getattr(params.config, "num_mode", None)
    if (num_mode is not None) != (mode is not None) or (mode is not None and not _is_int(mode)):
        want = "an int control mode (a Union ControlNet)" if num_mode else "no control mode (not a Union ControlNet)"
        raise ValueError(f"controlnet[{i}]: expected {want}, got mode={mode!r}")
    if mode is not None and not 0 <= mode < num_mode:
        raise ValueError(
            f"controlnet[{i}]: mode: expected 0 <= mode < {num_mode} (the ControlNet's num_mode), got {mode}"
        )
    return Control(params, image, float(scale), mode)


def _fractions(start, end, n: int) -> list[tuple[float, float]]:
    """``control_guidance_start`` / ``control_guidance_end`` per ControlNet, broadcast as the
    stock pipelines broadcast them (one value to the other's list, or to every ControlNet)
    and checked as the stock ``check_inputs`` of diffusers' ControlNet pipelines: 0 <= start
    < end <= 1, one per ControlNet."""
    start, end = 0.0 if start is None else start, 1.0 if end is None else end
    for name, v in (("control_guidance_start", start), ("control_guidance_end", end)):
        vals = v if isinstance(v, list) else [v] * n
        if len(vals) != n:
            raise ValueError(f"{name}: expected a float or a list of {n} (one per ControlNet), got {v!r}")
        if not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f <= 1 for f in vals):
            raise ValueError(f"{name}: expected fractions of the schedule in [0, 1], got {v!r}")
    start, end = (v if isinstance(v, list) else [v] * n for v in (start, end))
    for k, (s, e) in enumerate(zip(start, end)):
        if s >= e:
            raise ValueError(
                f"control_guidance_start: expected each below its control_guidance_end, got start {s} >= end {e} "
                f"for controlnet[{k}]"
            )
    return [(float(s), float(e)) for s, e in zip(start, end)]


def check_cache(cache) -> None:
    """A step cache with ControlNets: the attention-level ones only (`_cache.check_no_controlnet`)."""
    config = None if cache is None else _cache.CacheRun.of(cache).config
    if config is not None and not _cache.attention_level(config):
        raise ValueError(
            "cache: with a ControlNet only the attention-level caches run (TaylorSeer with modules=, FasterCache): "
            f"a cache that skips blocks would have to choose their residuals (docs/controlnet.md); got {config}"
        )


def check(controlnet, fam: str, latents, pipe, seed=None, fractions=(None, None), cache=None) -> Controls | None:
    """The checked ControlNets of ``controlnet`` (one tuple or a list of them) with their
    ``control_guidance_start`` / ``_end``, or None; a stock ControlNet pipeline without one
    is refused (its control image would be ignored)."""
    if controlnet is None:
        if type(pipe).__name__ in _product(fam).CONTROLNET_PIPELINES:  # they need a controlnet= to reproduce
            raise ValueError(
                f"controlnet: a {type(pipe).__name__} runs a ControlNet; expected (params, image, scale), e.g. "
                "(functional_dit.controlnet.from_diffusers(pipe.controlnet), control_image, 1.0), got None"
            )
        for name, v in zip(("control_guidance_start", "control_guidance_end"), fractions):
            if v is not None:
                raise ValueError(f"{name}: applies to a ControlNet; expected None without controlnet=, got {v!r}")
        return None
    items = [controlnet] if isinstance(controlnet, tuple) else controlnet
    if not isinstance(items, list) or not items:
        raise ValueError(
            f"controlnet: expected a (params, image, scale) tuple or a list of them, got {controlnet!r:.80}"
        )
    nets = [_one(item, fam, i) for i, item in enumerate(items)]
    nets = [dataclasses.replace(c, start=s, end=e) for c, (s, e) in zip(nets, _fractions(*fractions, len(nets)))]
    check_cache(cache)
    if latents is not None and seed is None and not all(_has_hint(c) for c in nets):
        raise ValueError(
            "seed: with latents= the control images' VAE draws still take a generator (as the stock pipelines' "
            "generator=); expected an int, ints or torch.Generators, got None"
        )
    return Controls(nets, seed)


def _has_hint(c: Control) -> bool:
    return "input_hint_block" in c.params.tree


class WithControlNet:
    """A family's text-to-image steps (those with ``CONTROLNET``: FLUX.1's, Qwen-Image's)
    with ControlNet residuals in every model call, the family's ``control_pixels``,
    ``control_latents`` and ``control_kwargs`` giving its ControlNet inputs; every other
    hook is the family's (``inner``). The control images are
    the run's tables (``pixels``, ``posts``, ``src``), a chunk's control latents its
    tables (``controls``)."""

    step_cache = True  # the attention-level caches (`check_cache`)
    fixed_graph = False  # residuals per step: the usual loop

    def __init__(self, inner, controls: Controls, pipe, job: bool = False):
        if job or not inner.CONTROLNET:  # an image job's steps, or a family without ControlNets
            raise ValueError(
                f"controlnet: fd.sample runs ControlNets with text to image only (FluxPipeline, "
                f"FluxControlNetPipeline, QwenImagePipeline, QwenImageControlNetPipeline), got {type(pipe).__name__}"
            )
        self.inner, self.controls, self.seed, self.pipe = inner, controls.nets, controls.seed, pipe
        self.settings = {"controlnet": [(c.scale, c.mode, c.start, c.end) for c in controls.nets]}

    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    # ------------------------------------------------------------ control images

    def init_latents(self, run, req, height: int, width: int, device, dtype):
        """Each control image preprocessed and repeated to the batch as the stock pipelines'
        ``prepare_image``; the VAE's posterior for those the VAE encodes."""
        run, req = self.inner.init_latents(run, req, height, width, device, dtype)
        vae, src = self.pipe.vae, None
        if req.noise[0] == "latents" and self.seed is not None:  # the control draws' own source
            src = _requests.noise_source(self.seed, None, req.n)
        pixels_all, posts = [], []
        for c in self.controls:
            pixels = c.image if isinstance(c.image, torch.Tensor) else self.pipe.image_processor.preprocess(
                c.image, height=height, width=width
            )  # fmt: skip
            pixels = pixels.repeat_interleave(req.n if pixels.shape[0] == 1 else 1, dim=0).to(device, vae.dtype)
            pixels_all.append(pixels)
            if not _has_hint(c):
                posts.append(vae.encode(self.inner.control_pixels(pixels)).latent_dist)
            else:
                posts.append(None)
        return tables(run, src=src, pixels=tuple(pixels_all), posts=tuple(posts)), req

    def draw(self, run, noise: tuple, images, shape_of, dtype, device, draw):
        """The packed noise of ``images``, each generator drawing the control images'
        posterior samples first (in order), then the noise (given ``latents=``: no noise,
        the generators ``seed`` gives); the chunk's control inputs as its tables."""
        rows, given = list(images), noise[0] == "latents"
        eps, z = self._rows(run["posts"], run["src"] if given else noise, rows, shape_of, dtype, not given)
        conds = []
        for c, pixels, post, e in zip(self.controls, run["pixels"], run["posts"], eps):
            dt = next(iter(c.params.flat().values())).dtype
            if post is None:
                conds.append(pixels[rows].to(dt))
            else:
                sample = post.mean[rows] + post.std[rows] * e.to(post.mean.device)
                conds.append(self.inner.control_latents(sample).to(device, dt))
        x = draw(noise, images, shape_of, self.pack, self.take, dtype, device) if given else self.pack(z.to(device))
        return x, tables(controls=tuple(conds))

    def _rows(self, posts, src, rows: list, shape_of, dtype, noise: bool) -> tuple:
        """(each control image's posterior noise, the latents' noise or None) for ``rows``
        from the noise source ``src`` (None: nothing to draw)."""
        if src is None:
            return [None] * len(posts), None
        kind = src[0]
        if kind == "batch":  # one generator: every control image's whole batch, then the batch's noise
            *eps, z = _draws(posts, _requests._copy(src[1]), src[2], shape_of, dtype, noise)
            return [None if e is None else e[rows] for e in eps], None if z is None else z[rows]
        # one generator per image: its control rows, then its noise
        gens = [torch.Generator().manual_seed(s) for s in src[1]] if kind == "seeds" else src[1]
        per = [_draws(posts, gens[i], 1, shape_of, dtype, noise) for i in rows]
        *eps, z = [None if d[0] is None else torch.cat(d) for d in zip(*per)]
        return eps, z

    def prepare(self, run, cond, h, w, guidance, device):
        guidance = self.inner.CONTROL_GUIDANCE if guidance is None else guidance  # the stock ControlNet pipeline's
        return self.inner.prepare(run, cond, h, w, guidance, device)

    # ------------------------------------------------------------ the model call

    def step_inputs(self, sched, batch: int, dtype) -> list[dict]:
        """The family's per-step inputs and, per step, every ControlNet's keep (0 or 1; one
        row per model row, as the loop concatenates them)."""
        n = len(sched.timesteps)
        keeps = [torch.tensor([[c.keep(i, n) for c in self.controls]] * batch, dtype=torch.float64) for i in range(n)]
        return [{**e, "controlnet_keep": k} for e, k in zip(self.inner.step_inputs(sched, batch, dtype), keeps)]

    def predict(self, params, tab, x, t, cond, apply, controlnet_keep=None, **extra):
        """The family's prediction with the residuals of every ControlNet, computed on the
        conditional half only (the stock pipelines' one ControlNet call per step), each
        scaled by its scale x its keep at this step; with every keep 0, none."""
        conds = tab["controls"]
        B = conds[0].shape[0]
        keeps = [1.0] * len(self.controls) if controlnet_keep is None else controlnet_keep[0].tolist()
        if not any(keeps):  # every residual would be zero: the transformer alone (x + 0 == x)
            return self.inner.predict(params, tab, x, t, cond, apply, **extra)
        results = [
            _cn.apply(c.params, x[:B], t[:B], cond.txt[:B], cc, scale=c.scale * k,
                      **self.inner.control_kwargs(c.params, c.mode, tab, B, cond, x.device))
            for c, cc, k in zip(self.controls, conds, keeps)
        ]  # fmt: skip
        res = _cn.combine(results)
        if x.shape[0] != B:  # true CFG: the unconditional branch takes the same residuals
            res = {k: [torch.cat([r] * (x.shape[0] // B)) for r in v] if isinstance(v, list) else v
                   for k, v in res.items()}  # fmt: skip
        return self.inner.predict(params, tab, x, t, cond, functools.partial(apply, **res), **extra)


def _draws(posts, g, n: int, shape_of, dtype, noise: bool = True) -> list:
    """From generator ``g``: each encoded control image's posterior noise for ``n`` rows
    (None for a hint-block ControlNet's), then (``noise``) the latents' noise for ``n`` images."""
    eps = [None if p is None else torch.randn((n, *p.mean.shape[1:]), generator=g, dtype=p.mean.dtype) for p in posts]
    return [*eps, torch.randn(shape_of(n), generator=g, dtype=dtype) if noise else None]
