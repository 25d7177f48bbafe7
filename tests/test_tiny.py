"""`functional_dit.tiny`: complete diffusers pipelines built offline.

Every kind builds with no network, every module in eval mode, the stock transformer
holding `fd.init` weights; prompts matter (different prompts, different latents) and
same seed gives the same result. Every kind also runs end to end in test_adapter.py.
"""

from __future__ import annotations

import diffusers
import pytest
import torch

import functional_dit as fd
from functional_dit import tiny


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_builds_every_kind(kind):
    pipe = tiny.pipeline(kind, seed=1)
    assert type(pipe).__name__ == tiny.PIPELINE_CLASSES[kind]
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    assert all(not sub.training for m in modules for sub in m.modules())
    want = fd.init(tiny.transformer_config(kind), seed=1)
    got = fd.from_diffusers(pipe.transformer)
    assert all(torch.equal(got.flat()[k], v) for k, v in want.flat().items())
    assert pipe.transformer.config.in_channels == tiny.transformer_config(kind).in_channels


@pytest.mark.parametrize(("kind", "length"), [("flux", 64), ("flux2", 256), ("flux2-klein", 64), ("qwen-image", 256)])
def test_prompts_matter_and_seeds_repeat(kind, length):
    # ``length``: enough byte-level tokens to reach the prompt past the system text (FLUX.2's
    # Mistral system prompt, Qwen-Image's template whose embeddings are cut after dropping 34).
    pipe = tiny.pipeline(kind)

    def latents(prompt):
        gen = torch.Generator().manual_seed(0)
        args = dict(height=32, width=32, num_inference_steps=1, output_type="latent", max_sequence_length=length)
        return pipe(prompt=prompt, generator=gen, **args).images

    a = latents("a red cube on a table")
    assert torch.equal(a, latents("a red cube on a table"))
    assert (a - latents("a blue sphere in the sky")).abs().max() > 1e-3


def test_dtype_and_determinism_of_builders():
    pipe = tiny.pipeline("qwen-image", dtype=torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.text_encoder.dtype == torch.bfloat16
    a, b = tiny.qwen_vae(seed=5), tiny.qwen_vae(seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert isinstance(tiny.scheduler(), diffusers.FlowMatchEulerDiscreteScheduler)
    assert tiny.family("flux-kontext") == "flux1" and tiny.family("flux2-klein-kv") == "flux2"


def test_tokenizers_cover_every_byte():
    text = "héllo, wörld! 你好"
    for tok in (tiny.clip_tokenizer(), tiny.qwen_tokenizer(), tiny.mistral_tokenizer()):
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.unk_token_id not in ids or tok.unk_token_id is None
        assert tok.decode(ids).replace(" ", "") == text.replace(" ", "")


def test_bad_kind():
    with pytest.raises(ValueError, match=r"kind: expected one of \['flux', .*\], got 'sdxl'"):
        tiny.pipeline("sdxl")
