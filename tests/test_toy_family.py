"""Adding a family is what docs/adding-a-family.md says: a toy family (FLUX.1's maths under
the key ``"toy"`` and a config class of its own, `_toy_family`) with its product module
(`_toy_family_product`), registered only through the registry's one line
(``families.register``, what the line in ``FAMILIES`` does for a family in the package),
runs everything a family runs: `fd.apply` (equal to FLUX.1's at the same weights, and to its
stock diffusers class), sharding over 2 gloo ranks, ``weights.save`` / ``weights.load``,
LoRA (on the fly equal to merged; saved and loaded), `fd.DiffusersTransformer` in its tiny
stock pipeline (equal to the stock transformer there) and `fd.sample` (equal to that
pipeline). Not here yet: the step caches (they need the family's forward stages).
"""

from __future__ import annotations

import dataclasses

import _toy_family
import _toy_family_product
import diffusers
import pytest
import torch
from _dist import spawn

import functional_dit as fd
import sharding
import weights
from functional_dit import families, lora, tiny
from functional_dit.cli import _bench_models
from functional_dit.pipelines.families import product

# A FluxPipeline run on the tiny pipeline, short (the tiny prompt length reaches the prompt).
RUN = dict(height=32, width=32, num_inference_steps=2, max_sequence_length=64, output_type="latent")
PROMPT = "a red cube"


@pytest.fixture
def toy(monkeypatch):
    """The toy family registered for one test, its stock class on ``diffusers`` (where a
    new family's class is once diffusers ships it)."""
    monkeypatch.setattr(diffusers, "ToyTransformer2DModel", _toy_family_product.ToyTransformer2DModel, raising=False)
    with families.registered(_toy_family):
        yield _toy_family


def _inputs(config):
    kw, dkw = _bench_models.inputs(config, "cpu", torch.float32, hw=(4, 4), txt_len=8)  # the product's bench inputs
    return kw, dkw


def _as_flux1(params):
    """The same tensors as FLUX.1 params (the oracle: the toy is FLUX.1's maths)."""
    config = fd.Flux1Config(**dataclasses.asdict(params.config))
    return fd.Params(config, params.tree)


def test_toy_family_runs_everywhere_a_family_runs(toy, tmp_path):
    params = fd.init(tiny.transformer_config("toy"), seed=0)
    assert type(params.config) is toy.ToyConfig and families.of(params) is toy
    assert product(toy) is _toy_family_product and "toy-tiny" in fd.PRESETS
    kw, dkw = _inputs(params.config)

    # fd.apply: FLUX.1's result at the same weights (the same functions: bitwise), and the stock class's
    out = fd.apply(params, **kw)
    torch.testing.assert_close(out, fd.apply(_as_flux1(params), **kw), rtol=0, atol=0)
    stock = tiny.stock_transformer("toy")
    with torch.no_grad():
        torch.testing.assert_close(out, stock(**dkw)[0], rtol=1e-5, atol=1e-5)  # fp32, kernel order only

    # weights: saved as the toy's stock class, loaded back as the toy
    weights.save(params, tmp_path / "toy")
    back = weights.load(tmp_path / "toy")
    assert type(back.config) is toy.ToyConfig and back.config == params.config
    torch.testing.assert_close(fd.apply(back, **kw), out, rtol=0, atol=0)

    # LoRA: on the fly equal to merged (fp32, the low-rank product's rounding), through a file
    ad = lora.init(params, rank=2, seed=1, zero_b=False)
    lora.save(ad, tmp_path / "toy_lora.safetensors")
    ad = lora.load(tmp_path / "toy_lora.safetensors", params)
    on_the_fly = fd.apply(params, **kw, lora=[(ad, 0.7)])
    torch.testing.assert_close(on_the_fly, fd.apply(lora.merge(params, ad, 0.7), **kw), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(on_the_fly, out)  # the adapter does something

    # the diffusers adapter in the toy's tiny stock pipeline, against the stock transformer there
    adapter = fd.DiffusersTransformer(params)
    assert type(adapter).__name__ == "ToyTransformer2DModel"
    ours = tiny.pipeline("toy", transformer=adapter)(PROMPT, generator=torch.Generator().manual_seed(0), **RUN).images
    pipe = tiny.pipeline("toy")
    stock_latents = pipe(PROMPT, generator=torch.Generator().manual_seed(0), **RUN).images
    torch.testing.assert_close(ours, stock_latents, rtol=1e-5, atol=1e-5)  # fp32 (bitwise for FLUX.1 here)

    # fd.sample with that pipeline's encoders: the stock pipeline's latents
    msl = RUN["max_sequence_length"]
    got = fd.sample(params, pipe, PROMPT, height=32, width=32, steps=2, seed=0, max_sequence_length=msl,
                    output_type="latent")  # fmt: skip
    first = pipe(PROMPT, generator=torch.Generator().manual_seed(0), **RUN).images  # fd.sample draws image 0 so
    torch.testing.assert_close(got, first, rtol=1e-5, atol=1e-5)

    # a step cache through the toy's stages (FLUX.1's, found as `fam.stages`): threshold 0
    # computes every block (bitwise the uncached run), a high one skips steps and changes them
    run = dict(height=32, width=32, steps=3, seed=0, max_sequence_length=msl, output_type="latent")
    plain = fd.sample(params, pipe, PROMPT, **run)
    assert torch.equal(fd.sample(params, pipe, PROMPT, cache="fbcache:0", **run), plain)
    assert not torch.equal(fd.sample(params, pipe, PROMPT, cache="fbcache:0.9", **run), plain)


def test_toy_img2img_written_in_its_module_equals_flux1_img2img(toy):
    """The toy's img2img job (its product module's ``JOBS``, one variant of its steps whose
    hooks return tables) equals fd.sample's FLUX.1 img2img on the same weights: the same
    functions on the same inputs in one process, so bitwise."""
    from PIL import Image

    params = fd.init(tiny.transformer_config("toy"), seed=0)
    pipe = tiny.pipeline("toy")
    image = Image.fromarray((torch.rand(40, 48, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy())
    run = dict(height=32, width=32, steps=4, seed=[3, 4], image=image, strength=0.5, output_type="latent")
    got = fd.sample(params, pipe, ["a red cube", "a blue ball"], **run)
    want = fd.sample(_as_flux1(params), pipe, ["a red cube", "a blue ball"], **run)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    text_to_image = fd.sample(params, pipe, ["a red cube", "a blue ball"], **{**run, "image": None, "strength": None})
    assert not torch.allclose(got, text_to_image)  # the image changed the result
    with pytest.raises(ValueError, match="mask_image: the toy's img2img takes none"):
        fd.sample(params, pipe, "a red cube", mask_image=image, **run)


def test_unregistered_toy_is_unknown_again(toy):
    families.unregister(toy)
    try:
        assert "toy-tiny" not in fd.PRESETS and "toy" not in families.TINY_KINDS
        with pytest.raises(ValueError, match="config: expected one of .*, got ToyConfig"):
            families.of(toy.PRESETS["toy-tiny"])
        assert families.of_pipeline("FluxPipeline").KEY == "flux1"  # the pipeline stays FLUX.1's
    finally:
        families.register(toy)  # the fixture unregisters it


def _sharded(rank, world):
    """tp=2 over the toy's params: each rank's output equals the unsharded one."""
    with families.registered(_toy_family):
        params = fd.init(_toy_family.PRESETS["toy-tiny"], seed=0)
        kw, _ = _inputs(params.config)
        mesh = sharding.make_mesh(tp=world, device_type="cpu")
        out = fd.apply(sharding.shard_params(params, mesh), **kw)
        return out, fd.apply(params, **kw)


def test_toy_family_shards_over_two_ranks():
    results = spawn(_sharded, 2, timeout=300)
    for out, ref in results:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # fp32: tp's partial sums in another order
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)  # replicated output on every rank
