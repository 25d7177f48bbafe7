"""The stock pipelines' keyword arguments `fd.sample` takes besides its own, each checked
before anything heavy runs and taken with the stock meaning, or refused by name where it
cannot apply (docs/sampling.md, "Stock arguments"). The reference is each pipeline's
``__call__`` in diffusers 0.42 (``pipeline_flux.py``, ``pipeline_flux2.py``,
``pipeline_qwenimage*.py``, ``pipeline_qwenimage21.py``):

- ``prompt_2`` / ``negative_prompt_2`` (FLUX.1): the T5 prompt, the CLIP encoder keeping
  ``prompt`` (``encode_prompt(prompt, prompt_2)``; None: ``prompt``);
- ``joint_attention_kwargs`` (FLUX.1) / ``attention_kwargs`` (the others): only their LoRA
  ``scale`` has a meaning here, multiplying every ``lora=`` scale (the stock
  ``scale_lora_layers`` on the transformer) and passed to FLUX.1's ``encode_prompt`` as
  ``lora_scale`` (its text encoders' LoRA); any other key is refused;
- ``callback_on_step_end_tensor_inputs``: which tensors ``callback_on_step_end`` gets
  (names from the pipeline's ``_callback_tensor_inputs``; "latents" by default); the
  callback may replace the latents, not the prompt embeddings;
- ``masked_image_latents`` (FLUX.1 and Qwen-Image inpainting): checked and not used, as the
  stock loop never reads them (given, they only spare the stock pipeline a VAE encode);
- ``text_encoder_out_layers`` (FLUX.2): the text encoder's hidden layers stacked;
- ``use_kv_cache`` (Qwen-Image 2.1's name for ``kv_cache``): either, or both equal;
- ``_auto_resize`` (Kontext): the reference resized to a preferred Kontext resolution
  (True, the default) or only floored to the VAE multiple;
- ``cfg_normalize`` (Qwen-Image-Layered): true CFG rescaled to the conditional norm;
- ``resolution`` (Qwen-Image-Layered: 640 or 1024, 640 by default) / ``output_resolution``
  (Qwen-Image 2.1: 1024 by default): the output size, as stock, when ``height`` and
  ``width`` are not given (Layered: its image's aspect ratio at about resolution² pixels,
  the stock ``calculate_dimensions``; Qwen-Image 2.1: a missing side is output_resolution),
  floored to the VAE multiple as stock;
- refused: ``use_en_prompt`` (Layered: the caption language; `fd.sample` never captions),
  ``caption_upsample_temperature`` (FLUX.2: its prompt upsampling samples text from torch's
  global random state; ``pipe.upsample_prompt`` first gives the same prompt),
  the FLUX.1 IP-Adapter's images (``ip_adapter_image``, ``negative_ip_adapter_image``:
  they need the stock CLIP image encoder, which `fd.sample` does not run; the embeddings
  are taken), and every argument the pipeline class itself does not take;
- ``ip_adapter_image_embeds`` with ``negative_ip_adapter_image_embeds`` (FLUX.1): the
  image prompt through the IP-Adapter loaded on the pipeline's transformer
  (``pipe.load_ip_adapter``; its weights and ``set_ip_adapter_scale`` scales), one (1, I, E)
  embedding per adapter shared by every image as stock repeats it, the negative in the
  uncond CFG branch. Both are required: for a missing one the stock pipeline encodes a
  black image with the CLIP image encoder.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers

import torch

from ..families import product as _product

# Arguments taken by no pipeline fd.sample drives with a meaning here, and why.
REFUSED = {
    "use_en_prompt": (
        "it picks the language of the caption QwenImageLayeredPipeline writes when the prompt is empty; "
        "fd.sample encodes the prompt as given and never captions the image"
    ),
    "caption_upsample_temperature": (
        "Flux2Pipeline's prompt upsampling samples new prompt text with its text encoder (generate with "
        "do_sample=True) from torch's global random state, not from the seed, so the image would depend on more than "
        "its prompt, seed and settings (and each rank of a mesh would sample its own text); upsample with the stock "
        "method first, prompt = pipe.upsample_prompt(prompt, images=image, temperature=t), and pass the result as "
        "prompt (what the stock pipeline then encodes)"
    ),
    "ip_adapter_image": (
        "fd.sample does not run the IP-Adapter's CLIP image encoder; pass the image embeddings (the pipeline's "
        "prepare_ip_adapter_image_embeds gives them) as ip_adapter_image_embeds"
    ),
    "negative_ip_adapter_image": (
        "fd.sample does not run the IP-Adapter's CLIP image encoder; pass negative_ip_adapter_image_embeds"
    ),
}
# `fd.sample`'s keyword arguments that `take` checks and maps (besides masked_image_latents,
# resolution and output_resolution, checked where the job and the size are known).
NAMES = (
    "prompt_2", "negative_prompt_2", "joint_attention_kwargs", "attention_kwargs", "callback_on_step_end_tensor_inputs",
    "text_encoder_out_layers", "use_kv_cache", "_auto_resize", "cfg_normalize", "use_en_prompt", "ip_adapter_image",
    "negative_ip_adapter_image", "ip_adapter_image_embeds", "negative_ip_adapter_image_embeds",
    "caption_upsample_temperature",
)  # fmt: skip
# The stock names of `fd.sample`'s own arguments where a pipeline spells them otherwise.
ALIASES = {"use_kv_cache": "kv_cache"}


@dataclasses.dataclass(frozen=True)
class StockArgs:
    """The checked stock arguments of one `fd.sample` call: the per-prompt second prompts
    (FLUX.1), the LoRA scale, the callback's tensor names and the text encoders' options."""

    prompts_2: list | None = None
    negatives_2: list | None = None
    lora_scale: float | None = None
    tensor_inputs: tuple = ("latents",)
    encode: dict = dataclasses.field(default_factory=dict)  # extra encode_prompt keywords
    cfg_normalize: bool | None = None
    ip: tuple | None = None  # FLUX.1 IP-Adapter: (the conditional, the negative) `fd.apply` ip_adapter dicts

    def encode_options(self, prompts_2: list | None) -> dict:
        """The family's ``encode`` keywords: ``encode``, and ``prompt_2`` (one per prompt) if given."""
        return self.encode if prompts_2 is None else {**self.encode, "prompt_2": prompts_2}


def take(pipe, fam: str, prompts: int, req, adapters, given: dict, cache, sharded: bool, callback):
    """The checked `StockArgs` of ``given`` (`NAMES`) for ``prompts`` prompts of ``req``, and
    the per-image LoRA ``adapters`` scaled by the attention kwargs' ``scale``; raises on the
    first argument refused."""
    refuse_untaken(pipe, given)
    scale = lora_scale(pipe, given["joint_attention_kwargs"], given["attention_kwargs"])
    encode = encoder_layers(given["text_encoder_out_layers"])
    if _product(fam).ENCODER_LORA_SCALE and scale is not None:
        encode["lora_scale"] = scale  # FluxPipeline scales its text encoders' LoRA by it
    pos, neg = given["ip_adapter_image_embeds"], given["negative_ip_adapter_image_embeds"]
    stock = StockArgs(
        prompts_2=second_prompts(given["prompt_2"], "prompt_2", prompts, bool(req.embeds)),
        negatives_2=second_prompts(given["negative_prompt_2"], "negative_prompt_2", prompts, bool(req.negative_embeds)),
        tensor_inputs=tensor_inputs(pipe, given["callback_on_step_end_tensor_inputs"], callback),
        encode=encode,
        cfg_normalize=given["cfg_normalize"],
        ip=ip_adapter(pipe, pos, neg, sharded, cache),
    )
    return stock, scaled(adapters, scale)


def takes(pipe, name: str) -> bool:
    """Whether ``pipe``'s class takes ``name`` in ``__call__`` (the stock signature)."""
    return name in inspect.signature(type(pipe).__call__).parameters


def refuse_untaken(pipe, given: dict) -> None:
    """A ValueError for the first argument given (not None) that is refused outright or that
    ``pipe``'s class does not take."""
    for name, value in given.items():
        if value is None:
            continue
        if name in REFUSED:
            raise ValueError(f"{name}: not taken by fd.sample: {REFUSED[name]}; expected None")
        if not takes(pipe, name):
            raise ValueError(
                f"{name}: a {type(pipe).__name__} takes no {name} (the stock pipeline's arguments); expected None, "
                f"got {value!r:.80}"
            )


def kv_cache(kv_cache, use_kv_cache):
    """``kv_cache`` or its stock spelling ``use_kv_cache`` (Qwen-Image 2.1): one of them, or
    both with the same value."""
    if use_kv_cache is None:
        return kv_cache
    if not isinstance(use_kv_cache, bool):
        raise ValueError(f"use_kv_cache: expected None or a bool, got {use_kv_cache!r}")
    if kv_cache is not None and kv_cache != use_kv_cache:
        raise ValueError(
            f"use_kv_cache: the stock name of kv_cache; expected the same value or None, got use_kv_cache="
            f"{use_kv_cache!r} with kv_cache={kv_cache!r}"
        )
    return use_kv_cache


def lora_scale(pipe, joint_attention_kwargs, attention_kwargs) -> float | None:
    """The LoRA ``scale`` of the attention-kwargs argument ``pipe`` takes (None: absent);
    a ValueError for any other key or a scale that is not a finite real number."""
    for name, kwargs in (("joint_attention_kwargs", joint_attention_kwargs), ("attention_kwargs", attention_kwargs)):
        if kwargs is None:
            continue
        if not isinstance(kwargs, dict):
            raise ValueError(f"{name}: expected None or a dict such as {{'scale': 0.5}}, got {kwargs!r:.80}")
        extra = sorted(set(kwargs) - {"scale"})
        if extra:
            raise ValueError(
                f"{name}: only the LoRA 'scale' has a meaning in fd.sample (it scales the lora= adapters); "
                f"expected None, {{}} or {{'scale': float}}, got keys {extra}"
            )
        scale = kwargs.get("scale")
        if scale is None:
            return None
        if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
            raise ValueError(f"{name}: 'scale' must be a finite real number, got {scale!r}")
        return float(scale)
    return None


def scaled(items: tuple | None, scale: float | None) -> tuple | None:
    """Per image, its ``(adapter, scale)`` pairs (`sampler._lora.per_image`) with every scale
    times ``scale``: the stock ``scale_lora_layers(transformer, scale)``."""
    if scale is None or items is None:
        return items
    return tuple(tuple((ad, s * scale) for ad, s in pairs) for pairs in items)


def tensor_inputs(pipe, names, callback_on_step_end) -> tuple:
    """The checked ``callback_on_step_end_tensor_inputs`` (stock default ``["latents"]``):
    names from the pipeline's ``_callback_tensor_inputs`` that `fd.sample` has."""
    if names is None:
        return ("latents",)
    allowed = [n for n in getattr(pipe, "_callback_tensor_inputs", ["latents"]) if n in HANDED]
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"callback_on_step_end_tensor_inputs: expected a list of names, got {names!r:.80}")
    bad = [n for n in names if n not in allowed]
    if bad:
        raise ValueError(
            f"callback_on_step_end_tensor_inputs: expected names from {allowed} (a {type(pipe).__name__}'s "
            f"_callback_tensor_inputs that fd.sample hands over), got {bad}"
        )
    if names and callback_on_step_end is None:
        raise ValueError("callback_on_step_end_tensor_inputs: expected it with a callback_on_step_end, got none")
    return tuple(names)


HANDED = ("latents", "prompt_embeds")  # the callback tensors fd.sample has (not ControlNet's control_image)


def second_prompts(value, name: str, P: int, embeds_given: bool) -> list | None:
    """FLUX.1's ``prompt_2`` / ``negative_prompt_2``: None, a string (every prompt) or one
    string per prompt; refused with prompt embeddings, as the stock pipeline refuses it."""
    if value is None:
        return None
    if embeds_given:
        raise ValueError(f"{name}: expected None with prompt embeddings (the T5 prompt is already encoded)")
    vals = [value] * P if isinstance(value, str) else value
    if not isinstance(vals, (list, tuple)) or len(vals) != P or not all(isinstance(v, str) for v in vals):
        raise ValueError(f"{name}: expected a string or {P} strings (one per prompt), got {value!r:.80}")
    return list(vals)


def encoder_layers(value) -> dict:
    """FLUX.2's ``text_encoder_out_layers`` as an ``encode_prompt`` keyword ({} when None)."""
    if value is None:
        return {}
    ok = isinstance(value, (list, tuple)) and value
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"text_encoder_out_layers: expected a tuple of layer indices, got {value!r:.80}")
    return {"text_encoder_out_layers": tuple(value)}


def check_masked_latents(value, model, n: int, h: int, w: int) -> None:
    """``masked_image_latents`` of an inpainting job: a tensor of the stock shape (b, C, h, w)
    (Qwen-Image also (b, C, 1, h, w)) at the latent grid, b dividing the image count. The
    stock loop never reads them, so they are only checked."""
    if value is None:
        return
    if not getattr(model, "inpaints", False):
        raise ValueError(
            "masked_image_latents: taken for FLUX.1 and Qwen-Image inpainting (with mask_image); expected None"
        )
    C = model.latent_channels
    ok = isinstance(value, torch.Tensor) and value.ndim in (4, 5) and value.shape[0] >= 1 and n % value.shape[0] == 0
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    if ok:
        z = value if value.ndim == 4 else value[:, :, 0]
        ok = (value.ndim == 4 or value.shape[2] == 1) and tuple(z.shape[1:]) == (C, h, w)
    if not ok:
        raise ValueError(
            f"masked_image_latents: expected a tensor (b, {C}, {h}, {w}) with b dividing {n} (the stock latent "
            f"layout), got {shape}"
        )


def size(pipe, resolution, output_resolution) -> None:
    """``resolution`` / ``output_resolution`` refused where the pipeline takes none (the
    family's ``size`` hook sizes the output from them: Layered, Qwen-Image 2.1)."""
    refuse_untaken(pipe, {"resolution": resolution, "output_resolution": output_resolution})


def ip_adapter(pipe, pos, neg, sharded: bool, cache) -> tuple | None:
    """FLUX.1's IP-Adapter inputs for `fd.apply` (``ip_adapter=``) from the embeddings and the
    IP-Adapter loaded on ``pipe.transformer``: (conditional, negative) dicts, or None."""
    if pos is None and neg is None:
        return None
    for name, v, other in (("ip_adapter_image_embeds", pos, neg), ("negative_ip_adapter_image_embeds", neg, pos)):
        if v is None:
            raise ValueError(
                f"{name}: expected it with the {'negative ' if other is pos else ''}ones too; for a missing one the "
                "stock pipeline encodes a black image with the IP-Adapter's CLIP image encoder, which fd.sample "
                "does not run"
            )
        tensors = v if isinstance(v, list) else [v]
        if not all(isinstance(e, torch.Tensor) and e.ndim == 3 and e.shape[0] == 1 for e in tensors):
            raise ValueError(
                f"{name}: expected a list of (1, I, E) tensors, one per loaded IP-Adapter (the stock pipeline repeats "
                f"it for every image), got {[tuple(e.shape) if isinstance(e, torch.Tensor) else e for e in tensors]}"
            )
    if sharded:
        raise ValueError("ip_adapter_image_embeds: the IP-Adapter runs on plain params only (not on a mesh) yet")
    # the adapter loads peft (an optional dependency, not in the demo's install): imported on first use
    from ..adapter import ip_adapter_input

    module = getattr(pipe, "transformer", None)
    return ip_adapter_input(module, list(pos) if isinstance(pos, list) else [pos]), ip_adapter_input(
        module, list(neg) if isinstance(neg, list) else [neg]
    )


def ip_calls(apply, ip: tuple | None, cfg: bool):
    """``apply`` (`fd.apply`'s signature) with the IP-Adapter's inputs for each call's rows:
    each image's embedding in the conditional rows, the negative in the CFG rows."""
    if ip is None:
        return apply

    def with_ip(params, x, t, txt, **kwargs):
        n = x.shape[0] // 2 if cfg else x.shape[0]
        rows = lambda e, k: e.to(x.device).expand(k, *e.shape[1:])  # noqa: E731
        pos, neg = ip
        embeds = [
            torch.cat([rows(p, n), rows(q, n)]) if cfg else rows(p, n)
            for p, q in zip(pos["image_embeds"], neg["image_embeds"], strict=True)
        ]
        return apply(params, x, t, txt, ip_adapter={**pos, "image_embeds": embeds}, **kwargs)

    return with_ip
