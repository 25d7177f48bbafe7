"""Black Forest Labs single-file checkpoints (FLUX.1, FLUX.2) against diffusers' own
single-file converters.

A random state dict with the keys and shapes of BFL's ``flux/model.py`` /
``flux2/model.py`` for a tiny config is written in BFL layout; diffusers'
``convert_flux_transformer_checkpoint_to_diffusers`` /
``convert_flux2_transformer_checkpoint_to_diffusers`` turn it into the oracle's
state dict, and ``weights.load`` of the BFL file must give the same tensors,
bitwise, and the same forward as the diffusers module.

Only the tests import diffusers, so that test_weights_dist's spawned ranks can import the
BFL key sets here without paying for it.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from safetensors.torch import save_file

import functional_dit as fd
import weights

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md#numerics: fp32 parity with diffusers


# ----------------------------------------------------------------------------- BFL key sets


def _lin(name, out_dim, in_dim, bias=True) -> dict:
    shapes = {f"{name}.weight": (out_dim, in_dim)}
    return shapes | ({f"{name}.bias": (out_dim,)} if bias else {})


def _qk_norm(name, head_dim) -> dict:
    return {f"{name}.query_norm.scale": (head_dim,), f"{name}.key_norm.scale": (head_dim,)}


def bfl_flux1_shapes(c: fd.Flux1Config) -> dict:
    """Keys and shapes of BFL ``flux.model.Flux`` (FluxParams from ``c``)."""
    h, m, D = c.inner_dim, c.mlp_hidden_dim, c.attention_head_dim
    embed = lambda name, d_in: _lin(f"{name}.in_layer", h, d_in) | _lin(f"{name}.out_layer", h, h)  # noqa: E731
    s = _lin("img_in", h, c.in_channels) | embed("time_in", 256) | embed("vector_in", c.pooled_projection_dim)
    s |= embed("guidance_in", 256) if c.guidance_embeds else {}
    s |= _lin("txt_in", h, c.joint_attention_dim)
    for i in range(c.num_layers):
        for stream in ("img", "txt"):
            b = f"double_blocks.{i}.{stream}"
            s |= _lin(f"{b}_mod.lin", 6 * h, h) | _lin(f"{b}_attn.qkv", 3 * h, h) | _qk_norm(f"{b}_attn.norm", D)
            s |= _lin(f"{b}_attn.proj", h, h) | _lin(f"{b}_mlp.0", m, h) | _lin(f"{b}_mlp.2", h, m)
    for i in range(c.num_single_layers):
        b = f"single_blocks.{i}"
        s |= _lin(f"{b}.linear1", 3 * h + m, h) | _lin(f"{b}.linear2", h, h + m) | _qk_norm(f"{b}.norm", D)
        s |= _lin(f"{b}.modulation.lin", 3 * h, h)
    return s | _lin("final_layer.linear", c.out_dim, h) | _lin("final_layer.adaLN_modulation.1", 2 * h, h)


def bfl_flux2_shapes(c) -> dict:
    """Keys and shapes of BFL ``flux2.model.Flux2``: no biases, modulation shared by all blocks,
    SwiGLU MLPs (gate and up fused), single blocks' linear1 = [q, k, v, gate, up]."""
    h, m, D = c.inner_dim, c.mlp_hidden_dim, c.attention_head_dim
    lin = lambda name, o, i: _lin(name, o, i, bias=False)  # noqa: E731
    embed = lambda name: lin(f"{name}.in_layer", h, c.timestep_guidance_channels) | lin(f"{name}.out_layer", h, h)  # noqa: E731
    s = lin("img_in", h, c.in_channels) | embed("time_in") | (embed("guidance_in") if c.guidance_embeds else {})
    s |= lin("txt_in", h, c.joint_attention_dim)
    s |= lin("double_stream_modulation_img.lin", 6 * h, h) | lin("double_stream_modulation_txt.lin", 6 * h, h)
    s |= lin("single_stream_modulation.lin", 3 * h, h)
    for i in range(c.num_layers):
        for stream in ("img", "txt"):
            b = f"double_blocks.{i}.{stream}"
            s |= lin(f"{b}_attn.qkv", 3 * h, h) | _qk_norm(f"{b}_attn.norm", D) | lin(f"{b}_attn.proj", h, h)
            s |= lin(f"{b}_mlp.0", 2 * m, h) | lin(f"{b}_mlp.2", h, m)
    for i in range(c.num_single_layers):
        b = f"single_blocks.{i}"
        s |= lin(f"{b}.linear1", 3 * h + 2 * m, h) | lin(f"{b}.linear2", h, h + m) | _qk_norm(f"{b}.norm", D)
    return s | lin("final_layer.linear", c.out_dim, h) | lin("final_layer.adaLN_modulation.1", 2 * h, h)


def random_state(shapes: dict, seed: int = 0, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (torch.randn(s, generator=g) / (s[-1] ** 0.5 if len(s) > 1 else 4) + (len(s) == 1)).to(dtype)
        for k, s in shapes.items()
    }


# ----------------------------------------------------------------------------- diffusers' converters


def _torch_with_split_scaled(inner_dim: int):
    """diffusers' FLUX.1 converter splits ``linear1`` with the released model's sizes
    hardcoded, (3072, 3072, 3072, 12288); a tiny model has the same [q, k, v, mlp]
    layout at (h, h, h, 4h). This stands in for the converter's ``torch`` module and
    rescales exactly that split, nothing else."""
    full = (3072, 3072, 3072, 12288)

    def split(t, sizes, dim=0):
        if tuple(sizes) == full:
            sizes = tuple(s * inner_dim // 3072 for s in full)
        return torch.split(t, sizes, dim)

    class TorchShim(types.SimpleNamespace):
        def __getattr__(self, name):
            return getattr(torch, name)

    return TorchShim(split=split)


def diffusers_convert(config, bfl: dict) -> dict:
    from diffusers.loaders import single_file_utils  # here: the spawned ranks of test_weights_dist skip diffusers

    state = {k: v.clone() for k, v in bfl.items()}
    if isinstance(config, fd.Flux1Config):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(single_file_utils, "torch", _torch_with_split_scaled(config.inner_dim))
            return single_file_utils.convert_flux_transformer_checkpoint_to_diffusers(state)
    return single_file_utils.convert_flux2_transformer_checkpoint_to_diffusers(state)


def oracle_module(config, state: dict):
    import diffusers

    cfg = fd.config_to_diffusers(config)
    module = getattr(diffusers, cfg["_class_name"])(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    module.load_state_dict(state, strict=True)  # the converter's keys are exactly diffusers'
    return module.eval().requires_grad_(False)


CASES = ["flux1-dev", "flux1-schnell", "flux2-dev", "flux2-klein"]


def _case(name: str):
    family, variant = name.split("-")
    cases = importlib.import_module(f"cases_{family}")
    if family == "flux1":
        return cases, cases.TINY if variant == "dev" else cases.TINY_SCHNELL, bfl_flux1_shapes
    return cases, cases.TINY if variant == "dev" else cases.TINY_KLEIN, bfl_flux2_shapes


@pytest.mark.parametrize("name", CASES)
def test_bfl_file_matches_diffusers_converter(tmp_path, name):
    cases, config, shapes = _case(name)
    bfl = random_state(shapes(config), seed=5)
    path = tmp_path / "flux.safetensors"
    save_file(bfl, path)
    ref_state = diffusers_convert(config, bfl)
    module = oracle_module(config, ref_state)

    stats = {}
    loaded = weights.load(path, config=config, stats=stats)
    flat = loaded.flat()
    assert list(flat) == list(fd.to_state_dict(fd.init(config)))  # diffusers order, every key
    for k, ref in ref_state.items():
        assert torch.equal(flat[k], ref), k
    # Each byte of the file is read once: the fused qkv/linear1 rows go straight to q, k, v, mlp.
    assert stats["bytes_read"] == sum(t.numel() * 4 for t in bfl.values())

    kw = cases.inputs(config)
    out = fd.apply(loaded, **kw)
    torch.testing.assert_close(out, module(**cases.diffusers_kwargs(kw))[0], **FP32)


def test_bfl_comfyui_prefix_and_dtype(tmp_path):
    """``model.diffusion_model.`` wrapped BFL files load too, cast on the fly."""
    _, config, shapes = _case("flux1-dev")
    bfl = random_state(shapes(config), seed=6, dtype=torch.bfloat16)
    save_file({f"model.diffusion_model.{k}": v for k, v in bfl.items()}, tmp_path / "f.safetensors")
    ref = diffusers_convert(config, bfl)
    loaded = weights.load(tmp_path / "f.safetensors", config="flux1-tiny", dtype=torch.float32)
    for k, t in loaded.flat().items():
        assert t.dtype == torch.float32 and torch.equal(t, ref[k].float()), k


def test_bfl_family_detection(tmp_path):
    _, c1, _ = _case("flux1-dev")
    _, c2, _ = _case("flux2-dev")
    save_file(random_state(bfl_flux2_shapes(c2)), tmp_path / "f2.safetensors")
    with pytest.raises(ValueError, match=r"FLUX.2's \(bfl layout\)"):
        weights.load(tmp_path / "f2.safetensors")
    with pytest.raises(ValueError, match=r"a FLUX.1 config .* are those of FLUX.2 \(bfl layout\)"):
        weights.load(tmp_path / "f2.safetensors", config=c1)
    save_file({"foo.weight": torch.zeros(2), "bar": torch.zeros(1)}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match=r"match no known layout .* found 2 keys such as \['bar', 'foo.weight'\]"):
        weights.load(tmp_path / "x.safetensors")


def test_bfl_mismatch_names_both_layouts(tmp_path):
    """A missing fused tensor is reported under its BFL name with the diffusers keys it feeds."""
    _, config, shapes = _case("flux1-dev")
    bfl = random_state(shapes(config))
    del bfl["double_blocks.1.img_attn.qkv.weight"]
    bfl["single_blocks.0.linear1.bias"] = torch.zeros(5)
    bfl["extra.thing"] = torch.zeros(1)
    save_file(bfl, tmp_path / "f.safetensors")
    with pytest.raises(ValueError) as e:
        weights.load(tmp_path / "f.safetensors", config=config)
    msg = str(e.value)
    assert (
        "1 missing: ['double_blocks.1.img_attn.qkv.weight (-> transformer_blocks.1.attn.to_q.weight, "
        "transformer_blocks.1.attn.to_k.weight, transformer_blocks.1.attn.to_v.weight)']" in msg
    )
    assert "1 unexpected: ['extra.thing']" in msg
    assert "single_blocks.0.linear1.bias (-> " in msg and "expected (224,), got (5,)" in msg


@pytest.mark.parametrize("name", ["flux1-dev", "flux2-klein"])
def test_bfl_bundled_with_other_components(tmp_path, name):
    """An all-in-one file (ComfyUI style) holds the transformer under
    ``model.diffusion_model.`` next to the VAE and text encoders; diffusers' single-file
    loader takes the transformer's keys from it, and so must we. The other components'
    keys are not the transformer's, so they are not 'unexpected' keys of it."""
    _, config, shapes = _case(name)
    bfl = random_state(shapes(config), seed=8)
    others = {
        "first_stage_model.decoder.conv_in.weight": torch.zeros(2, 3),
        "text_encoders.t5xxl.shared.weight": torch.zeros(4),
    }
    save_file({**{f"model.diffusion_model.{k}": v for k, v in bfl.items()}, **others}, tmp_path / "aio.safetensors")
    ref = diffusers_convert(config, bfl)
    loaded = weights.load(tmp_path / "aio.safetensors", config=config).flat()
    assert sorted(loaded) == sorted(ref)
    for k, t in ref.items():
        assert torch.equal(loaded[k], t), k
    # without the wrapper prefix, stray keys stay what they are: unexpected
    save_file({**bfl, "vae.decoder.weight": torch.zeros(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match=r"1 unexpected: \['vae.decoder.weight'\]"):
        weights.load(tmp_path / "plain.safetensors", config=config)
