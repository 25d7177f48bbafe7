"""What `fd.sample` is asked for, image by image: prompts (or their embeddings), how many
images each, and where each image's noise comes from.

Image ``i`` belongs to prompt ``i // num_images_per_prompt`` (the stock pipelines'
order: each prompt's images together). Its noise depends only on its own seed, so it is
the same whichever rank, batch or chunk makes it (docs/sampling.md, "Reproducibility"):

- ``seed=int``: image ``i`` draws from ``torch.Generator().manual_seed(seed + i)``;
- ``seed=[ints]`` or ``seed=[generators]``: one per image, as diffusers takes
  ``generator=[...]``;
- ``seed=torch.Generator``: the stock pipelines' one-generator batch noise, the whole
  batch drawn in one ``randn`` (every rank draws it all and keeps its rows);
- ``latents=``: given noise, in the stock pipeline's ``latents=`` layout.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ... import families as _families
from ..families import product as _product
from ..families.internal import copy_generator as _copy

_log = logging.getLogger(__name__)

# Per family, in its product module (`functional_dit.pipelines.families.product`): ``EMBED_ARGS``, the
# stock keyword arguments that replace the text encoders' output (``EMBEDS_TOGETHER`` of them
# needed with ``prompt_embeds``), and ``MAX_SEQUENCE_LENGTH``, the stock pipelines' limit.


@dataclasses.dataclass
class Requests:
    """``n`` images: ``prompts`` (strings, one per prompt) or ``embeds`` (stock keyword ->
    tensor with one row per prompt), ``per_prompt`` images each; ``negatives`` and
    ``negative_embeds`` likewise; ``noise`` is ("seeds", [int]), ("generators", [gen]),
    ("batch", gen, n) or ("latents", tensor)."""

    n: int
    per_prompt: int
    prompts: list[str] | None
    embeds: dict
    negatives: list[str] | None
    negative_embeds: dict
    noise: tuple

    def rows(self, images) -> list[int]:
        """The prompt row of each image in ``images``."""
        return [i // self.per_prompt for i in images]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _strings(value, name: str, n: int | None) -> list[str]:
    vals = [value] if isinstance(value, str) else value
    if not isinstance(vals, (list, tuple)) or not vals or not all(isinstance(p, str) for p in vals):
        want = "a string or a non-empty list of strings" if n is None else f"a string or {n} strings (one per prompt)"
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    vals = list(vals) * (n if n is not None and len(vals) == 1 and isinstance(value, str) else 1)
    if n is not None and len(vals) != n:
        raise ValueError(f"{name}: expected a string or {n} strings (one per prompt), got {value!r}")
    return vals


def embeds(fam: str, given: dict, prefix: str = "") -> dict:
    """The non-None embedding arguments, checked against the family's keywords."""
    out, product = {k: v for k, v in given.items() if v is not None}, _product(fam)
    for k, v in out.items():
        if k[len(prefix) :] not in product.EMBED_ARGS:
            takes = ", ".join(prefix + a for a in product.EMBED_ARGS)
            raise ValueError(f"{k}: a {fam} pipeline takes no {k}; expected None (it takes {takes})")
        if not isinstance(v, torch.Tensor) or v.ndim < 2:
            raise ValueError(f"{k}: expected a tensor with a batch dim (one row per prompt), got {v!r}")
    if out and prefix + "prompt_embeds" not in out:
        raise ValueError(f"{prefix}prompt_embeds: expected it with {sorted(out)}, got None")
    for k in product.EMBEDS_TOGETHER if out else ():
        if prefix + k not in out:
            name = _families.BY_KEY[fam].NAME
            raise ValueError(f"{prefix}{k}: expected with {prefix}prompt_embeds for {name}, got None")
    rows = {k: v.shape[0] for k, v in out.items()}
    if len(set(rows.values())) > 1:
        raise ValueError(f"{prefix}prompt_embeds: expected the same number of rows in each, got {rows}")
    return out


def check_max_sequence_length(fam: str, msl) -> None:
    if msl is None:
        return
    top = _product(fam).MAX_SEQUENCE_LENGTH
    if not _is_int(msl) or msl < 1 or (top is not None and msl > top):
        bound = f"a positive int ≤ {top}" if top else "a positive int"
        raise ValueError(f"max_sequence_length: expected {bound} (as the stock {fam} pipeline), got {msl!r}")


def requests(fam, prompt, per_prompt, seed, latents, negative_prompt, cfg: bool, given: dict) -> Requests:
    """The checked request: prompts xor prompt embeddings, negatives when ``cfg``, noise."""
    if not _is_int(per_prompt) or per_prompt < 1:
        raise ValueError(f"num_images_per_prompt: expected a positive int, got {per_prompt!r}")
    pos = embeds(fam, {k: v for k, v in given.items() if not k.startswith("negative_")})
    neg = embeds(fam, {k: v for k, v in given.items() if k.startswith("negative_")}, "negative_")
    if pos and prompt is not None:
        raise ValueError(f"prompt: expected None with prompt_embeds (one or the other), got {prompt!r}")
    prompts = None if pos else _strings(prompt, "prompt", None)
    P = len(prompts) if prompts is not None else next(iter(pos.values())).shape[0]
    if neg and next(iter(neg.values())).shape[0] != P:
        raise ValueError(
            f"negative_prompt_embeds: expected {P} rows (one per prompt), got {neg['negative_prompt_embeds'].shape[0]}"
        )
    negatives = None
    if cfg and not neg:
        negatives = _strings("" if negative_prompt is None else negative_prompt, "negative_prompt", P)
    n = P * per_prompt
    return Requests(n, per_prompt, prompts, pos, negatives, neg, noise_source(seed, latents, n))


def noise_source(seed, latents, n: int) -> tuple:
    """Where each of the ``n`` images' noise comes from (see the module docstring)."""
    if latents is not None:
        if not isinstance(latents, torch.Tensor) or latents.shape[0] != n:
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"latents: expected a tensor with {n} rows (one per image), got {got}")
        return ("latents", latents)
    if _is_int(seed):
        return ("seeds", [seed + i for i in range(n)])
    if isinstance(seed, torch.Generator):
        return ("batch", seed, n)
    if isinstance(seed, (list, tuple)) and len(seed) == n:
        if all(_is_int(s) for s in seed):
            return ("seeds", list(seed))
        if all(isinstance(g, torch.Generator) for g in seed):
            return ("generators", list(seed))
    raise ValueError(
        f"seed: expected an int (image i gets seed + i), {n} ints or {n} torch.Generators (one per image), "
        f"or one torch.Generator (the stock batch noise), got {seed!r}"
    )


def draw(noise: tuple, images, shape_of, pack, take, dtype, device) -> torch.Tensor:
    """The packed noise of ``images`` (a list of image indices). ``shape_of(B)`` is the
    family's noise shape for B images, ``pack`` its packing, ``take`` its packing of the
    stock pipeline's ``latents=`` layout."""
    kind, src = noise[:2]
    if kind == "latents":
        return take(src[list(images)].to(device=device, dtype=dtype))
    if kind == "batch":  # the whole batch from one generator, as the stock pipelines draw it
        z = torch.randn(shape_of(noise[2]), generator=_copy(src), dtype=dtype)
        return pack(z[list(images)].to(device))
    gens = [torch.Generator("cpu").manual_seed(src[i]) for i in images] if kind == "seeds" else [src[i] for i in images]
    z = torch.cat([torch.randn(shape_of(1), generator=g, dtype=dtype) for g in gens])
    return pack(z.to(device))


def true_cfg(fam: str, cfg: float | None, negative_prompt, negative_prompt_embeds) -> float | None:
    """Qwen-Image's pipelines run true CFG only with a negative prompt (or its embeddings):
    without one a ``true_cfg`` > 1 is ignored with a warning, as there."""
    if cfg is None or not _product(fam).CFG_NEEDS_NEGATIVE:
        return cfg
    if negative_prompt is None and negative_prompt_embeds is None:
        _log.warning(f"true_cfg={cfg} ignored: Qwen-Image runs classifier-free guidance only with a negative_prompt")
        return None
    return cfg
