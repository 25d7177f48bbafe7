"""Qwen-Image 2.1's product: its text-to-image sampling steps for `fd.sample`
(QwenImage21Pipeline: the Qwen3-VL prompt with its image-slot mask, unpatched latents, one
token per 16x16 pixels, true CFG as two calls, each branch with its own token layout, and
the prefix KV cache per branch, extracted on the first step and read on the later ones, as
the pipeline does), the diffusers adapter's argument map for
``QwenImage21Transformer2DModel`` (with diffusers' ``QwenImage21KVCache`` object, which the
pipelines hand the transformer to fill and read; its forward signature names every
argument), its tiny pipelines' recipes and the bench's inputs
(`functional_dit.pipelines.families.HOOKS`)."""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings

import torch

from sharding.tree import nest

from ... import qwenimage, qwenimage21
from ...qwenimage21 import QwenImage21Config, QwenImage21KVCache
from .. import tiny_parts
from . import _common
from ._common import stock_module
from ._jobs import refuse_args, refuse_layers, refuse_max_area, refuse_reference
from ._latents import pad_to, text_mask
from ._steps import NO_TABLES, Prompt, Steps, tables

# the shared hooks Qwen-Image 2.1 takes as they are (`_common`)
shift, output, tiny_assemble = _common.shift, _common.output, _common.tiny_assemble

# ----------------------------------------------------------------------------- fd.sample

EMBED_ARGS = ()  # embeddings not taken yet: the pipeline encodes its own prompts
EMBEDS_TOGETHER = ()
MAX_SEQUENCE_LENGTH = None
ENCODER_LORA_SCALE = False
CFG_NEEDS_NEGATIVE = True  # true CFG only with a negative prompt (`sampler._requests.true_cfg`)
PER_ITEM_PIPELINES = ("QwenImage21Pipeline",)
CONTROLNET_PIPELINES = ()  # refused without fd.sample(controlnet=...)


class Qwen21(Steps):
    """QwenImage21Pipeline: each prompt keeps its image-slot pads (`Prompt.pad`), with
    CFG each branch its own prompt (`Prompt.uncond`) and its own layout; with the prefix
    KV cache each branch's cache extracted on the first step (returned as an update)."""

    fixed_graph = True  # one fixed device graph per step (`sampler_xla`)
    cfg_on_device = True
    cfg_calls = 2  # with CFG, one model call per branch per step (a step cache keeps a state per call)
    shares_calls = False  # a batch is laid out by its first item (`batch_size`) ...
    # ... but `predict_items` lays several items (sizes, prompt lengths) into one padded layout
    packs_sizes = masks_text = predicts_items = True

    def __init__(self, params, pipe, kv_cache: bool | None):
        self.pipe, self.c = pipe, params.config
        self.kv = params.config.causal_condition if kv_cache is None else bool(kv_cache)
        if self.kv and not self.c.causal_condition:
            raise ValueError(
                "kv_cache: Qwen-Image 2.1's prefix cache needs causal_condition=True; expected None or False"
            )

    def encode(self, run, prompts, msl):
        txt, mask, pad = self.pipe.encode_prompt(prompt=prompts, device=self.pipe._execution_device)
        return Prompt(txt, mask=mask, pad=pad)

    def cfg_batch(self, cond, uncond):
        """Both branches kept apart (their layouts differ); the loop's batch of 2B is split."""
        return dataclasses.replace(cond, uncond=uncond)

    def noise_shape(self, B, h, w):
        return (B, 1, self.c.in_channels, h, w)

    @staticmethod
    def pack(z):
        """(B, 1, C, h, w) -> (B, h·w, C): one token per latent pixel."""
        return z.flatten(3).squeeze(1).transpose(1, 2)

    take = staticmethod(lambda latents: latents)  # latents= given packed

    def prepare(self, run, cond, h, w, guidance, device):
        """Each branch's joint-sequence layout, read from its image-slot mask on the host
        once per run (the steps then read nothing there); no KV cache yet."""
        shape = (1, h, w)
        pads = [cond.pad] + ([] if cond.uncond is None else [cond.uncond.pad])
        layouts = tuple(self._layout(shape, pad, h * w, device) for pad in pads)
        return tables(shape=shape, layouts=layouts, caches=types.MappingProxyType({}))

    @staticmethod
    def _layout(shape, pad, S: int, device):
        slots = torch.cat([pad, pad.new_ones(pad.shape[0], S // 4)], 1)
        return qwenimage21.read_layout(slots, [[shape]] * pad.shape[0], pad.shape[1], S, device)

    def _branch(self, params, tab, apply, i: int, x, t, p):
        """Branch ``i``'s prediction and its KV cache (the one extracted, or the one read)."""
        B, S = x.shape[:2]
        kw = dict(txt_mask=p.mask, img_shapes=[[tab["shape"]]] * B, layout=tab["layouts"][i])
        if not self.kv:
            return apply(params, x, t, p.txt, **kw)[:, -S:], None
        if i not in tab["caches"]:
            out, cache = apply(params, x, t, p.txt, kv_cache="extract", **kw)
            return out[:, -S:], cache
        return apply(params, x, t, p.txt, kv_cache=tab["caches"][i], **kw)[:, -S:], tab["caches"][i]

    def predict(self, params, tab, x, t, cond, apply, **extra):
        """The prediction (each CFG branch its own call); the caches a first step extracted."""
        if cond.uncond is None:
            out, caches = self._branch(params, tab, apply, 0, x, t, cond), None
            pred, caches = out[0], [out[1]]
        else:
            (x1, x2), (t1, t2) = x.chunk(2), t.chunk(2)
            a, b = (
                self._branch(params, tab, apply, 0, x1, t1, cond),
                self._branch(params, tab, apply, 1, x2, t2, cond.uncond),
            )
            pred, caches = torch.cat([a[0], b[0]]), [a[1], b[1]]
        if not self.kv or len(tab["caches"]) == len(caches):
            return pred, NO_TABLES
        return pred, tables(caches=types.MappingProxyType(dict(enumerate(caches))))

    def packs(self, tab) -> bool:
        """Text to image (each branch's prefix its prompt alone, no image slots in it)."""
        return all(lay.prefix == len(lay.text_rows) for lay in tab["layouts"])

    def predict_items(self, params, tabs, xs, ts, conds, apply):
        """Several items' step (`Steps.predict_items`): per CFG branch, the items that have
        it in one padded call (`_Rows`, `_padded_call`); with the KV cache, those that
        extract their branch's cache (their first step) in one call and those that read
        theirs in another. Per item: its rows' prediction ([cond; uncond]) and its caches."""
        parts, start = [], 0
        for j, (tab, x, t, cond) in enumerate(zip(tabs, xs, ts, conds)):
            branches = [cond] if cond.uncond is None else [cond, cond.uncond]
            n = x.shape[0] // len(branches)
            for k, p in enumerate(branches):
                rows = range(start + k * n, start + (k + 1) * n)
                cache = tab["caches"].get(k)
                parts.append(_Rows(j, k, x[k * n : (k + 1) * n], t[k * n : (k + 1) * n], p, tab, cache, rows))
            start += x.shape[0]
        out = {}
        for k in (0, 1):
            for extract in (True, False):
                group = [r for r in parts if r.k == k and (r.cache is None) == extract]
                if group:
                    out.update(self._padded_call(params, apply, group))
        return self._per_item(tabs, parts, out)

    def _per_item(self, tabs, parts, out) -> tuple[list, list]:
        """Each item's prediction (its branches in order) and its new caches (the tables to keep)."""
        preds, updates = [], []
        for j, tab in enumerate(tabs):
            mine = [r for r in parts if r.j == j]
            preds.append(torch.cat([out[r.j, r.k][0] for r in mine]))
            new = {r.k: out[r.j, r.k][1] for r in mine if r.cache is None and self.kv}
            updates.append(tables(caches=types.MappingProxyType({**tab["caches"], **new})) if new else NO_TABLES)
        return preds, updates

    def _padded_call(self, params, apply, group) -> dict:
        """One call over ``group`` (`_Rows` of one branch, all extracting their KV caches or
        all reading them, or no cache): text padded to the longest prompt (``txt_mask``),
        latents to the longest image (``img_valid``), the longest image's layout shared,
        each row's own positions in its RoPE table (`_call_inputs`); each row's caches
        padded to the call's prefix (their padding masked). {(item, branch): (prediction,
        cache)}."""
        T, S = max(r.p.txt.shape[1] for r in group), max(r.x.shape[1] for r in group)
        kw = self._call_inputs(group, T, S)
        x, t = torch.cat([pad_to(r.x, 1, S) for r in group]), torch.cat([r.t for r in group])
        txt, rows = torch.cat([pad_to(r.p.txt, 1, T) for r in group]), [i for r in group for i in r.rows]
        cache = None
        if self.kv:
            cache = "extract" if group[0].cache is None else _padded_cache(self.c, [r.cache for r in group], T)
        got = apply(params, x, t, txt, rows=rows, **kw, **({} if cache is None else {"kv_cache": cache}))
        out, new = got if cache == "extract" else (got, None)
        outs = out[:, -S:].split([r.x.shape[0] for r in group])
        cuts = _cut_caches(self.c, new, group) if new is not None else [r.cache for r in group]
        return {(r.j, r.k): (o[:, : r.x.shape[1]], c) for r, o, c in zip(group, outs, cuts)}

    def _call_inputs(self, group, T: int, S: int) -> dict:
        """fd.apply's layout keywords for ``group`` padded to T text and S latent rows: the
        longest image's layout and grid shared, each row's RoPE table (none where every row
        has one layout: the layout's own positions), the text mask and ``img_valid`` (none
        where nothing is padded: the unmasked kernels)."""
        big = max(group, key=lambda r: r.x.shape[1])
        dev, B, shape = big.x.device, sum(r.x.shape[0] for r in group), big.tab["shape"]
        kw = dict(img_shapes=[[shape]] * B, layout=_shared_layout(T, S, shape, dev))
        mask = torch.cat([pad_to(text_mask(r.p), 1, T) for r in group])
        kw["txt_mask"] = None if bool(mask.all()) else mask
        if any(r.x.shape[1] < S for r in group):
            kw["img_valid"] = torch.cat(
                [(torch.arange(S, device=dev) < r.x.shape[1]).expand(len(r.x), S) for r in group]
            )
        if len({(r.p.txt.shape[1], r.tab["shape"]) for r in group}) > 1:
            kw["rope"] = tuple(torch.cat(a) for a in zip(*(self._row_rope(r, T, S) for r in group)))
        return kw

    def _row_rope(self, r, T: int, S: int) -> tuple:
        """Row group ``r``'s (cos, sin) over the padded layout: its own layout's positions,
        its text rows padded to T, its image rows to S; (n, T + S, D) each."""
        Tr, n = r.p.txt.shape[1], r.x.shape[0]
        pe = qwenimage.rope(r.tab["layouts"][r.k].ids, self.c.axes_dims_rope)
        return tuple(torch.cat([pad_to(a[:Tr], 0, T), pad_to(a[Tr:], 0, S)])[None].expand(n, -1, -1) for a in pe)

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        z = x.transpose(1, 2).reshape(x.shape[0], -1, 1, h, w).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        return z * std + mean


@dataclasses.dataclass(frozen=True)
class _Rows:
    """One item's rows of one CFG branch in a step: item ``j``, branch ``k``, latents x
    (n, S, C), timesteps t (n,), its `Prompt` p, the item's tables, its branch's KV cache
    (None: none yet) and the rows' indices among the step's rows (their adapters)."""

    j: int
    k: int
    x: torch.Tensor
    t: torch.Tensor
    p: Prompt
    tab: object
    cache: object
    rows: range


@functools.lru_cache(maxsize=64)
def _shared_layout(T: int, S: int, shape: tuple, device) -> qwenimage21.Layout:
    """A padded call's layout: T text rows, then the target's S latent rows (the grid
    ``shape``), read on the host once per (T, S, shape, device)."""
    return qwenimage21.read_layout(torch.tensor([[False] * T + [True] * (S // 4)]), [[shape]], T, S, device)


def _padded_cache(config, caches: list, P: int) -> QwenImage21KVCache:
    """Several rows' prefix caches as one over a prefix of P tokens: each padded with
    zeros (the call's ``txt_mask`` hides them), rows in order."""
    flats = [c.flat() for c in caches]
    tree = {key: torch.cat([pad_to(f[key], 1, P) for f in flats]) for key in flats[0]}
    return QwenImage21KVCache(config, P, nest(tree))


def _cut_caches(config, cache: QwenImage21KVCache, group) -> list:
    """A padded call's extracted cache cut to each row group's rows and its own prefix
    (its prompt's length): the cache it extracts alone."""
    flat, out, start = cache.flat(), [], 0
    for r in group:
        n, P = r.x.shape[0], r.p.txt.shape[1]
        tree = {key: v[start : start + n, :P] for key, v in flat.items()}
        out.append(QwenImage21KVCache(config, P, nest(tree)))
        start += n
    return out


def steps(params, pipe, image, kv_cache) -> Steps:
    return Qwen21(params, pipe, kv_cache)


def size(pipe, call) -> tuple:
    """The output size: the pipeline's ``output_resolution`` (1024) where height or width is None."""
    height, width, multiple = call.height, call.width, pipe.vae_scale_factor * 2
    if height is None or width is None:
        res = 1024 if call.output_resolution is None else call.output_resolution
        if not isinstance(res, int) or isinstance(res, bool) or res < multiple:
            raise ValueError(f"output_resolution: expected an int >= {multiple}, got {res!r}")
        height, width = (height or res) // multiple * multiple, (width or res) // multiple * multiple
    refuse_max_area(call.max_area)
    return height, width


IMAGE_INPUTS = _common.IMAGE_INPUTS  # no image input (its output_resolution is a size)


def image_job(pipe, call) -> tuple:
    """(the pipeline, None): Qwen-Image 2.1 samples text to image only."""
    refuse_layers(pipe, call.layers)
    refuse_args(pipe, call.strength, call.mask_image, call.padding_mask_crop)
    refuse_reference(call.image_reference)
    return pipe, None


def pipeline_class(components) -> str:
    return "QwenImage21Pipeline"


def batch_size(batch_size: int | None) -> int | None:
    """Images per model call. Qwen-Image 2.1 lays a batch out by its first item (diffusers'
    transformer reads ``img_mask[0]``: "samples share a layout"), so prompts of other lengths
    in one call move each image's tokens (measured on the tiny model: image 0 of two prompts
    differs from the prompt alone by 0.048, max |latent| 4.8; the stock pipeline does the same).
    There, None means one image per call, so an image does not depend on its batch (docs/sampling.md);
    a larger ``batch_size`` is honoured with a warning."""
    if batch_size is None:
        return 1
    if batch_size > 1:
        warnings.warn(
            f"batch_size={batch_size} with Qwen-Image 2.1: prompts of different lengths in one model call change "
            "each other's images (its batch shares the first prompt's layout; about 1% of the latents' range on the "
            "tiny model); batch_size=1 (the default here) makes every image as it is made alone",
            stacklevel=3,
        )
    return batch_size


# ----------------------------------------------------------------------------- the adapter

ADAPTER_ARGS = {"encoder_hidden_states_mask", "img_shapes", "img_mask", "attention_kwargs", "kv_cache"}
ADAPTER_ARGS |= {"kv_cache_mode"}
PROCESSORS = {
    "transformer_blocks": (
        {"QwenImage21AttnProcessor", "QwenImage21FlexAttnProcessor"},
        "transformer_qwenimage21:QwenImage21AttnProcessor",
    ),
}
NAMED_FORWARD = True
IP_ADAPTER = False
broadcast = _common.broadcast_qwen


def _layers(kv_cache) -> list:
    layers = getattr(kv_cache, "layer_caches", None)
    if layers is None:
        raise ValueError(
            "kv_cache: expected diffusers' QwenImage21KVCache (or fd.QwenImage21KVCache), "
            f"got {type(kv_cache).__name__}"
        )
    return layers


def _from_diffusers_cache(config, kv_cache) -> QwenImage21KVCache:
    """The tensors an extract call stored in diffusers' cache object, as our cache."""
    if isinstance(kv_cache, QwenImage21KVCache):
        return kv_cache
    layers = _layers(kv_cache)
    if any(layer.k is None for layer in layers):
        raise ValueError("kv_cache: kv_cache_mode='cached' needs a cache an 'extract' call filled; this one is empty")
    tree = {str(i): {"k": layer.k, "v": layer.v} for i, layer in enumerate(layers)}
    return QwenImage21KVCache(config, layers[0].k.shape[1] if layers else 0, {"transformer_blocks": tree})


def adapter_args(
    adapter,
    encoder_hidden_states_mask=None,
    img_shapes=None,
    img_mask=None,
    attention_kwargs=None,
    kv_cache=None,
    kv_cache_mode=None,
) -> dict:
    adapter._lora_scale("attention_kwargs", attention_kwargs)
    args = dict(txt_mask=encoder_hidden_states_mask, img_shapes=img_shapes, img_mask=img_mask)
    if kv_cache is None and kv_cache_mode is not None:
        raise ValueError(f"kv_cache_mode: {kv_cache_mode!r}, but no kv_cache was passed to hold the prefix")
    if kv_cache is None:
        return args
    if kv_cache_mode == "extract":
        _layers(kv_cache)
        return dict(args, kv_cache="extract")
    if kv_cache_mode == "cached":
        return dict(args, kv_cache=_from_diffusers_cache(adapter.params.config, kv_cache))
    raise ValueError(f"kv_cache_mode: expected 'extract' or 'cached' with a kv_cache, got {kv_cache_mode!r}")


def adapter_result(out, kwargs):
    """An extract call: store the cache in the pipeline's object, return the output."""
    if not isinstance(out, tuple):
        return out
    out, cache = out
    target = kwargs["kv_cache"]
    if not isinstance(target, QwenImage21KVCache):
        for i, layer in enumerate(_layers(target)):
            kv = cache["transformer_blocks"][str(i)]
            layer.store(kv["k"], kv["v"])
    return out


def pos_embed(c):
    return stock_module("qwenimage21", "QwenImage21Rope", theta=10000, axes_dim=list(c["axes_dims_rope"]))


# ----------------------------------------------------------------------------- tiny pipelines


def tiny_config_changes(kind: str) -> dict:
    """Qwen3-VL's width."""
    return dict(context_in_dim=tiny_parts.VL_DIM)


def tiny_components(kind: str, seed: int) -> dict:
    """A Qwen3-VL encoder and processor, the ×16 VAE."""
    proc = tiny_parts.qwen3vl_processor()
    parts = {"text_encoder": tiny_parts.qwen3vl_encoder(proc.tokenizer, seed)}
    return parts | {"scheduler": tiny_parts.scheduler(), "vae": tiny_parts.qwen21_vae(seed), "processor": proc}


# ----------------------------------------------------------------------------- bench, check

MID_CONFIG = QwenImage21Config(
    in_channels=64,
    out_channels=64,
    num_layers=10,
    attention_head_dim=64,
    num_attention_heads=8,
    context_in_dim=512,
    axes_dims_rope=(8, 28, 28),
)
RELEASED = "qwen-image-2.1"
BENCH_CACHE = None  # no step cache yet
CHECK_EAGER_ONLY = "Qwen-Image 2.1 reads img_mask on the host (not traceable yet)"


def bench_inputs(config, x, t, txt, h, w, device, dtype, g):
    """Text to image: the text rows, then one image slot per 2x2 latent patch."""
    kw, dkw = _common.qwen_inputs(x, t, txt, h, w)
    img_mask = torch.tensor([False] * txt.shape[1] + [True] * (h * w // 4), device=device)[None]
    kw["img_mask"] = dkw["img_mask"] = img_mask
    return kw, dkw


# ----------------------------------------------------------------------------- the trainer

TRAIN_PIPELINES = ("QwenImage21Pipeline",)
TRAIN_LATENT_MULTIPLE = 32  # its x16 VAE, one image slot per 2x2 latent patch
TRAIN_TEXTS_TOGETHER = _common.TRAIN_TEXTS_TOGETHER
TRAIN_SECOND = "txt_mask"  # captions padded to the batch's longest, masked


def train_latent(pipe, image):
    """A one-frame RGBA (opaque) video latent, normalised, unpatched (`_common.video_latent`)."""
    return _common.video_latent(pipe, image, rgba=True, patched=False)


def train_texts(pipe, captions: list, every: list, max_len: int) -> list:
    """Each caption's embeddings and mask: its own template and length (no
    max_sequence_length), text only."""
    return [_common.masked_text(*pipe.encode_prompt(c, device=torch.device("cpu"))[:2]) for c in captions]


def train_inputs(batch: dict, txt_len: int) -> dict:
    """The joint sequence's image-slot mask: the text rows, then one slot per 2x2 latent patch."""
    return {"img_mask": torch.tensor([False] * txt_len + [True] * (batch["latents"].shape[1] // 4))}
