"""`fd.sample`'s steps for QwenImage21Pipeline (text to image): the Qwen3-VL prompt with
its image-slot mask, unpatched latents (one token per 16x16 pixels), true CFG as two
calls (each branch has its own token layout) and the prefix KV cache per branch
(extracted on the first step, read on the later ones), as the pipeline does."""

from __future__ import annotations

import torch

from .. import flux3, qwenimage21
from ._steps import Prompt, Steps


class Qwen21(Steps):
    cfg_on_device = True
    cfg_calls = 2  # with CFG, one model call per branch per step (a step cache keeps a state per call)

    def __init__(self, params, pipe, kv_cache: bool | None):
        self.params, self.pipe, self.c = params, pipe, params.config
        self.kv = params.config.causal_condition if kv_cache is None else bool(kv_cache)
        if self.kv and not self.c.causal_condition:
            raise ValueError(
                "kv_cache: Qwen-Image 2.1's prefix cache needs causal_condition=True; expected None or False"
            )
        self.pads, self.branches, self.caches = [], None, {}

    def encode(self, prompts, msl):
        txt, mask, pad = self.pipe.encode_prompt(prompt=prompts, device=self.pipe._execution_device)
        self.pads.append(pad)
        return Prompt(txt, mask=mask)

    def cfg_batch(self, cond, uncond):
        """Both branches kept apart (their layouts differ); the loop's batch of 2B is split."""
        self.branches = (cond, uncond)
        return cond

    def noise_shape(self, B, h, w):
        return (B, 1, self.c.in_channels, h, w)

    @staticmethod
    def pack(z):
        """(B, 1, C, h, w) -> (B, h·w, C): one token per latent pixel."""
        return z.flatten(3).squeeze(1).transpose(1, 2)

    take = staticmethod(lambda latents: latents)  # latents= given packed

    def prepare(self, cond, h, w, guidance, device):
        """Each branch's joint-sequence layout, read from its image-slot mask on the host
        once per run (the steps then read nothing there)."""
        self.shape = (1, h, w)
        self.layouts = [self._layout(pad, h * w, device) for pad in self.pads]

    def _layout(self, pad, S: int, device):
        slots = torch.cat([pad, pad.new_ones(pad.shape[0], S // 4)], 1)
        return qwenimage21.read_layout(slots, [[self.shape]] * pad.shape[0], pad.shape[1], S, device)

    def _branch(self, i: int, x, t, p):
        B, S = x.shape[:2]
        kw = dict(txt_mask=p.mask, img_shapes=[[self.shape]] * B, layout=self.layouts[i])
        if not self.kv:
            return self.apply(self.params, x, t, p.txt, **kw)[:, -S:]
        if i not in self.caches:
            out, self.caches[i] = self.apply(self.params, x, t, p.txt, kv_cache="extract", **kw)
            return out[:, -S:]
        return self.apply(self.params, x, t, p.txt, kv_cache=self.caches[i], **kw)[:, -S:]

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


class Flux3(Steps):
    """The modular Flux3 pipelines, text to image: stacked Qwen3-VL hidden states (one
    prompt per encoder call, right-padded to a multiple of 80 tokens), 2x2-patchified
    128-channel latents as tokens, 4-axis ids with the image H/W scaled by 0.5, a
    constant-shift schedule, CFG (the base model's guider) as one batch, and for a flow
    map the target timestep (the next scheduler timestep, 0 after the last)."""

    PAD_MULTIPLE, ROPE_SCALE = 80, 0.5  # modular_pipelines/flux3: Flux3TextEncoderStep, Flux3PrepareLatentsStep

    def __init__(self, params, pipe):
        self.params, self.pipe, self.c = params, pipe, params.config

    def _layers(self) -> tuple:
        """The encoder layers stacked: diffusers' default (4, 8, ..., 32), or as many evenly
        spaced layers as joint_attention_dim holds for a shallower encoder."""
        te = self.pipe.text_encoder
        n = self.c.joint_attention_dim // te.config.text_config.hidden_size
        L_ = te.config.text_config.num_hidden_layers
        return tuple(range(4, 33, 4)) if L_ >= 32 and n == 8 else tuple(round((k + 1) * L_ / n) for k in range(n))

    def encode(self, prompts, msl):
        from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

        embed = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds
        pipe, kw = self.pipe, dict(max_sequence_length=msl or 8192, pad_multiple=self.PAD_MULTIPLE)
        txts = [embed(pipe.text_encoder, pipe.tokenizer, p, hidden_states_layers=self._layers(), **kw) for p in prompts]
        if len({t.shape[1] for t in txts}) != 1:
            raise ValueError(f"prompt: FLUX.3 prompts of different padded lengths {[t.shape[1] for t in txts]}")
        txt = torch.cat(txts)
        T = txt.shape[1]
        ids = torch.stack([torch.zeros(T), torch.zeros(T), torch.zeros(T), torch.arange(T) * 1.0], -1)
        return Prompt(txt, txt_ids=ids)

    def noise_shape(self, B, h, w):
        return (B, self.c.in_channels, h // 2, w // 2)

    @staticmethod
    def pack(z):
        """(B, C, h/2, w/2) -> (B, h/2·w/2, C): the patchified latents as tokens."""
        return z.flatten(2).transpose(1, 2)

    take = staticmethod(lambda latents: latents)  # latents= given packed

    def prepare(self, cond, h, w, guidance, device):
        rows, cols = torch.meshgrid(torch.arange(h // 2) * 1.0, torch.arange(w // 2) * 1.0, indexing="ij")
        zeros = torch.zeros(rows.numel())
        img_ids = torch.stack(
            [zeros, rows.reshape(-1) * self.ROPE_SCALE, cols.reshape(-1) * self.ROPE_SCALE, zeros], -1
        )
        self.rope = flux3.rope_table(self.c, img_ids.to(device), cond.txt_ids.to(device))
        self.step = 0

    def schedule(self, sched):
        self.timesteps = sched.timesteps

    @staticmethod
    def _target(ts, i: int, batch: int, dtype) -> torch.Tensor:
        """Step i's flow-map target: the next timestep / 1000, 0 after the last."""
        nxt = ts[i + 1] if i + 1 < len(ts) else torch.zeros_like(ts[i])
        return (nxt / 1000).expand(batch).to(dtype)

    def step_inputs(self, sched, batch, dtype):
        """The flow map's target timestep per step, for the fixed-graph loop."""
        if not self.c.flow_map:
            return super().step_inputs(sched, batch, dtype)
        return [{"target": self._target(sched.timesteps, i, batch, dtype)} for i in range(len(sched.timesteps))]

    def __call__(self, x, t, cond, target=None):
        if target is None and self.c.flow_map:  # the usual loop: read from the schedule here
            target = self._target(self.timesteps, self.step, x.shape[0], x.dtype)
            self.step += 1
        return self.apply(self.params, x, t, cond.txt, rope=self.rope, target_timestep=target)

    def decode_latents(self, x, h, w):
        vae = self.pipe.vae
        B, _, C = x.shape
        z = x.transpose(1, 2).reshape(B, C, h // 2, w // 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = z * std + mean
        return z.reshape(B, C // 4, 2, 2, h // 2, w // 2).permute(0, 1, 4, 2, 5, 3).reshape(B, C // 4, h, w)
