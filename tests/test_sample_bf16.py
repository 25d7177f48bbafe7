"""`fd.sample` in bf16 against the stock ``QwenImagePipeline`` (stock transformer in bf16,
same seed): two prompts with true CFG, 64x64, 4 steps, on the tiny offline pipeline.

``fd.sample`` runs both CFG branches in one call on ``[cond; uncond]``, the shorter
branch's text padded with masked tokens to the longer one's length; the stock pipeline
calls the transformer once per branch, each on its own text. In fp32 the two agree to
~2e-6 (tests/test_sample.py). In bf16 the padded attention rounds differently: with
texts of one length (nothing padded) the latents are within 1 ulp of the stock's
(bitwise on the CPU measured); with ragged
texts they differ by 1.5 bf16 ulps (docs/numerics.md, "bf16 sampling with true CFG").
"""

from __future__ import annotations

import pytest
import torch

import functional_dit as fd
from functional_dit import tiny

KW = dict(height=64, width=64, steps=4, seed=3, true_cfg=4.0)
RAGGED = ["a red cube", "a small green sphere resting on a wooden table by the window"]  # 138 and 188 tokens


@pytest.fixture(scope="module")
def pipes():
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        out[dtype] = tiny.pipeline("qwen-image", dtype=dtype)
        out[dtype].set_progress_bar_config(disable=True)
    return out


def _both(pipe, prompts, negative) -> tuple[torch.Tensor, torch.Tensor]:
    """(fd.sample's latents, the stock pipeline's) for one job."""
    ours = fd.sample(
        fd.from_diffusers(pipe.transformer), pipe, prompts, negative_prompt=negative, output_type="latent", **KW
    )
    stock = pipe(
        prompt=prompts, negative_prompt=negative, true_cfg_scale=KW["true_cfg"], num_inference_steps=KW["steps"],
        height=KW["height"], width=KW["width"], output_type="latent",
        generator=[torch.Generator().manual_seed(KW["seed"] + i) for i in range(len(prompts))],
    ).images  # fmt: skip
    return ours, stock


def _ulp(x: torch.Tensor) -> float:
    """One bf16 ulp (8 significant bits) at ``x``'s largest magnitude."""
    return 2.0 ** (torch.floor(torch.log2(x.float().abs().max())).item() - 7)


def test_bf16_cfg_without_padding_within_one_ulp_of_the_stock_pipeline(pipes):
    """Two prompts and a negative prompt of one token length (138): no text is padded, so
    the batched [cond; uncond] call does the stock pipeline's two calls' arithmetic.

    Tolerance: 1 ulp. On the AMD EPYC this was measured on the two are bitwise equal; a
    batch of 4 and two batches of 2 are different bf16 GEMM calls, which another CPU's
    kernels may block (and so round) differently, so bitwise is not claimed here."""
    ours, stock = _both(pipes[torch.bfloat16], ["a red cube", "a red ball"], "a red cube")
    gap = (ours.float() - stock.float()).abs().max().item()
    assert ours.dtype == torch.bfloat16 and gap <= _ulp(stock), f"{gap} > 1 ulp ({_ulp(stock)})"


def test_bf16_cfg_with_ragged_texts_within_two_ulps_of_the_stock_pipeline(pipes):
    """The pinned bf16 figure (issue 50 item 7): measured 0.046875 = 1.5 ulps (the latents
    reach |x| = 4.4, where a bf16 ulp is 2**-5), the same at every commit since 4f80b66.

    Tolerance: 2 ulps at the latents' largest magnitude. The uncond text (147 tokens) is
    padded to the cond texts' 188 with masked tokens, which changes the attention's
    reduction lengths; each bf16 step rounds a few entries one ulp apart and the 4 steps
    carry them. The stock pipeline itself moves by the same 0.046875 when handed the
    negative embeddings padded as ours are. Both bf16 runs are ~0.14 from the fp32 result,
    so the bound also asks the gap to stay under half of bf16's own error.
    """
    bf16, fp32 = (_both(pipes[d], RAGGED, "blurry, low quality") for d in (torch.bfloat16, torch.float32))
    ours, stock = (x.float() for x in bf16)
    ulp = _ulp(stock)
    gap = (ours - stock).abs().max().item()
    assert gap <= 2 * ulp, f"bf16 fd.sample vs stock: {gap} > 2 ulps ({2 * ulp})"
    own_error = (stock - fp32[1]).abs().max().item()
    assert gap < own_error / 2, (gap, own_error)
    torch.testing.assert_close(fp32[0], fp32[1], rtol=1e-5, atol=1e-5)
