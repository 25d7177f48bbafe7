"""What `bench`, ``bench --sampling`` and `check` run on: the mid-size configs, random
weights, one image's inputs per family, the diffusers module holding the same weights,
and the machine's description for reports."""

from __future__ import annotations

import dataclasses
import os
import platform

import torch

import sharding

from .. import api as _api
from .. import families
from ..pipelines.families import product as _product

IMG_HW = (32, 32)  # 1024 image tokens
TXT_LEN = 128


def mid_configs() -> dict:
    """The mid-size configs (8 heads x 64 = 512 wide, ~37-44 M params each), by family key
    (each family product's ``MID_CONFIG``)."""
    return {fam.KEY: _product(fam).MID_CONFIG for fam in families.FAMILIES}


def random_params(config, device, dtype, seed: int = 0):
    """`fd.init`'s params; on an accelerator drawn there (`fd.init` draws on the CPU, minutes
    for a released preset's 10-30 B parameters), the same distribution, other values."""
    if torch.device(device).type == "cpu":
        return _api.init(config, seed=seed, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    specs = sharding.tree.flatten(_api.param_specs(config))
    return _api.Params(config, sharding.tree.nest({k: _api.init_leaf(k, s, gen).to(dtype) for k, s in specs.items()}))


def released_depth(name: str, config):
    """A mid config with the block counts of its family's released model (``--depth
    released``): mid width, real depth, where compile time per block matters."""
    preset = _api.PRESETS[_product(name).RELEASED]
    kw = {"num_layers": preset.num_layers}
    if hasattr(preset, "num_single_layers"):
        kw["num_single_layers"] = preset.num_single_layers
    return dataclasses.replace(config, **kw)


def one_block(config):
    """The same config with one block of each kind (for the one-block compile time)."""
    kw = {"num_layers": 1}
    if hasattr(config, "num_single_layers"):
        kw["num_single_layers"] = 1
    return dataclasses.replace(config, **kw)


def inputs(config, device, dtype, seed: int = 0, hw=IMG_HW, txt_len: int = TXT_LEN):
    """(fd.apply kwargs, diffusers forward kwargs) for one image of ``hw`` latent tokens."""
    g = torch.Generator().manual_seed(seed)
    h, w = hw
    x = torch.randn(1, h * w, config.in_channels, generator=g).to(device, dtype)
    t = torch.rand(1, generator=g).to(device)
    width = getattr(config, "joint_attention_dim", None) or config.context_in_dim  # Qwen-Image 2.1: context_in_dim
    txt = torch.randn(1, txt_len, width, generator=g).to(device, dtype)
    return _product(config).bench_inputs(config, x, t, txt, h, w, device, dtype, g)


def _holds_meta_state(module) -> bool:
    """A parameter-free module left with meta tensors (buffers or plain attributes)."""
    if any(True for _ in module.parameters()):
        return False
    tensors = list(module.buffers(recurse=False))
    for v in vars(module).values():  # plain attributes: a table, or a list of them (Qwen-Image 2.1)
        tensors += v if isinstance(v, (list, tuple)) else [v]
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


def diffusers_module(params, device, dtype):
    """The diffusers class of ``params.config`` holding the same weights (a copy)."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    def build(config):
        cfg = _api.config_to_diffusers(config)
        return getattr(diffusers, cfg["_class_name"])(**{k: v for k, v in cfg.items() if not k.startswith("_")})

    with torch.device("meta"):  # no full-size random init (a released preset's shape on a GPU)
        module = build(params.config)
    module.load_state_dict({k: v.detach().clone() for k, v in params.flat().items()}, assign=True)
    stale = [name for name, sub in module.named_modules() if name and _holds_meta_state(sub)]
    if stale:  # tables that are not weights (Qwen-Image's RoPE): the modules of a real one-block model
        donor = build(one_block(params.config))
        for name in stale:
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent), leaf, donor.get_submodule(name))
    return module.to(device).eval().requires_grad_(False)  # weights already in dtype


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform`` elsewhere)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def machine_kind() -> str:
    """What a BENCHMARKS.md section is about: the CPU model and, with CUDA, the GPU model."""
    gpu = f" + {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu_model()}{gpu}"


def machine() -> str:
    # diffusers: seconds to import, loaded when first used
    import diffusers

    dev = ""
    if torch.cuda.is_available():
        dev = f", GPU {torch.cuda.get_device_name()}"
    load = f"; load average {os.getloadavg()[0]:.1f} at the end" if hasattr(os, "getloadavg") else ""
    return (
        f"{cpu_model()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads{dev}{load}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, diffusers {diffusers.__version__}"
    )
