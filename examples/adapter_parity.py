"""Every supported diffusers pipeline, stock transformer vs `fd.DiffusersTransformer`:
the max latent difference and the wall time of one pipeline call each, on the tiny
offline pipelines of `functional_dit.tiny` (fp32, CPU, random weights). A benchmark
that prints figures, not a test.

    python examples/adapter_parity.py [--repeats 3] [--dtype bfloat16] [--threads 1]

Times are the best of ``--repeats`` calls (after one warm-up call): the whole call,
dominated on these tiny models by the text encoders and VAEs, which both runs share,
and the time spent inside the transformer (forward hooks). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import PIL.Image
import torch

import functional_dit as fd
from functional_dit import tiny

PROMPT = "a red cube on a wooden table"
IMAGE = PIL.Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))
IMAGE2 = PIL.Image.fromarray((np.random.RandomState(1).rand(64, 64, 3) * 255).astype("uint8"))
SHORT = dict(max_sequence_length=64)
CASES = {  # name -> (kind, call arguments), as in tests/test_adapter.py
    "FluxPipeline (true CFG)": ("flux", dict(prompt=PROMPT, negative_prompt="blurry", true_cfg_scale=2.0, **SHORT)),
    "FluxKontextPipeline": ("flux-kontext", dict(prompt=PROMPT, image=IMAGE, max_area=32 * 32, _auto_resize=False)),
    "Flux2Pipeline (reference)": ("flux2", dict(prompt=PROMPT, image=IMAGE, max_sequence_length=256)),
    "Flux2KleinPipeline (CFG, reference)": (
        "flux2-klein",
        dict(prompt=PROMPT, image=IMAGE, guidance_scale=2.0, **SHORT),
    ),
    "Flux2KleinKVPipeline (3 steps)": (
        "flux2-klein-kv",
        dict(prompt=PROMPT, image=IMAGE, num_inference_steps=3, **SHORT),
    ),
    "QwenImagePipeline (ragged, true CFG)": (
        "qwen-image",
        dict(prompt=["a cat", PROMPT + " under a lamp"], negative_prompt="blurry", true_cfg_scale=2.0),
    ),
    "QwenImageEditPipeline": ("qwen-image-edit", dict(prompt=PROMPT, image=IMAGE)),
    "QwenImageEditPlusPipeline (2 images)": ("qwen-image-edit-plus", dict(prompt=PROMPT, image=[IMAGE, IMAGE2])),
}


def call(pipe, kwargs) -> torch.Tensor:
    args = dict(height=32, width=32, num_inference_steps=2, output_type="latent")
    args.update(kwargs)
    return pipe(generator=torch.Generator().manual_seed(0), **args).images


def timed(pipe, kwargs, repeats: int) -> tuple[torch.Tensor, float, float]:
    """(latents, best seconds per pipeline call, best seconds inside the transformer per call)."""
    inside = [0.0]
    pipe.transformer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] - time.perf_counter()))
    pipe.transformer.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] + time.perf_counter()))
    out = call(pipe, kwargs)
    best, best_inside = float("inf"), float("inf")
    for _ in range(repeats):
        inside[0] = 0.0
        start = time.perf_counter()
        call(pipe, kwargs)
        best, best_inside = min(best, time.perf_counter() - start), min(best_inside, inside[0])
    return out, best, best_inside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier timings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    head = ["max abs latent diff", "call s: stock / adapter", "transformer s: stock / adapter"]
    print(f"| pipeline ({args.dtype}, CPU) | " + " | ".join(head) + " |")
    print("|---|---|---|---|")
    for name, (kind, kwargs) in CASES.items():
        stock, t_stock, in_stock = timed(tiny.pipeline(kind, seed=3, dtype=dtype), kwargs, args.repeats)
        params = fd.init(tiny.transformer_config(kind), seed=3, dtype=dtype)
        pipe = tiny.pipeline(kind, seed=3, dtype=dtype, transformer=fd.DiffusersTransformer(params))
        ours, t_ours, in_ours = timed(pipe, kwargs, args.repeats)
        diff = (ours.float() - stock.float()).abs().max().item()
        print(f"| {name} | {diff:.3g} | {t_stock:.2f} / {t_ours:.2f} | {in_stock:.3f} / {in_ours:.3f} |")


if __name__ == "__main__":
    main()
