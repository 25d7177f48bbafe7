"""Offline demo: a tiny FLUX.1 transformer built locally, run as a pure function with
`fd.apply`, checked against diffusers' `FluxTransformer2DModel` at the same weights.

    python examples/demo.py

Prints the max abs error and the time of both, side by side in one run.
"""

from __future__ import annotations

import time

import diffusers
import torch

import functional_dit as fd


def diffusers_module(params):
    cfg = fd.config_to_diffusers(params.config)
    module = getattr(diffusers, cfg["_class_name"])(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    module.load_state_dict(fd.to_state_dict(params))
    return module.eval().requires_grad_(False)


def flux1_inputs(c, batch=2, txt_len=16, h=8, w=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(h * w, 3).float()
    return dict(
        x=torch.randn(batch, h * w, c.in_channels, generator=g),
        t=torch.full((batch,), 0.7),
        txt=torch.randn(batch, txt_len, c.joint_attention_dim, generator=g),
        pooled=torch.randn(batch, c.pooled_projection_dim, generator=g),
        guidance=torch.full((batch,), 3.5) if c.guidance_embeds else None,
        img_ids=img_ids,
        txt_ids=torch.zeros(txt_len, 3),
    )


def timed(fn, repeats=5):
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    return out, (time.perf_counter() - start) / repeats


def main():
    torch.manual_seed(0)
    params = fd.init(fd.PRESETS["flux1-tiny"], seed=0)
    module = diffusers_module(params)
    kw = flux1_inputs(params.config)
    ref_kw = dict(
        hidden_states=kw["x"],
        timestep=kw["t"],
        encoder_hidden_states=kw["txt"],
        pooled_projections=kw["pooled"],
        guidance=kw["guidance"],
        img_ids=kw["img_ids"],
        txt_ids=kw["txt_ids"],
        return_dict=False,
    )
    with torch.inference_mode():
        out, t_fd = timed(lambda: fd.apply(params, **kw))
        (ref,), t_ref = timed(lambda: module(**ref_kw))
    err = (out - ref).abs().max().item()
    print(f"model      flux1-tiny, {fd.num_params(params.config):,} parameters, output {tuple(out.shape)}")
    print(f"max error  {err:.3g} (fd.apply vs diffusers FluxTransformer2DModel, fp32)")
    print(f"time       fd.apply {t_fd * 1e3:.2f} ms, diffusers {t_ref * 1e3:.2f} ms, ratio {t_fd / t_ref:.2f}")
    if err > 1e-5:
        raise SystemExit(f"parity check failed: max error {err:.3g} > 1e-5")


if __name__ == "__main__":
    main()
