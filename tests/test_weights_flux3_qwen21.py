"""FLUX.3 and Qwen-Image 2.1 checkpoints: diffusers folders and the original single-file
layouts that diffusers' single-file loader converts (``convert_flux3_...`` and
``convert_qwen_image21_transformer_checkpoint_to_diffusers``), plain and per rank.

The original-layout file is built from the diffusers state dict by the inverse renames
written out here; diffusers' converter must turn it back into that state dict (so the
inversion is right), and ``weights.load`` of the file must give the same tensors, bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch
from _dist import spawn
from diffusers.loaders.single_file_utils import (
    convert_flux3_transformer_checkpoint_to_diffusers,
    convert_qwen_image21_transformer_checkpoint_to_diffusers,
)
from oracle import diffusers_model
from safetensors.torch import save_file

import functional_dit as fd
import sharding
import weights

FLUX3 = fd.PRESETS["flux3-tiny"]
QWEN21 = fd.PRESETS["qwen-image-2.1-tiny"]

_FLUX3_INNER = {  # diffusers leaf suffix -> BFL's, inside every block
    "attn.to_q.weight": "q_proj.weight",
    "attn.to_k.weight": "k_proj.weight",
    "attn.to_v.weight": "v_proj.weight",
    "attn.to_out.0.weight": "attn_out.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
    "ff.linear_in.weight": "mlp_in.weight",
    "ff.linear_out.weight": "mlp_out.weight",
}
_FLUX3_EXACT = {
    "timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
    "timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
    "target_timestep_embedder.linear_1.weight": "ref_time_in.in_layer.weight",
    "target_timestep_embedder.linear_2.weight": "ref_time_in.out_layer.weight",
    "proj_out.weight": "final_layer.image.linear.weight",
    "norm_out.linear.weight": "final_layer.image.adaLN_modulation.1.weight",
}
_FLUX3_PREFIX = {
    "x_embedders.": "emb_in.",
    "context_embedder.": "txt_in.",
    "mode_blocks.": "content_mode_blocks.",
    "single_transformer_blocks.": "single_blocks.",
}


def _flux3_key(k: str) -> str:
    if k in _FLUX3_EXACT:
        return _FLUX3_EXACT[k]
    for a, b in _FLUX3_PREFIX.items():
        if k.startswith(a):
            k = b + k[len(a) :]
            break
    for a, b in _FLUX3_INNER.items():
        if k.endswith(a):
            return k[: -len(a)] + b
    return k.replace(".linear.weight", ".lin.weight")


def flux3_original(state: dict) -> dict:
    """BFL layout: renamed keys, the output AdaLN in (shift, scale) order, plus a training-only head."""
    out = {_flux3_key(k): v.clone() for k, v in state.items()}
    w = out["final_layer.image.adaLN_modulation.1.weight"]
    out["final_layer.image.adaLN_modulation.1.weight"] = torch.cat(w.chunk(2)[::-1])
    return out | {"repa_projectors.0.weight": torch.randn(3, 4)}


def qwen21_original(state: dict) -> dict:
    """ComfyUI layout: gate and up fused into gate_up (gate rows first), model.diffusion_model. prefix."""
    out = {k: v.clone() for k, v in state.items() if not k.endswith(("gate_layer.weight", "img_mlp.proj.weight"))}
    for k in state:
        if k.endswith("img_mlp.gate_layer.weight"):
            up = state[k.replace("gate_layer", "proj")]
            out[k.replace("gate_layer", "gate_up")] = torch.cat([state[k], up])
    return {f"model.diffusion_model.{k}": v for k, v in out.items()}


CASES = [("flux3", FLUX3, flux3_original, convert_flux3_transformer_checkpoint_to_diffusers),
         ("qwen21", QWEN21, qwen21_original, convert_qwen_image21_transformer_checkpoint_to_diffusers)]  # fmt: skip


@pytest.mark.parametrize("name,config,original,convert", CASES)
def test_original_layout_and_folder(name, config, original, convert, tmp_path):
    module, params = diffusers_model(config, seed=3)
    state = module.state_dict()
    orig = original(state)
    converted = convert({k.removeprefix("model.diffusion_model."): v for k, v in orig.items()})
    assert converted.keys() == state.keys() and all(torch.equal(converted[k], state[k]) for k in state)
    path = os.path.join(tmp_path, f"{name}.safetensors")
    save_file(orig, path)
    loaded = weights.load(path, config=config)
    assert all(torch.equal(loaded.flat()[k], v) for k, v in params.flat().items())
    module.save_pretrained(os.path.join(tmp_path, "folder"))
    folder = weights.load(os.path.join(tmp_path, "folder"))
    assert folder.config == config and all(torch.equal(folder.flat()[k], v) for k, v in params.flat().items())
    with pytest.raises(ValueError, match="config"):
        weights.load(path, config=fd.PRESETS["flux2-tiny"])


def _per_rank(rank, world, files):
    mesh = sharding.make_mesh(tp=2)
    out = {}
    for name, path, config in files:
        s = weights.load(path, config=config, mesh=mesh)
        ref = sharding.shard_params(weights.load(path, config=config), mesh)
        out[name] = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(s.leaves(), ref.leaves()))
    return out


def test_original_layout_per_rank(tmp_path):
    """With a mesh each rank reads only its slices; they equal sharding the whole tensors."""
    files = []
    for name, config, original, _ in CASES:
        module, _ = diffusers_model(config, seed=4)
        path = os.path.join(tmp_path, f"{name}.safetensors")
        save_file(original(module.state_dict()), path)
        files.append((name, path, config))
    for result in spawn(_per_rank, 2, files, init=False, timeout=300):
        assert result == {"flux3": True, "qwen21": True}
