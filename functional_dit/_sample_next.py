"""`fd.sample`'s steps for QwenImage21Pipeline (text to image): the Qwen3-VL prompt with
its image-slot mask, unpatched latents (one token per 16x16 pixels), true CFG as two
calls (each branch has its own token layout) and the prefix KV cache per branch
(extracted on the first step, read on the later ones), as the pipeline does."""

from __future__ import annotations

import torch

from . import _api


class Qwen21:
    def __init__(self, params, pipe, kv_cache: bool | None):
        self.params, self.pipe, self.c = params, pipe, params.config
        self.kv = params.config.causal_condition if kv_cache is None else bool(kv_cache)
        if self.kv and not self.c.causal_condition:
            raise ValueError(
                "kv_cache: Qwen-Image 2.1's prefix cache needs causal_condition=True; expected None or False"
            )
        self.pads, self.branches, self.caches = [], None, {}

    def encode(self, prompts, msl):
        from ._sample import Prompt

        txt, mask, pad = self.pipe.encode_prompt(prompt=prompts, device=self.pipe._execution_device)
        self.pads.append(pad)
        return Prompt(txt, mask=mask)

    def cfg_batch(self, cond, uncond):
        """Both branches kept apart (their layouts differ); the loop's batch of 2B is split."""
        self.branches = (cond, uncond)
        return cond

    def latents(self, B, h, w, seed, dtype, device):
        from ._sample import _noise

        z = _noise((B, 1, self.c.in_channels, h, w), seed, dtype, device)
        return z.view(B, self.c.in_channels, h * w).transpose(1, 2)

    def prepare(self, cond, h, w, guidance, device):
        self.shape = (1, h, w)

    def _branch(self, i: int, x, t, p):
        B, S = x.shape[:2]
        pad = self.pads[i].to(x.device)
        slots = torch.cat([pad, pad.new_ones(pad.shape[0], S // 4)], 1)
        kw = dict(txt_mask=p.mask, img_shapes=[[self.shape]] * B, img_mask=slots)
        if not self.kv:
            return _api.apply(self.params, x, t, p.txt, **kw)[:, -S:]
        if i not in self.caches:
            out, self.caches[i] = _api.apply(self.params, x, t, p.txt, kv_cache="extract", **kw)
            return out[:, -S:]
        return _api.apply(self.params, x, t, p.txt, kv_cache=self.caches[i], **kw)[:, -S:]

    def __call__(self, x, t, cond):
        if self.branches is None:
            return self._branch(0, x, t, cond)
        (x1, x2), (t1, t2) = x.chunk(2), t.chunk(2)
        return torch.cat([self._branch(0, x1, t1, self.branches[0]), self._branch(1, x2, t2, self.branches[1])])

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        z = x.transpose(1, 2).reshape(x.shape[0], -1, 1, h, w).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        return z * std + mean
