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

Not reproduced: ``control_guidance_start`` / ``control_guidance_end`` other than the
whole schedule (their defaults), ``latents=`` (the control draw needs the seed), step
caching. FLUX.1's guidance defaults to the stock ControlNet pipeline's 7.0.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from ... import controlnet as _cn
from ... import families as _families
from ...params import Params
from ..families import Steps
from ..families.flux1 import _Flux1
from ..families.qwenimage import _Qwen
from . import _requests

FLUX_GUIDANCE = 7.0  # FluxControlNetPipeline's guidance_scale default (FluxPipeline's is 3.5)


@dataclasses.dataclass(frozen=True)
class Control:
    """One ControlNet of a `fd.sample` call: its params, control image, scale and (FLUX.1
    Union) control mode."""

    params: Params
    image: object
    scale: float
    mode: int | None = None


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
    union = getattr(params.config, "num_mode", None) is not None
    if union != (mode is not None) or (mode is not None and (not isinstance(mode, int) or isinstance(mode, bool))):
        want = "an int control mode (a Union ControlNet)" if union else "no control mode (not a Union ControlNet)"
        raise ValueError(f"controlnet[{i}]: expected {want}, got mode={mode!r}")
    return Control(params, image, float(scale), mode)


PIPELINES = ("FluxControlNetPipeline", "QwenImageControlNetPipeline")  # need a controlnet= to reproduce


def check(controlnet, fam: str, latents, pipe) -> list[Control] | None:
    """The checked ControlNets of ``controlnet`` (one tuple or a list of them), or None; a
    stock ControlNet pipeline without one is refused (its control image would be ignored)."""
    if controlnet is None:
        if type(pipe).__name__ in PIPELINES:
            raise ValueError(
                f"controlnet: a {type(pipe).__name__} runs a ControlNet; expected (params, image, scale), e.g. "
                "(functional_dit.controlnet.from_diffusers(pipe.controlnet), control_image, 1.0), got None"
            )
        return None
    items = [controlnet] if isinstance(controlnet, tuple) else controlnet
    if not isinstance(items, list) or not items:
        raise ValueError(
            f"controlnet: expected a (params, image, scale) tuple or a list of them, got {controlnet!r:.80}"
        )
    if latents is not None:
        raise ValueError("latents: with a ControlNet the control image's VAE draw takes the seed; expected None")
    return [_one(item, fam, i) for i, item in enumerate(items)]


def _has_hint(c: Control) -> bool:
    return "input_hint_block" in c.params.tree


class WithControlNet:
    """A family's sampling steps (`_Flux1`, `_Qwen`) with ControlNet residuals in every
    model call; every other hook is the family's (``inner``, forked with it)."""

    step_cache = False
    fixed_graph = False  # residuals per step: the usual loop
    apply = staticmethod(Steps.apply)  # the model call the sampler wraps (per-image LoRA, ...)

    def __init__(self, inner, controls: list[Control], pipe):
        if type(inner) not in (_Flux1, _Qwen):
            raise ValueError(
                f"controlnet: fd.sample runs ControlNets with text to image only (FluxPipeline, "
                f"FluxControlNetPipeline, QwenImagePipeline, QwenImageControlNetPipeline), got {type(pipe).__name__}"
            )
        self.inner, self.controls, self.pipe, self.cur = inner, controls, pipe, None
        self.params = inner.params
        self.settings = {"controlnet": [(c.scale, c.mode) for c in controls]}

    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def fork(self):
        """A copy for one chunk, over a fork of the family's steps."""
        f = copy.copy(self)
        f.inner = self.inner.fork()
        return f

    # ------------------------------------------------------------ control images

    def init_latents(self, req, height: int, width: int, device, dtype):
        """Each control image preprocessed and repeated to the batch as the stock pipelines'
        ``prepare_image``; the VAE's posterior for those the VAE encodes."""
        req = self.inner.init_latents(req, height, width, device, dtype)
        vae, self.n = self.pipe.vae, req.n
        self.pixels, self.posts = [], []
        for c in self.controls:
            pixels = c.image if isinstance(c.image, torch.Tensor) else self.pipe.image_processor.preprocess(
                c.image, height=height, width=width
            )  # fmt: skip
            pixels = pixels.repeat_interleave(req.n if pixels.shape[0] == 1 else 1, dim=0).to(device, vae.dtype)
            self.pixels.append(pixels)
            if not _has_hint(c):
                pixels = pixels.unsqueeze(2) if isinstance(self.inner, _Qwen) else pixels
                self.posts.append(vae.encode(pixels).latent_dist)
            else:
                self.posts.append(None)
        return req

    def _normalised(self, z: torch.Tensor) -> torch.Tensor:
        """A posterior sample as the stock pipeline normalises and packs it."""
        vae = self.pipe.vae
        if isinstance(self.inner, _Qwen):
            mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device)
            inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device)
            return self.inner.pack(((z - mean) * inv_std).permute(0, 2, 1, 3, 4))
        return self.inner.pack((z - vae.config.shift_factor) * vae.config.scaling_factor)

    def draw(self, noise: tuple, images, shape_of, pack, take, dtype, device) -> torch.Tensor:
        """The packed noise of ``images``, each generator drawing the control images'
        posterior samples first (in order), then the noise; the control inputs are kept
        (``cur``, on the chunk's fork)."""
        kind, src = noise[:2]
        rows = list(images)
        if kind == "batch":  # one generator: every control image's whole batch, then the batch's noise
            *eps, z = self._draws(_requests._copy(src), noise[2], shape_of, dtype)
            eps, z = [None if e is None else e[rows] for e in eps], z[rows]
        else:  # one generator per image: its control rows, then its noise
            gens = [torch.Generator().manual_seed(src[i]) for i in rows] if kind == "seeds" else [src[i] for i in rows]
            per = [self._draws(g, 1, shape_of, dtype) for g in gens]
            *eps, z = [None if d[0] is None else torch.cat(d) for d in zip(*per)]
        conds = []
        for c, pixels, post, e in zip(self.controls, self.pixels, self.posts, eps):
            dt = next(iter(c.params.flat().values())).dtype
            if post is None:
                conds.append(pixels[rows].to(dt))
            else:
                conds.append(self._normalised(post.mean[rows] + post.std[rows] * e.to(post.mean.device)).to(device, dt))
        self.cur = conds
        return pack(z.to(device))

    def _draws(self, g, n: int, shape_of, dtype) -> list:
        """From generator ``g``: each encoded control image's posterior noise for ``n`` rows
        (None for a hint-block ControlNet's), then the latents' noise for ``n`` images."""
        eps = [None if p is None else torch.randn((n, *p.mean.shape[1:]), generator=g, dtype=p.mean.dtype)
               for p in self.posts]  # fmt: skip
        return [*eps, torch.randn(shape_of(n), generator=g, dtype=dtype)]

    def begin(self, sched, chunk, on_step):
        return self.inner.begin(sched, chunk, on_step)

    def prepare(self, cond, h, w, guidance, device):
        if isinstance(self.inner, _Flux1) and guidance is None:
            guidance = FLUX_GUIDANCE
        self.inner.prepare(cond, h, w, guidance, device)

    # ------------------------------------------------------------ the model call

    def _kwargs(self, c: Control, B: int, cond, device) -> dict:
        """The ControlNet's family keywords at this step, from the family's per-run tables."""
        inner = self.inner
        if isinstance(inner, _Qwen):
            mask = None if cond.mask is None else cond.mask[:B]
            return dict(txt_mask=mask, img_shapes=[inner.shapes] * B, rope=inner.rope)
        g = torch.full((B,), float(inner.guidance), device=device) if c.params.config.guidance_embeds else None
        mode = None if c.mode is None else torch.full((B, 1), c.mode, dtype=torch.long, device=device)
        return dict(pooled=cond.pooled[:B], guidance=g, rope=inner.rope, **({} if mode is None else {"mode": mode}))

    def __call__(self, x, t, cond):
        """The family's prediction with the residuals of every ControlNet, computed on the
        conditional half only (the stock pipelines' one ControlNet call per step)."""
        B = self.cur[0].shape[0]
        results = [
            _cn.apply(c.params, x[:B], t[:B], cond.txt[:B], cc, scale=c.scale, **self._kwargs(c, B, cond, x.device))
            for c, cc in zip(self.controls, self.cur)
        ]
        res = _cn.combine(results)
        if x.shape[0] != B:  # true CFG: the unconditional branch takes the same residuals
            res = {k: [torch.cat([r] * (x.shape[0] // B)) for r in v] if isinstance(v, list) else v
                   for k, v in res.items()}  # fmt: skip
        inner = copy.copy(self.inner)  # this call's: these params, the residuals in its model call
        inner.params, inner.apply = self.params, functools.partial(self.apply, **res)
        return inner(x, t, cond)
