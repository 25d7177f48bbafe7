"""The API where users reach for it: each edge found by using the library as a new user
would (zero-block configs, empty batches, bad parameter dtypes, preset names and diffusers
configs everywhere, variants, ranks that disagree) works, or is refused by a ValueError
naming the argument, the expected and the actual value."""

from __future__ import annotations

import dataclasses
import json
import os

import cases_flux1 as C1
import cases_flux2 as C2
import cases_qwenimage as CQ
import numpy as np
import pytest
import torch
from _dist import spawn
from oracle import diffusers_model

import functional_dit as fd
import sharding
import weights

FP32 = dict(rtol=1e-5, atol=1e-5)
CASES = {"flux1": C1, "flux2": C2, "qwenimage": CQ}


def _raises(match, fn, *args, **kw):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


# ----------------------------------------------------------------------------- model edges


@pytest.mark.parametrize(
    "family,blocks",
    [
        ("flux1", dict(num_layers=0)),
        ("flux1", dict(num_single_layers=0)),
        ("flux2", dict(num_layers=0)),
        ("flux2", dict(num_single_layers=0)),
        ("qwenimage", dict(num_layers=0)),
    ],
)
def test_zero_block_configs_run_and_match_diffusers(family, blocks):
    C = CASES[family]
    config = dataclasses.replace(C.TINY, **blocks)
    module, params = diffusers_model(config, seed=3)
    kw = C.inputs(config)
    with torch.no_grad():
        ref = module(**C.diffusers_kwargs(kw))[0]
    torch.testing.assert_close(fd.apply(params, **kw), ref, **FP32)
    assert fd.num_params(config) == sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("family", sorted(CASES))
def test_an_empty_batch_gives_an_empty_output_in_every_family(family):
    C = CASES[family]
    out = fd.apply(fd.init(C.TINY), **C.inputs(C.TINY, batch=0))
    assert tuple(out.shape) == (0, 12, C.TINY.out_dim)


def test_foreign_and_unknown_keywords():
    p, kw = fd.init(C1.TINY), C1.inputs(C1.TINY)
    assert fd.apply(p, **kw, txt_mask=None, img_shapes=None).shape == (2, 12, 16)  # a generic caller's Nones
    _raises(r"img_shapes: FLUX.1 takes no img_shapes; expected None, got list", fd.apply, p, **kw, img_shapes=[[1]])
    _raises(
        r"guidence: not an argument of FLUX.1's apply; expected one of \['pooled', 'guidance'",
        fd.apply,
        p,
        **kw,
        guidence=kw["guidance"],
    )


def test_shapes_are_printed_as_python_prints_tuples():
    p, kw = fd.init(C1.TINY), C1.inputs(C1.TINY)
    _raises(r"t: expected shape \(2,\), got \(1,\)", fd.apply, p, **{**kw, "t": kw["t"][:1]})


# ----------------------------------------------------------------------------- parameters


def test_parameters_are_checked_where_they_enter():
    state = fd.to_state_dict(fd.init("flux1-tiny"))
    w = state["x_embedder.weight"]
    _raises(
        r"params: expected floating-point tensors .*1 not floating point: \['x_embedder.weight: torch.int32'\]",
        fd.from_state_dict,
        "flux1-tiny",
        {**state, "x_embedder.weight": w.int()},
    )
    _raises(
        r"1 not tensors: \['x_embedder.weight: expected a tensor, got ndarray'\]",
        fd.from_state_dict,
        "flux1-tiny",
        {**state, "x_embedder.weight": w.numpy()},
    )
    _raises(
        r"params: expected one dtype for every tensor .* got 2: .*'torch.float16': \(1, \['x_embedder.weight'\]\)",
        fd.from_state_dict,
        "flux1-tiny",
        {**state, "x_embedder.weight": w.half()},
    )
    params = fd.from_state_dict("flux1-tiny", state)
    tree = sharding.tree.nest({**state, "x_embedder.weight": torch.zeros(3, 3)})
    _raises(r"1 mis-shaped: \['x_embedder.weight: expected \(32, 16\), got \(3, 3\)'\]", params.replace, tree)
    assert params.replace(params.tree).flat().keys() == state.keys()


def test_fp8_params_say_which_dtype_to_load():
    p8 = fd.init("flux1-tiny", dtype=torch.float8_e4m3fn)  # what an fp8 checkpoint loads as
    _raises(
        r"params: stored as torch.float8_e4m3fn, which fd.apply cannot compute in .* "
        r"weights.load\(\.\.\., dtype=torch.bfloat16\)",
        fd.apply,
        p8,
        **C1.inputs(C1.TINY),
    )


def test_bfl_keyed_state_dict_points_to_weights_load():
    state = {"double_blocks.0.img_attn.qkv.weight": torch.zeros(1), "img_in.weight": torch.zeros(1)}
    _raises(
        r"state: the keys are in Black Forest Labs' layout .* weights.load", fd.from_state_dict, "flux1-tiny", state
    )
    prefixed = {f"model.diffusion_model.{k}": v for k, v in state.items()}
    _raises(r"Black Forest Labs' layout", fd.from_state_dict, "flux1-tiny", prefixed)


def test_init_refuses_a_non_floating_dtype_and_a_non_int_seed():
    _raises(
        r"dtype: expected a floating torch.dtype such as torch.bfloat16, got torch.int64",
        fd.init,
        "flux1-tiny",
        dtype=torch.int64,
    )
    _raises(r"seed: expected an int, got None", fd.init, "flux1-tiny", seed=None)


# ----------------------------------------------------------------------------- configs


def test_a_preset_name_is_a_config_everywhere():
    config = fd.PRESETS["flux2-tiny"]
    params = fd.init("flux2-tiny", seed=1)
    assert params.config == config
    assert fd.param_specs("flux2-tiny") == fd.param_specs(config)
    assert fd.num_params("flux2-tiny") == fd.num_params(config) == fd.num_params(params)
    assert fd.from_state_dict("flux2-tiny", fd.to_state_dict(params)).config == config
    assert fd.as_config(fd.config_to_diffusers(config)) == config
    _raises(r"config: expected a preset name in \[.*'flux1-tiny'.*\] or a config, got 'flux9'", fd.init, "flux9")
    # sharding imports no model package: a name is refused with what to pass instead
    _raises(
        r"params_or_config: got the name 'flux2-tiny'; .*functional_dit.as_config",
        sharding.plan,
        "flux2-tiny",
        {"tp": 2},
    )
    assert sharding.plan(fd.as_config("flux2-tiny"), {"tp": 2}) == sharding.plan(config, {"tp": 2})


@pytest.mark.parametrize("family", sorted(CASES))
def test_config_from_what_diffusers_users_hold(family, tmp_path):
    config = CASES[family].TINY
    module, _ = diffusers_model(config)
    assert "_class_name" not in module.config  # a FrozenDict: the family comes from its keys
    assert fd.config_from_diffusers(module.config) == config
    assert fd.config_from_diffusers(module) == config
    compiled = torch.compile(module)
    assert fd.config_from_diffusers(compiled) == config
    assert fd.from_diffusers(compiled).config == config
    module.save_config(tmp_path / "transformer")
    (tmp_path / "model_index.json").write_text("{}")
    assert fd.config_from_diffusers(tmp_path / "transformer") == config  # a model folder
    assert fd.config_from_diffusers(tmp_path) == config  # a pipeline folder
    assert fd.config_from_diffusers(str(tmp_path / "transformer" / "config.json")) == config


def test_config_from_diffusers_refusals():
    text = json.dumps(fd.config_to_diffusers(C1.TINY))
    _raises(r"cfg: got a JSON string; expected a mapping \(json.loads\(text\)\)", fd.config_from_diffusers, text)
    _raises(
        r"cfg: expected a config.json file, .* found none at '/nonexistent'", fd.config_from_diffusers, "/nonexistent"
    )
    _raises(
        r"cfg: no '_class_name', and its keys \['num_layers'\] fit \['FluxTransformer2DModel', "
        r"'Flux2Transformer2DModel', 'QwenImageTransformer2DModel', 'Flux3Transformer2DModel', "
        r"'QwenImage21Transformer2DModel'\]; expected exactly one .*: add '_class_name'",
        fd.config_from_diffusers,
        {"num_layers": 2},
    )
    _raises(r"fit none of the families", fd.config_from_diffusers, {"num_layers": 2, "zero_cond_t": False, "eps": 1e-6})


def test_numpy_and_tensor_integers_are_accepted():
    config = fd.Flux1Config(axes_dims_rope=np.array([16, 56, 56]))
    assert config.axes_dims_rope == (16, 56, 56) and all(type(d) is int for d in config.axes_dims_rope)
    assert config == fd.Flux1Config()
    _raises(
        r"axes_dims_rope: expected positive even ints, got \(16.0, 56, 56\)",
        fd.Flux1Config,
        axes_dims_rope=(16.0, 56, 56),
    )
    p, kw = fd.init(CQ.TINY), CQ.inputs(CQ.TINY)
    tensors = [[tuple(torch.tensor(v) for v in s) for s in item] for item in kw["img_shapes"]]
    torch.testing.assert_close(fd.apply(p, **{**kw, "img_shapes": tensors}), fd.apply(p, **kw), rtol=0, atol=0)


def test_additional_t_cond_out_of_range():
    p, kw = fd.init(CQ.TINY_LAYERED), CQ.inputs(CQ.TINY_LAYERED)
    _raises(
        r"additional_t_cond: expected values in \{0, 1\}, got \[0, 2\]",
        fd.apply,
        p,
        **{**kw, "additional_t_cond": torch.tensor([0, 2])},
    )


# ----------------------------------------------------------------------------- checkpoints


def test_weights_load_takes_a_diffusers_config_mapping(tmp_path):
    params = fd.init("flux1-tiny", seed=2)
    weights.save(params, tmp_path)
    file = str(tmp_path / "diffusion_pytorch_model.safetensors")
    module, _ = diffusers_model(C1.TINY)
    for config in (dict(module.config), fd.config_to_diffusers(C1.TINY)):
        loaded = weights.load(file, config=config)
        assert loaded.config == C1.TINY
        assert all(torch.equal(a, b) for a, b in zip(loaded.leaves(), params.leaves()))


def test_weights_load_of_mixed_dtypes_asks_for_one(tmp_path):
    from safetensors.torch import save_file

    state = fd.to_state_dict(fd.init("flux1-tiny", seed=5))
    state = {k: (v.half() if k.startswith("proj_out") else v).contiguous() for k, v in state.items()}
    save_file(state, str(tmp_path / "mixed.safetensors"))
    _raises(
        r"dtype: the checkpoint mixes dtypes \{'F32': \(110, .*'F16': \(2, \['proj_out.weight', 'proj_out.bias'\]\)\}"
        r".* expected dtype= one of them .*, got None",
        weights.load,
        tmp_path / "mixed.safetensors",
        config="flux1-tiny",
    )
    loaded = weights.load(tmp_path / "mixed.safetensors", config="flux1-tiny", dtype=torch.float32)
    assert {t.dtype for t in loaded.leaves()} == {torch.float32}


@pytest.mark.parametrize("max_shard_size", ["5GB", 40_000])  # one file, and an index with shards
def test_weights_load_reads_a_variant(tmp_path, max_shard_size):
    params = fd.init("flux1-tiny", seed=4, dtype=torch.float16)
    weights.save(params, tmp_path, max_shard_size=max_shard_size)
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():  # diffusers names: diffusion_pytorch_model.safetensors.index.fp16.json
        index.rename(tmp_path / "diffusion_pytorch_model.safetensors.index.fp16.json")
    else:  # diffusion_pytorch_model.fp16.safetensors
        os.rename(
            tmp_path / "diffusion_pytorch_model.safetensors", tmp_path / "diffusion_pytorch_model.fp16.safetensors"
        )
    loaded = weights.load(tmp_path, variant="fp16")
    assert all(torch.equal(a, b) for a, b in zip(loaded.leaves(), params.leaves()))
    _raises(r"path: .* has no diffusion_pytorch_model.safetensors or", weights.load, tmp_path)
    _raises(r"variant: expected None or a name such as 'fp16' .*, got '../x'", weights.load, tmp_path, variant="../x")


# ----------------------------------------------------------------------------- ranks that disagree


def _disagree(rank, world):
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 12, 16, generator=g), torch.rand(2, generator=g)
    report = {}

    def attempt(name, *tensors, **kw):
        try:
            sharding.check_replicated(*tensors, **kw)
            report[name] = "ok"
        except ValueError as e:
            report[name] = str(e)

    attempt("same", x, t, None, names=["x", "t", "guidance"])
    attempt("value", x + rank, t, names=["x", "t"])
    attempt("length", x[:, : 12 - rank], t, names=["x", "t"])  # different sequence lengths: no SIGABRT
    attempt("count", *([x, t] if rank == 0 else [x]))
    attempt("dtype", x, t.double() if rank else t, names=["x", "t"])
    with sharding.bind(sharding.make_mesh(tp=world, device_type="cpu")):
        report["healthy"] = sharding.psum(torch.ones(1), "tp")  # the group still works afterwards
    return report


def test_check_replicated_names_the_argument_and_the_ranks_on_every_rank():
    results = spawn(_disagree, 2, timeout=300)
    for r in results:
        assert r["same"] == "ok"
        assert r["value"].startswith("x: expected the same tensor on every rank, got ranks [0]: shape (2, 12, 16)")
        assert "; ranks [1]: shape (2, 12, 16)" in r["value"]
        assert "ranks [0]: shape (2, 12, 16)" in r["length"] and "ranks [1]: shape (2, 11, 16)" in r["length"]
        assert (
            r["count"]
            == "check_replicated: expected the same number of tensors on every rank, got {0: 2, 1: 1} by rank"
        )
        assert r["dtype"].startswith("t: expected the same tensor on every rank") and "torch.float64" in r["dtype"]
        assert torch.equal(r["healthy"], torch.tensor([2.0]))
    assert all(results[0][k] == results[1][k] for k in results[0] if k != "healthy")  # the same error on every rank


def test_check_replicated_without_a_process_group_checks_its_arguments():
    sharding.check_replicated(torch.zeros(2), None)
    _raises(
        r"t: expected a tensor or None, got float", sharding.check_replicated, torch.zeros(2), 0.5, names=["x", "t"]
    )
    _raises(
        r"names: expected 2 names \(one per tensor\), got 1",
        sharding.check_replicated,
        torch.zeros(2),
        None,
        names=["x"],
    )
