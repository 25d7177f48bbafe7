"""LoRA adapters against diffusers + PEFT on tiny models of every family.

Two random adapters (different ranks, alphas and targets, every linear layer between
them, ``lora_B`` non-zero so every update shows) are written with `lora.save` and read
back twice: by `lora.load`, and by the diffusers model's own ``load_lora_adapter``
(PEFT). The oracle is the diffusers forward with both adapters active at separate
weights (``set_adapters``); ours must match it on the fly (``fd.apply(..., lora=...)``)
and merged (`lora.merge`), and the two of ours must match each other.

Kohya/BFL FLUX.1 files are checked against diffusers' own converter
(``_convert_kohya_flux_lora_to_diffusers``) where it applies to a tiny model, and
against an independent oracle where it does not: the update added to the fused BFL
weight, loaded through ``weights.load``'s BFL table.
"""

from __future__ import annotations

import importlib

import peft  # noqa: E402,F401  (a dev dependency: diffusers.load_lora_adapter needs it)
import pytest
import torch
from oracle import diffusers_model
from safetensors.torch import save_file

import functional_dit as fd
import functional_dit.lora as lora

FP32 = dict(rtol=1e-5, atol=1e-5)  # docs/architecture.md: fp32 parity with diffusers


def _family(name):
    cases = importlib.import_module(f"cases_{name}")
    return cases, cases.TINY


FAMILIES = ["flux1", "flux2", "qwenimage"]


def _adapters(params):
    every = tuple(lora.linear_modules(params.config))
    a = lora.init(params, rank=4, targets=every, alpha=8.0, seed=1, zero_b=False)
    b = lora.init(params, rank=2, alpha=1.0, seed=2, zero_b=False)  # attention projections only
    return a, b


def _call(params, kw, **extra):
    kw = dict(kw)
    return fd.apply(params, kw.pop("x"), kw.pop("t"), kw.pop("txt"), **kw, **extra)


@pytest.mark.parametrize("name", FAMILIES)
def test_on_the_fly_and_merged_match_diffusers(name, tmp_path):
    cases, config = _family(name)
    module, params = diffusers_model(config, seed=3)
    a, b = _adapters(params)
    for tag, ad in (("a", a), ("b", b)):
        lora.save(ad, tmp_path / f"{tag}.safetensors")
        module.load_lora_adapter(
            str(tmp_path), weight_name=f"{tag}.safetensors", prefix="transformer", adapter_name=tag
        )
    la, lb = (lora.load(tmp_path / f"{t}.safetensors", params) for t in "ab")
    for got, want in ((la, a), (lb, b)):
        assert got.config == want.config
        for k, v in want.flat().items():
            assert torch.equal(got.flat()[k], v), k
    module.set_adapters(["a", "b"], [0.8, 0.5])
    kw = cases.inputs(config)
    with torch.no_grad():
        ref = module(**cases.diffusers_kwargs(kw))[0]
        fly = _call(params, kw, lora=[(la, 0.8), (lb, 0.5)])
        merged = _call(lora.merge(lora.merge(params, la, 0.8), lb, 0.5), kw)
        base = _call(params, kw)
    assert (ref - base).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(fly, ref, **FP32)
    torch.testing.assert_close(merged, ref, **FP32)
    torch.testing.assert_close(fly, merged, **FP32)


def test_scale_zero_and_params_untouched():
    cases, config = _family("flux1")
    params = fd.init(config, seed=1)
    before = {k: v.clone() for k, v in params.flat().items()}
    a, _ = _adapters(params)
    kw = cases.inputs(config)
    with torch.no_grad():
        torch.testing.assert_close(_call(params, kw, lora=[(a, 0.0)]), _call(params, kw), rtol=0, atol=0)
        lora.merge(params, a, 1.0)
    assert all(torch.equal(before[k], v) for k, v in params.flat().items())


def test_bf16_matches_peft(tmp_path):
    """A bf16 model with a bf16 adapter (diffusers casts adapters to the model's dtype)."""
    cases, config = _family("flux1")
    module, params = diffusers_model(config, seed=3, dtype=torch.bfloat16)
    a, _ = _adapters(fd.init(config))
    lora.save(a, tmp_path / "a.safetensors")
    module.load_lora_adapter(str(tmp_path), weight_name="a.safetensors", prefix="transformer", adapter_name="a")
    module.set_adapters(["a"], [0.7])
    a16 = lora.load(tmp_path / "a.safetensors", params, dtype=torch.bfloat16)
    kw = cases.inputs(config, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = module(**cases.diffusers_kwargs(kw))[0]
        got = _call(params, kw, lora=[(a16, 0.7)])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)  # docs/architecture.md: bf16 tolerance


def test_fp32_adapter_on_bf16_weights():
    """The base stays bf16 while the adapter stays fp32: as PEFT's LoraLayer, x is cast to the
    adapter's dtype, the update summed in fp32 and the result cast back to bf16."""
    from functional_dit.nn import layers as L

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 5, generator=g).bfloat16(), torch.randn(6, generator=g).bfloat16()
    A, B = torch.randn(3, 5, generator=g), torch.randn(6, 3, generator=g)
    x = torch.randn(2, 4, 5, generator=g).bfloat16()
    got = L.linear({"weight": w, "bias": b, "lora": ((A, B, 0.5, None, None),)}, x)
    want = (torch.nn.functional.linear(x, w, b) + (x.float() @ A.T @ B.T) * 0.5).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ----------------------------------------------------------------------------- Kohya / BFL FLUX.1


def _kohya_flux1(config, seed=0, rank=4, with_linear1=True):
    """A Kohya (sd-scripts) FLUX.1 LoRA for ``config``: every BFL linear module with random
    lora_down / lora_up and an alpha != rank."""
    from test_weights_bfl import bfl_flux1_shapes

    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in bfl_flux1_shapes(config).items():
        if not key.endswith(".weight") or len(shape) != 2 or "norm" in key:
            continue
        if "linear1" in key and not with_linear1:
            continue
        name = "lora_unet_" + key[: -len(".weight")].replace(".", "_")
        state[f"{name}.lora_down.weight"] = torch.randn(rank, shape[1], generator=g) * 0.3
        state[f"{name}.lora_up.weight"] = torch.randn(shape[0], rank, generator=g) * 0.3
        state[f"{name}.alpha"] = torch.tensor(float(rank) / 2)
    return state


def _deltas(ad):
    return {m: (B @ A) * ad.config.scale(m) for m, *_ in ad.config.modules for A, B in [ad.factors(m)]}


def test_kohya_flux1_matches_diffusers_converter():
    """diffusers' converter hard-codes FLUX.1-dev's single-block sizes (3072, 12288), so the
    oracle here covers every module but single_blocks.*.linear1 (the next test covers it)."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    config = fd.PRESETS["flux1-tiny"]
    state = _kohya_flux1(config, with_linear1=False)
    ours = _deltas(lora.from_state_dict(state, config))
    theirs = _convert_kohya_flux_lora_to_diffusers(dict(state))
    modules = {k.removeprefix("transformer.")[: -len(".lora_A.weight")] for k in theirs if ".lora_A." in k}
    assert modules == set(ours)
    for m in modules:
        pre = f"transformer.{m}" if f"transformer.{m}.lora_A.weight" in theirs else m
        want = theirs[f"{pre}.lora_B.weight"] @ theirs[f"{pre}.lora_A.weight"]
        if m in ("norm_out.linear", "proj_out"):
            # diffusers' converter drops the alpha of the final layer's modules (its "TODO:
            # alphas"); sd-scripts scales every module by alpha / rank, as we do.
            want = want * (2.0 / 4)  # alpha / rank of _kohya_flux1
        torch.testing.assert_close(ours[m], want, rtol=1e-6, atol=1e-6, msg=m)


def _bfl_state(params):
    """Our params as a BFL-layout state dict (through weights' own BFL table)."""
    from weights import _layouts as WL

    flat = params.flat()
    res = WL.resolve(WL.FLUX1_BFL, {k: tuple(v.shape) for k, v in flat.items()})
    assert not res.unmatched
    out = {k: torch.zeros(s) for k, s in res.source_shapes.items()}
    for key, pieces in res.pieces.items():
        for pc in pieces:
            out[pc.src][pc.src_row : pc.src_row + pc.rows] = flat[key][pc.dst : pc.dst + pc.rows]
    return out


def test_kohya_flux1_merge_equals_update_of_bfl_weights(tmp_path):
    """Independent oracle for every Kohya module incl. the fused single-block linear1: add
    (alpha / rank) * up @ down to the fused BFL weights and load that checkpoint."""
    import weights

    config = fd.PRESETS["flux1-tiny"]
    params = fd.init(config, seed=2)
    state = _kohya_flux1(config, seed=5)
    bfl = _bfl_state(params)
    by_kohya = {"lora_unet_" + k[: -len(".weight")].replace(".", "_"): k[: -len(".weight")] for k in bfl}
    for key in [k for k in state if k.endswith(".lora_down.weight")]:
        name = key[: -len(".lora_down.weight")]
        down, up, alpha = state[key], state[f"{name}.lora_up.weight"], state[f"{name}.alpha"]
        bfl[by_kohya[name] + ".weight"] = bfl[by_kohya[name] + ".weight"] + (alpha / down.shape[0]) * (up @ down)
    save_file(bfl, tmp_path / "bfl.safetensors")
    want = weights.load(tmp_path / "bfl.safetensors", config=config)
    save_file(state, tmp_path / "kohya.safetensors")
    got = lora.merge(params, lora.load(tmp_path / "kohya.safetensors", params), 1.0)
    for k, v in want.flat().items():
        torch.testing.assert_close(got.flat()[k], v, rtol=1e-6, atol=1e-6, msg=k)  # fp32 sums in another order


def test_bfl_names_with_diffusion_model_prefix_equal_kohya():
    """ComfyUI/BFL files name modules ``diffusion_model.double_blocks.0.img_attn.qkv`` with
    lora_A / lora_B: the same table, the same adapter."""
    config = fd.PRESETS["flux1-tiny"]
    state = _kohya_flux1(config, seed=6)
    bfl = {}
    for k, v in state.items():
        name, _, leaf = k.partition(".")
        leaf = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight"}.get(leaf, leaf)
        bfl_name = _unkohya(config, name)
        bfl[f"diffusion_model.{bfl_name}.{leaf}"] = v
    a, b = lora.from_state_dict(state, config), lora.from_state_dict(bfl, config)
    assert a.config == b.config
    for k, v in a.flat().items():
        assert torch.equal(b.flat()[k], v), k


def _unkohya(config, name):
    from test_weights_bfl import bfl_flux1_shapes

    names = {k[: -len(".weight")] for k in bfl_flux1_shapes(config) if k.endswith(".weight")}
    return {"lora_unet_" + n.replace(".", "_"): n for n in names}[name]


# ----------------------------------------------------------------------------- bad files


def _peft_state(config, seed=0, rank=4, targets=None):
    return lora.to_state_dict(lora.init(config, rank=rank, seed=seed, targets=targets, zero_b=False))


def _expect(state, config, *needles, metadata=None):
    with pytest.raises(ValueError) as e:
        lora.from_state_dict(state, config, metadata)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    return str(e.value)


def test_wrong_keys_are_listed_in_one_error():
    config = fd.PRESETS["flux1-tiny"]
    state = _peft_state(config)
    state["transformer.transformer_blocks.7.attn.to_q.lora_A.weight"] = torch.zeros(4, 32)
    state["transformer.transformer_blocks.0.attn.to_q.lora_B.scale"] = torch.zeros(32)
    del state["transformer.transformer_blocks.1.attn.to_k.lora_B.weight"]
    msg = _expect(
        state,
        config,
        "transformer_blocks.7.attn.to_q",
        "lora_B.scale: not a LoRA factor",
        "transformer_blocks.1.attn.to_k: missing factor(s) ['lora_B']",
    )
    assert msg.startswith("lora: the file does not match Flux1Config (3 problems)")


def test_wrong_rank_and_shape():
    config = fd.PRESETS["flux1-tiny"]
    state = _peft_state(config)
    state["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"] = torch.zeros(32, 3)
    state["transformer.transformer_blocks.0.attn.to_k.lora_A.weight"] = torch.zeros(4, 31)
    _expect(state, config, "rank mismatch", "to_q", "expected lora_A (r, 32)", "got (4, 31)")
    meta = {"lora_adapter_metadata": '{"transformer.r": 8, "transformer.lora_alpha": 8}'}
    _expect(_peft_state(config), config, "rank 4 in the factors, 8 in the file's metadata", metadata=meta)


def test_wrong_family_is_named():
    state = _peft_state(fd.PRESETS["flux2-tiny"])
    _expect(state, fd.PRESETS["flux1-tiny"], "to_qkv_mlp_proj", "look like a LoRA for Flux2Config")
    qwen = fd.PRESETS["qwen-image-tiny"]
    state = _peft_state(qwen, targets=lora.linear_modules(qwen))
    _expect(state, fd.PRESETS["flux1-tiny"], "img_mod.1", "look like a LoRA for QwenImageConfig")
    # attention-only Qwen-Image LoRAs share FLUX.1's module names: the shapes tell them apart
    _expect(_peft_state(qwen), fd.PRESETS["flux1-tiny"], "expected lora_A (r, 32)", "got (4, 64)")


def test_partial_dora_is_refused():
    """DoRA is read (tests/test_lora_dora_bias.py); a magnitude on some modules only, or
    use_dora in the metadata without magnitudes, is a file error naming the modules."""
    config = fd.PRESETS["flux1-tiny"]
    state = _peft_state(config)
    state["transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector"] = torch.ones(32)
    _expect(state, config, "no lora_magnitude_vector", "use_dora")
    meta = {"lora_adapter_metadata": '{"transformer.use_dora": true}'}
    _expect(_peft_state(config), config, "no lora_magnitude_vector", metadata=meta)


def test_pickles_are_refused(tmp_path):
    config = fd.PRESETS["flux1-tiny"]
    state = _peft_state(config)
    for name in ("lora.bin", "lora.pt", "disguised.safetensors"):
        torch.save(state, tmp_path / name)
        with pytest.raises(ValueError, match="pickle"):
            lora.load(tmp_path / name, config)
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match="not a safetensors file"):
        lora.load(tmp_path / "junk.safetensors", config)


def test_malformed_header_is_refused_with_weights_error(tmp_path):
    """A LoRA file whose header lies (a tensor's shape that its data_offsets do not span)
    is refused by weights' validated reader, with the very error ``weights.load`` gives
    for the same file: the file and the tensor named, before safetensors opens it."""
    import json
    import struct

    import weights

    config = fd.PRESETS["flux1-tiny"]
    lora.save(lora.init(config, rank=2), tmp_path / "ok.safetensors")
    raw = (tmp_path / "ok.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [1, 1]
    text = json.dumps(header).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(weights.CheckpointError) as got:
        lora.load(bad, config)
    with pytest.raises(weights.CheckpointError) as want:
        weights.load(bad, config=config)
    assert str(got.value) == str(want.value)
    assert f"bad.safetensors: tensor {name!r}: data_offsets" in str(got.value)


def test_saved_file_mode_follows_the_umask(tmp_path):
    """Under umask 022 a saved LoRA file is 0644, readable by another user or a container,
    as `weights.save`'s files are (safetensors' ``save_file`` wrote 0600); it reads back
    equal, with diffusers' ``format`` metadata."""
    import os

    from safetensors import safe_open

    params = fd.init("flux1-tiny", seed=0)
    ad = lora.init(params, rank=2, seed=1, zero_b=False)
    old = os.umask(0o022)
    try:
        lora.save(ad, tmp_path / "a.safetensors")
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "a.safetensors").st_mode & 0o777) == "0o644"
    assert os.listdir(tmp_path) == ["a.safetensors"]  # the temporary was renamed
    back = lora.load(tmp_path / "a.safetensors", params)
    assert back.config == ad.config and all(torch.equal(x, y) for x, y in zip(back.leaves(), ad.leaves()))
    with safe_open(tmp_path / "a.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"


def test_alpha_keys_and_metadata_scale():
    """``<module>.alpha`` keys (diffusers' network alphas) and the metadata's lora_alpha /
    alpha_pattern / use_rslora give alpha / rank (or alpha / sqrt(rank)) per module."""
    config = fd.PRESETS["flux1-tiny"]
    state = _peft_state(config)
    q = "transformer_blocks.0.attn.to_q"
    ad = lora.from_state_dict({**state, f"transformer.{q}.alpha": torch.tensor(2.0)}, config)
    assert ad.config.scale(q) == 0.5 and ad.config.scale("transformer_blocks.0.attn.to_k") == 1.0
    meta = '{"transformer.r": 4, "transformer.lora_alpha": 16, "transformer.alpha_pattern": {"to_k": 2}}'
    ad = lora.from_state_dict(state, config, {"lora_adapter_metadata": meta})
    assert ad.config.scale(q) == 4.0 and ad.config.scale("transformer_blocks.0.attn.to_k") == 0.5
    meta = '{"transformer.lora_alpha": 16, "transformer.use_rslora": true}'
    assert lora.from_state_dict(state, config, {"lora_adapter_metadata": meta}).config.scale(q) == 8.0


def test_apply_argument_errors():
    cases, config = _family("flux1")
    params = fd.init(config)
    ad = lora.init(fd.PRESETS["flux1-tiny"], rank=2)
    other = lora.init(cases.TINY_SCHNELL, rank=2)
    kw = cases.inputs(config)
    base = _call(params, kw)
    for none in (None, [], ()):  # no adapters: the base model, exactly
        torch.testing.assert_close(_call(params, kw, lora=none), base, rtol=0, atol=0)
    for bad in (ad, 0, False, "ad"):  # falsy or not, anything but a list of pairs is refused
        with pytest.raises(ValueError, match="lora: expected a list of"):
            _call(params, kw, lora=bad)
    with pytest.raises(ValueError, match="scale must be a real number"):
        _call(params, kw, lora=[(ad, "x")])
    with pytest.raises(ValueError, match="the adapter was made for"):
        _call(params, kw, lora=[(other, 1.0)])


def test_flux2_bfl_names_match_diffusers_converter():
    """A FLUX.2 LoRA under BFL names (``diffusion_model.double_blocks.0.img_attn.qkv.lora_A``)
    against diffusers' ``_convert_non_diffusers_flux2_lora_to_diffusers``. One difference
    by design: BFL's final AdaLN stores (shift, scale) and the FLUX.2 checkpoint converter
    swaps the halves of its weight, so we swap the halves of its LoRA update too; diffusers'
    LoRA converter does not (its ``norm_out.linear`` update is checked swapped here)."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_flux2_lora_to_diffusers
    from test_weights_bfl import bfl_flux2_shapes

    config = fd.PRESETS["flux2-tiny"]
    g = torch.Generator().manual_seed(4)
    state = {}
    for key, shape in bfl_flux2_shapes(config).items():
        if key.endswith(".weight") and len(shape) == 2:
            name = "diffusion_model." + key[: -len(".weight")]
            state[f"{name}.lora_A.weight"] = torch.randn(3, shape[1], generator=g)
            state[f"{name}.lora_B.weight"] = torch.randn(shape[0], 3, generator=g)
    ours = _deltas(lora.from_state_dict(state, config))
    theirs = _convert_non_diffusers_flux2_lora_to_diffusers(dict(state))
    modules = {k.removeprefix("transformer.")[: -len(".lora_A.weight")] for k in theirs if ".lora_A." in k}
    assert modules == set(ours)
    for m in modules:
        want = theirs[f"transformer.{m}.lora_B.weight"] @ theirs[f"transformer.{m}.lora_A.weight"]
        if m == "norm_out.linear":
            want = torch.cat(want.chunk(2, 0)[::-1], 0)
        torch.testing.assert_close(ours[m], want, rtol=1e-6, atol=1e-6, msg=m)


def test_qwen_image_kohya_and_prefixed_names_equal_peft():
    """Qwen-Image LoRAs use the diffusers module names: under Kohya's ``lora_unet_`` form
    (dots as "_", lora_down / lora_up) or a ``diffusion_model.`` prefix they load the same."""
    config = fd.PRESETS["qwen-image-tiny"]
    ad = lora.init(config, rank=2, targets=lora.linear_modules(config), seed=5, zero_b=False)
    kohya, comfy = {}, {}
    for m, *_ in ad.config.modules:
        A, B = ad.factors(m)
        name = "lora_unet_" + m.replace(".", "_")
        kohya |= {f"{name}.lora_down.weight": A, f"{name}.lora_up.weight": B, f"{name}.alpha": torch.tensor(2.0)}
        comfy |= {f"diffusion_model.{m}.lora_A.weight": A, f"diffusion_model.{m}.lora_B.weight": B}
    for state in (kohya, comfy):
        got = lora.from_state_dict(state, config)
        assert got.config == ad.config
        assert all(torch.equal(got.flat()[k], v) for k, v in ad.flat().items())


@pytest.mark.parametrize("name", FAMILIES)
def test_on_the_fly_lora_on_prepared_params(name):
    """`fd.prepare`'s fused q/k/v path must not skip the per-layer LoRA updates: with an
    adapter attached the group runs layer by layer, equal to the unprepared params."""
    cases, config = _family(name)
    params = fd.init(config, seed=3)
    a, _ = _adapters(params)
    kw = cases.inputs(config, batch=2, seed=4)
    with torch.no_grad():
        ref = _call(params, kw, lora=[(a, 0.7)])
        out = _call(fd.prepare(params), kw, lora=[(a, 0.7)])
        base = _call(fd.prepare(params), kw)
    torch.testing.assert_close(out, ref, **FP32)
    assert (out - base).abs().max() > 1e-3  # the adapter matters
