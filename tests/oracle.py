"""The diffusers oracle: the diffusers class for a config, at the same weights as our params."""

from __future__ import annotations

import diffusers
import torch

import functional_dit as fd


def diffusers_model(config, seed: int = 0, dtype=torch.float32):
    """(diffusers module, Params sharing its storage) with `fd.init(config, seed)` weights."""
    cfg = fd.config_to_diffusers(config)
    cls = getattr(diffusers, cfg["_class_name"])
    module = cls(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    module.load_state_dict(fd.to_state_dict(fd.init(config, seed=seed)))
    module = module.to(dtype).eval().requires_grad_(False)
    return module, fd.from_diffusers(module)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_bf16_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 parity as the README states it: bitwise on the CPU, where we run the same
    kernels as diffusers in the same order. Other devices' kernels (CUDA, XLA) may fuse
    or block differently, so there allow about one bf16 ulp at |y| ~ 4 (2e-2)."""
    assert out.dtype == ref.dtype == torch.bfloat16
    if out.device.type == "cpu":
        assert torch.equal(out, ref), f"bf16 on CPU: expected bitwise equal, max abs error {max_err(out, ref):.3g}"
    else:
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
