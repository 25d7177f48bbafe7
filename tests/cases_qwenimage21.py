"""Tiny Qwen-Image 2.1 configs and example inputs (layouts of text, condition-image slots
and the target), shared by the parity and sharding tests."""

from __future__ import annotations

import math

import torch

import functional_dit as fd

TINY = fd.PRESETS["qwen-image-2.1-tiny"]  # causal_condition on, 4 heads x 16
TINY_NC = fd.QwenImage21Config(  # causal_condition off; odd sizes elsewhere
    in_channels=12,
    out_channels=6,
    num_layers=1,
    attention_head_dim=12,
    num_attention_heads=2,
    context_in_dim=20,
    mlp_ratio=2,
    axes_dims_rope=(2, 4, 6),
    eps=1e-5,
    causal_condition=False,
)

# Layouts: the encoder sequence as runs of ("txt", n) text rows and ("img", h, w) condition
# images (h * w / 4 slots each), then the target (h, w) whose slots are appended.
LAYOUTS = {
    "t2i": ([("txt", 5)], (2, 4)),
    "edit": ([("txt", 3), ("img", 2, 4), ("txt", 2)], (2, 2)),
    # two condition images back to back (one run of slots, two blocks), then no text
    "adjacent": ([("txt", 2), ("img", 2, 2), ("img", 4, 2)], (4, 2)),
    "text-last": ([("img", 2, 2), ("txt", 4)], (2, 6)),
}


def _slots(runs) -> tuple[list, list]:
    slots, shapes = [], []
    for run in runs:
        if run[0] == "txt":
            slots += [False] * run[1]
        else:
            slots += [True] * (run[1] * run[2] // 4)
            shapes.append((1, run[1], run[2]))
    return slots, shapes


def inputs(config, layout="edit", batch=2, ragged=False, seed=0, dtype=torch.float32) -> dict:
    """Keyword arguments for `fd.apply`: x (condition latents then the target's), t, txt
    over the encoder sequence, img_shapes, img_mask, and a ragged txt_mask when asked
    (sample b drops its last b text rows)."""
    runs, target = LAYOUTS[layout]
    slots, shapes = _slots(runs)
    shapes.append((1, *target))
    T, S = len(slots), sum(math.prod(s) for s in shapes)
    g = torch.Generator().manual_seed(seed)
    kw = dict(
        x=torch.randn(batch, S, config.in_channels, generator=g).to(dtype),
        t=torch.rand(batch, generator=g),
        txt=torch.randn(batch, T, config.context_in_dim, generator=g).to(dtype),
        img_shapes=[list(shapes)] * batch,
        img_mask=torch.tensor(slots + [True] * (math.prod(target) // 4)).expand(batch, -1).clone(),
    )
    if ragged:
        mask = torch.ones(batch, T, dtype=torch.bool)
        text = [i for i, s in enumerate(slots) if not s]
        for b in range(batch):
            for i in text[len(text) - b :] if b else []:
                mask[b, i] = False
        kw["txt_mask"] = mask
    return kw


def diffusers_kwargs(kw: dict, kv_cache=None, mode=None) -> dict:
    """The same inputs under `QwenImage21Transformer2DModel.forward`'s argument names."""
    return dict(
        hidden_states=kw["x"],
        encoder_hidden_states=kw["txt"],
        timestep=kw["t"],
        img_shapes=kw["img_shapes"],
        img_mask=kw["img_mask"],
        encoder_hidden_states_mask=kw.get("txt_mask"),
        kv_cache=kv_cache,
        kv_cache_mode=mode,
        return_dict=False,
    )


def fix_bf16_buffers(module) -> None:
    """``module.to(bf16)`` also rounds the sinusoidal frequency buffer to bf16, which
    ``from_pretrained(torch_dtype=bf16)`` (a real pipeline) does not: keep it fp32."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TemporalTimesteps

    module.time_text_embed.time_proj.freqs = QwenImage21TemporalTimesteps(256).freqs
