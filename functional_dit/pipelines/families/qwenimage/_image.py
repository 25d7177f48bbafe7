"""`fd.sample`'s image-to-image and inpainting for Qwen-Image (diffusers'
``QwenImageImg2ImgPipeline``, ``QwenImageInpaintPipeline``), several reference images
(``QwenImageEditPlusPipeline``), and the stock rule for Qwen-Image's true CFG (none
without a negative prompt).

Both pipelines encode the start image with the VAE in sampling mode, drawing from the
generator of the image it belongs to before the noise, start at ``t_start = steps -
int(steps * strength)`` of the full schedule and noise the image latents to that first
timestep (``scheduler.scale_noise``). Inpainting then, after every step, puts back the
image latents noised to the next timestep where the mask is black (0). We reproduce
each of these in the stock order. Edit-Plus shows the text encoder every reference at
about 384² pixels and appends each one's VAE latents (about 1024², distribution mode)
after the latents, one ``img_shapes`` entry each. docs/sampling.md lists what differs.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import PIL.Image
import torch
from PIL import Image

from .... import qwenimage as _qwen
from ...schedule import STRENGTH, blend, noised_start, t_start
from ..internal import NO_TABLES, copy_generator, cut, tables
from ..internal import pack_2x2 as _pack
from ._base import _Qwen

IMG2IMG = ("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")
PIPELINES = (*IMG2IMG, "QwenImageEditPlusPipeline", "QwenImageLayeredPipeline")  # also in `_sample.PIPELINES`
LAYERS = 4  # QwenImageLayeredPipeline's default
LAYERED_RESOLUTIONS = (640, 1024)  # QwenImageLayeredPipeline's buckets
CONDITION_AREA, VAE_AREA = 384 * 384, 1024 * 1024  # Edit-Plus: the text encoder's and the VAE's reference sizes


def _strength(strength) -> float:
    if strength is None:
        return STRENGTH
    if not isinstance(strength, (int, float)) or isinstance(strength, bool) or not 0 <= strength <= 1:
        raise ValueError(f"strength: expected a number in [0, 1], got {strength!r}")
    return float(strength)


def _upgrade(pipe, image, mask_image):
    """A QwenImagePipeline given an ``image``: the img2img (with ``mask_image`` the
    inpainting) pipeline over the same components, as ``from_pipe`` would build it."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    if type(pipe) is not diffusers.QwenImagePipeline or image is None:
        return pipe
    cls = diffusers.QwenImageInpaintPipeline if mask_image is not None else diffusers.QwenImageImg2ImgPipeline
    new = cls(**{k: v for k, v in pipe.components.items() if k != "transformer"}, transformer=None)
    new.set_progress_bar_config(disable=True)
    return new


def pipeline(pipe, steps: int, output_type: str, image, mask_image, strength, padding_mask_crop, layers=None):
    """The pipeline `fd.sample` runs (see `_upgrade`) after the img2img/inpainting checks;
    every other pipeline unchanged, refusing these arguments where it is a Qwen-Image one."""
    pipe = _upgrade(pipe, image, mask_image)
    name = type(pipe).__name__
    extra = dict(strength=strength, mask_image=mask_image, padding_mask_crop=padding_mask_crop)
    if name == "QwenImageLayeredPipeline":
        _check_layered(image, layers)
        layers = None
    if layers is not None:
        raise ValueError(f"layers: only a QwenImageLayeredPipeline takes layers; expected None for a {name}")
    if name not in IMG2IMG:
        if name == "QwenImageEditPlusPipeline":
            _check_images("image", image)
        for arg, v in extra.items():
            if v is not None and name.startswith("QwenImage"):
                raise ValueError(f"{arg}: a {name} takes no {arg} (img2img and inpainting do); expected None")
        return pipe
    inpaint = name == "QwenImageInpaintPipeline"
    if image is None:
        raise ValueError(f"image: a {name} starts from an image; expected a PIL image or a list of them, got None")
    _check_images("image", image)
    if inpaint != (mask_image is not None):
        want = "a mask image (white = repaint)" if inpaint else "None (only inpainting takes a mask)"
        raise ValueError(f"mask_image: a {name} expects {want}, got {type(mask_image).__name__}")
    if mask_image is not None:
        _check_images("mask_image", mask_image)
    _check_crop(name, padding_mask_crop, image, mask_image, output_type)
    if steps - t_start(steps, _strength(strength)) < 1:
        raise ValueError(f"strength: expected more than 0 (it leaves none of the {steps} steps), got {strength!r}")
    return pipe


def size(pipe, height, width, resolution, image) -> tuple:
    """(height, width): as given, or as QwenImageLayeredPipeline sizes its output from
    ``resolution`` and the image's aspect ratio."""
    if type(pipe).__name__ != "QwenImageLayeredPipeline" or (resolution is None and (height, width) != (None, None)):
        return height, width
    if height is not None or width is not None:
        raise ValueError(
            f"height, width: expected None with resolution (the stock pipeline sizes its output from resolution "
            f"alone), got {height!r}, {width!r}"
        )
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as stock  # the stock buckets (diffusers)

    res, multiple = LAYERED_RESOLUTIONS[0] if resolution is None else resolution, pipe.vae_scale_factor * 2
    if res not in LAYERED_RESOLUTIONS:
        raise ValueError(f"resolution: expected one of {list(LAYERED_RESOLUTIONS)} (as stock), got {res!r}")
    img = image[0] if isinstance(image, (list, tuple)) and image else image
    if not isinstance(img, Image.Image):
        raise ValueError(
            f"image: the output is sized from the image's aspect ratio; expected a PIL image, got {image!r:.80}"
        )
    w, h = stock.calculate_dimensions(res * res, img.size[0] / img.size[1])
    return h // multiple * multiple, w // multiple * multiple


def _check_images(arg: str, value) -> None:
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(v, PIL.Image.Image) for v in items):
        raise ValueError(f"{arg}: expected a PIL image or a non-empty list of them, got {value!r}")


def _check_crop(name, crop, image, mask_image, output_type) -> None:
    """``padding_mask_crop`` as the stock inpainting pipeline allows it: one PIL image and
    mask, output_type "pil"."""
    if crop is None:
        return
    if name != "QwenImageInpaintPipeline":
        raise ValueError(f"padding_mask_crop: a {name} takes no padding_mask_crop (inpainting does); expected None")
    if not isinstance(crop, int) or isinstance(crop, bool) or crop < 0:
        raise ValueError(f"padding_mask_crop: expected None or a non-negative int (pixels), got {crop!r}")
    if not isinstance(image, PIL.Image.Image) or not isinstance(mask_image, PIL.Image.Image):
        raise ValueError("padding_mask_crop: expected one PIL image and one PIL mask_image (as the stock pipeline)")
    if output_type != "pil":
        raise ValueError(f"output_type: expected 'pil' with padding_mask_crop (as stock), got {output_type!r}")


def _check_layered(image, layers) -> None:
    if not isinstance(image, PIL.Image.Image):
        raise ValueError(f"image: a QwenImageLayeredPipeline splits one PIL image into layers, got {image!r}")
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 1):
        raise ValueError(f"layers: expected None (4, as stock) or a positive int, got {layers!r}")


def model(params, pipe, image, mask_image, strength, padding_mask_crop, layers=None):
    """The per-family sampling steps for these pipelines (`Img2Img`, `EditPlus`, `Layered`)."""
    if type(pipe).__name__ == "QwenImageEditPlusPipeline":
        return EditPlus(params, pipe)
    if type(pipe).__name__ == "QwenImageLayeredPipeline":
        return Layered(params, pipe, LAYERS if layers is None else layers)
    return Img2Img(params, pipe, _strength(strength), mask_image, padding_mask_crop)


def _generators(noise: tuple, b: int):
    """(the generator(s) the VAE samples the ``b`` start images with, the noise source to
    draw from afterwards): image j's own generator for j < b, or the one batch generator."""
    kind, src = noise[:2]
    if kind == "batch":
        g = copy_generator(src)
        return g, ("batch", g, noise[2])
    gens = [torch.Generator("cpu").manual_seed(s) for s in src] if kind == "seeds" else list(src)
    return gens[:b], ("generators", gens)


def _rows(t: torch.Tensor, images) -> torch.Tensor:
    """Rows of ``t`` for ``images``, tiled as the pipelines repeat a smaller batch."""
    return t[[i % t.shape[0] for i in images]]


class Img2Img(_Qwen):
    """QwenImageImg2ImgPipeline / QwenImageInpaintPipeline: the text-to-image steps from a
    VAE-encoded start image, the partial schedule and (inpainting) the per-step blend."""

    blends_steps = True  # inpainting's blend (`after_step`; as data for the fixed loop, `blend_parts`)

    def __init__(self, params, pipe, strength: float, mask_image=None, crop: int | None = None):
        super().__init__(params, pipe)
        self.strength, self.mask_image, self.crop = strength, mask_image, crop
        self.inpaints = mask_image is not None  # takes masked_image_latents (`sampler._stock_args`)
        self.latent_channels = pipe.vae.config.z_dim  # QwenImageInpaintPipeline.latent_channels

    def images(self, images, B, device):
        """Kept as given: they are preprocessed at the output size (`init_latents`)."""
        return tables(raw=images, start=None, mask=None, crops=None)

    def checked(self, run) -> dict:
        """The inputs every rank of a group must hold the same (`_sample._check_ranks`)."""
        out = {} if run["start"] is None else {"image latents (image)": run["start"]}
        return out | ({} if run["mask"] is None else {"mask (mask_image)": run["mask"]})

    def _preprocess(self, raw, height: int, width: int):
        """The start pixels (b, 3, H, W), mask (m, 1, H, W) or None and the crop, as the
        pipelines preprocess them (the crop and "fill" resize with ``padding_mask_crop``)."""
        pipe, mode, crops = self.pipe, "default", None
        if self.crop is not None:
            mode = "fill"
            crops = pipe.mask_processor.get_crop_region(self.mask_image, width, height, pad=self.crop)
        kw = dict(height=height, width=width, crops_coords=crops, resize_mode=mode)
        pixels = pipe.image_processor.preprocess(raw, **kw).to(dtype=torch.float32)
        mask = None if self.mask_image is None else pipe.mask_processor.preprocess(self.mask_image, **kw)
        return pixels, mask, crops

    def init_latents(self, run, req, height: int, width: int, device, dtype):
        """Encode the start image(s) with their images' generators (before the noise, as the
        pipelines draw them) and the mask; the request whose noise comes after them."""
        pixels, mask, crops = self._preprocess(run["raw"], height, width)
        for arg, t in (("image", pixels), ("mask_image", mask)):
            if t is not None and req.n % t.shape[0]:
                raise ValueError(f"{arg}: expected a count that divides the {req.n} images made, got {t.shape[0]}")
        if req.noise[0] == "latents":
            if mask is not None:  # the stock pipeline fails on latents= (its prepare_latents returns early)
                raise ValueError("latents: a QwenImageInpaintPipeline takes none (the stock one fails); expected None")
            return tables(run, crops=crops), req  # the stock img2img starts from the given latents as they are
        gens, noise = _generators(req.noise, pixels.shape[0])
        vae_device = self.pipe.vae.device  # encoded where the VAE is (the CPU on a lazy device)
        z = self.pipe._encode_vae_image(pixels.unsqueeze(2).to(device=vae_device, dtype=dtype), generator=gens)
        start = _pack(z[:, :, 0]).to(device)
        if mask is not None:
            h, w = z.shape[-2:]
            mask = torch.nn.functional.interpolate(mask, size=(h, w)).to(device=device, dtype=dtype)
            mask = _pack(mask.repeat(1, z.shape[1], 1, 1))
        return tables(run, crops=crops, start=start, mask=mask), dataclasses.replace(req, noise=noise)

    def schedule(self, tab, sched):
        """The partial schedule (a copy)."""
        return cut(sched, self.strength)

    def begin(self, tab, sched, x, images):
        """The noised start latents; inpainting keeps (image latents, noise, mask) for its
        per-step blend as the item's ``cur``."""
        if tab["start"] is None:  # latents= given: the start as it is
            return x, tables(tab, cur=None)
        init = _rows(tab["start"], images).to(x.dtype)
        cur = None if tab["mask"] is None else (init, x, _rows(tab["mask"], images))
        return noised_start(sched, init, x), tables(tab, cur=cur)

    def after_step(self, tab, i: int, sched, x: torch.Tensor) -> torch.Tensor:
        """Inpainting: the image latents noised to the next timestep where the mask is 0."""
        return x if tab["cur"] is None else blend(sched, i, *tab["cur"], x)

    def blend_parts(self, tab):
        return tab["cur"]

    def overlay(self, tab, images):
        """``padding_mask_crop``: each output pasted into the original image, as the pipeline."""
        if self.crop is None:
            return images
        apply = self.pipe.image_processor.apply_overlay
        return [apply(self.mask_image, tab["raw"][0], i, tab["crops"]) for i in images]


def _dims(area: int, size) -> tuple[int, int]:
    """(width, height) of about ``area`` pixels with ``size``'s aspect ratio, multiples of 32."""
    ratio = size[0] / size[1]
    w = math.sqrt(area * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


class EditPlus(_Qwen):
    """QwenImageEditPlusPipeline: one prompt, several reference images; each is shown to
    the text encoder ("Picture k: ...") and appended as latents with its own img_shapes."""

    def images(self, images, B, device):
        """The references the text encoder sees (the run's ``prompt_image``)."""
        prompt_image = [self.pipe.image_processor.resize(i, *_dims(CONDITION_AREA, i.size)[::-1]) for i in images]
        return tables(raw=images, prompt_image=prompt_image)

    def init_latents(self, run, req, height: int, width: int, device, dtype):
        """Each reference VAE-encoded (distribution mode), packed; one img_shapes entry
        each: the run's ``ref`` and ``ref_shapes``."""
        pipe, refs, shapes = self.pipe, [], []
        for img in run["raw"]:
            vw, vh = _dims(VAE_AREA, img.size)
            pixels = pipe.image_processor.preprocess(img, vh, vw).unsqueeze(2)
            z = pipe._encode_vae_image(pixels.to(device=device, dtype=pipe.vae.dtype), generator=None)
            refs.append(_pack(z[:, :, 0]))
            shapes.append((1, z.shape[3] // 2, z.shape[4] // 2))
        return tables(run, ref=torch.cat(refs, 1), ref_shapes=shapes), req

    def encode(self, run, prompts, msl):
        """The one prompt encoded once with every reference, repeated per image (as stock)."""
        if len(set(prompts)) > 1:
            raise ValueError(
                f"prompt: a QwenImageEditPlusPipeline takes one prompt (as stock), got {len(set(prompts))}"
            )
        p = super().encode(run, prompts[:1], msl)
        n = len(prompts)
        return dataclasses.replace(p, txt=p.txt.repeat(n, 1, 1), mask=None if p.mask is None else p.mask.repeat(n, 1))


class Layered(_Qwen):
    """QwenImageLayeredPipeline: ``layers + 1`` latent frames (the first the composite) as
    one packed sequence, the image appended as the condition (frame -1 of the layer-3D
    RoPE), ``additional_t_cond`` 0 (RGB), its own schedule and plain (unrescaled) CFG."""

    normalise_cfg = False  # the pipeline's cfg_normalize=False

    def __init__(self, params, pipe, layers: int):
        super().__init__(params, pipe)
        self.layers = layers

    def noise_shape(self, B, h, w):
        return (B, self.layers + 1, self.c.in_channels // 4, h, w)

    @staticmethod
    def pack(z):
        """(B, L, C, h, w) -> (B, L · h/2 · w/2, 4C): each frame's 2x2 patches, frame-major."""
        B, L, C, h, w = z.shape
        z = z.view(B, L, C, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4, 6)
        return z.reshape(B, L * (h // 2) * (w // 2), C * 4)

    def images(self, images, B, device):
        """The image itself at the output size is the condition (`init_latents`)."""
        return tables(raw=images[0])

    def init_latents(self, run, req, height: int, width: int, device, dtype):
        """The condition: the image at the output size, VAE-encoded (distribution mode)."""
        pipe = self.pipe
        img = pipe.image_processor.resize(run["raw"], height, width)
        pixels = pipe.image_processor.preprocess(img, height, width).unsqueeze(2)
        z = pipe._encode_vae_image(pixels.to(device=device, dtype=dtype), generator=None)
        return tables(run, ref=_pack(z[:, :, 0]), ref_shape=(1, z.shape[3] // 2, z.shape[4] // 2)), req

    def prepare(self, run, cond, h, w, guidance, device):
        shapes = [(1, h // 2, w // 2)] * (self.layers + 1) + [run["ref_shape"]]
        return tables(
            shapes=shapes, rope=_qwen.pos_embed(shapes, cond.txt.shape[1], self.c.axes_dims_rope, True, device)
        )

    def schedule(self, tab, sched):
        """The pipeline's schedule (a copy): sigmas linspace(1, 0, steps + 1)[:-1], mu from
        the condition's token count."""
        steps = len(sched.timesteps)
        sigmas = np.linspace(1.0, 0, steps + 1)[:-1]
        sigmas = None if sched.config.get("use_flow_sigmas", False) else sigmas
        sched = copy.copy(sched)
        sched.set_timesteps(sigmas=sigmas, device=sched.timesteps.device, mu=(tab["ref"].shape[1] / 256) ** 0.5)
        sched.set_begin_index(0)
        return sched

    def predict(self, params, tab, x, t, cond, apply, **extra):
        B, S = x.shape[:2]
        x = torch.cat([x, tab["ref"].expand(B, -1, -1).to(x.dtype)], 1)
        rgb = torch.zeros(B, dtype=torch.long, device=x.device)
        kw = dict(txt_mask=cond.mask, img_shapes=[tab["shapes"]] * B, additional_t_cond=rgb, rope=tab["rope"])
        return apply(params, x, t, cond.txt, **kw)[:, :S], NO_TABLES

    def decode(self, x, h, w, output_type):
        """Every frame but the composite decoded: (B, layers) images per output type."""
        vae, B, L = self.pipe.vae, x.shape[0], self.layers + 1
        z = x.view(B, L, h // 2, w // 2, -1, 2, 2).permute(0, 1, 4, 2, 5, 3, 6).reshape(B, L, -1, h, w)
        z = z.permute(0, 2, 1, 3, 4).to(vae.dtype)  # (B, C, L, h, w)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        z = (z / std + mean)[:, :, 1:]
        z = z.permute(0, 2, 1, 3, 4).reshape(B * self.layers, -1, 1, h, w)
        img = self.pipe.image_processor.postprocess(vae.decode(z, return_dict=False)[0].squeeze(2), output_type)
        if output_type == "pil":
            return [img[b * self.layers : (b + 1) * self.layers] for b in range(B)]
        return img.reshape(B, self.layers, *img.shape[1:])
