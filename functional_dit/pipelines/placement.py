"""Where the parts of a pipeline around the transformer run in `fd.sample`: the text
encoders' placement (``encoder_placement``) and the VAE's tiled decoding (``vae_tiling``).

Placements (`PLACEMENTS`):

- ``"replicate"``: every rank holds whole encoders where they are (the default).
- ``"shard"``: the encoders are split over the params' mesh ``tp`` group with torch's
  ``parallelize_module`` and a plan per encoder class (`plan`): column-parallel q/k/v and
  MLP inputs, row-parallel outputs, vocabulary-parallel embeddings; the decoder entries
  are transformers' own ``base_model_tp_plan``. Every rank gets the same embeddings, so
  sampling continues unchanged. Sharding is done once, in place (the full weights are
  freed), and kept for later calls.
- ``"fsdp"``: ``"shard"``'s split, then every parameter fully sharded (`fully_shard`):
  what tp split over the params' mesh ``fsdp`` axis, what tp left whole (attention whose
  heads tp does not divide, vision towers, norms) over every rank of the fsdp x tp group
  (the ``tp`` group alone on a mesh without fsdp); each layer's shards are all-gathered
  just before it runs and freed after, the next layer's gather issued first (`sharding`'s
  coalesced block gathers, as ``fd.apply`` gathers the transformer's blocks).
- ``"cpu"``: the encoders move to the CPU and encode there; only the embeddings move to
  the transformer's device.
- ``"offload"``: the encoders live on the CPU between calls and move to the transformer's
  device only while they encode (as diffusers' ``enable_model_cpu_offload``).

docs/pipelines-across-ranks.md explains the choices and their memory per rank.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import sharding
from sharding.internal import finish_block, flat_mesh, fsdp_dim, is_dtensor, local_tensor, prefetching, start_block

PLACEMENTS = ("replicate", "shard", "fsdp", "cpu", "offload")
_ENCODERS = ("text_encoder", "text_encoder_2")
_SHARD_DIM = {"colwise": 0, "rowwise": 1, "vocab": 0, "embed_cols": 1}  # of the weight


def check(encoder_placement, vae_tiling) -> None:
    """ValueError naming the argument unless both are valid."""
    if encoder_placement not in PLACEMENTS:
        raise ValueError(f"encoder_placement: expected one of {list(PLACEMENTS)}, got {encoder_placement!r}")
    if not isinstance(vae_tiling, bool):
        raise ValueError(f"vae_tiling: expected True or False, got {vae_tiling!r}")


def encoders(pipe) -> dict:
    """The pipeline's text encoder modules by component name (absent or None ones left out)."""
    found = {n: getattr(pipe, n, None) for n in _ENCODERS}
    return {n: m for n, m in found.items() if isinstance(m, torch.nn.Module)}


# ----------------------------------------------------------------------------- plans


def _decoder_rules(prefix: str, cfg, tp: int) -> list[tuple[str, str]]:
    """Mistral / Qwen3 / Qwen2.5-VL / Qwen3-VL text stacks: transformers' base_model_tp_plan
    (Qwen3-VL's text config lists only its embedding; its decoder layers are Qwen3's, q/k
    norms per head included, so Qwen3's plan), with attention split only where tp divides
    the heads (k/v replicated for one KV head)."""
    H, K = cfg.num_attention_heads, cfg.num_key_value_heads
    layer, rules = f"{prefix}layers.*.", []
    if H % tp == 0 and (K % tp == 0 or K == 1):
        rules += [(layer + "self_attn.q_proj", "colwise"), (layer + "self_attn.o_proj", "rowwise")]
        rules += [(layer + f"self_attn.{n}_proj", "colwise") for n in "kv" if K % tp == 0]
    if cfg.intermediate_size % tp == 0:
        rules += [(layer + "mlp.gate_proj", "colwise"), (layer + "mlp.up_proj", "colwise")]
        rules += [(layer + "mlp.down_proj", "rowwise")]
    if cfg.vocab_size % tp == 0:
        rules += [(prefix + "embed_tokens", "vocab"), ("lm_head", "colwise")]
    return rules


def _t5_rules(cfg, tp: int) -> list[tuple[str, str]]:
    """T5EncoderModel (FLUX.1's text_encoder_2)."""
    rules, attn = [], "encoder.block.*.layer.0.SelfAttention."
    if cfg.num_heads % tp == 0:
        rules += [(attn + n, "colwise") for n in "qkv"] + [(attn + "o", "rowwise")]
        rules += [(attn + "relative_attention_bias", "embed_cols")]
    if cfg.d_ff % tp == 0:
        rules += [("encoder.block.*.layer.1.DenseReluDense.wi*", "colwise")]
        rules += [("encoder.block.*.layer.1.DenseReluDense.wo", "rowwise")]
    if cfg.vocab_size % tp == 0:
        rules += [("shared", "vocab"), ("encoder.embed_tokens", "vocab")]
    return rules


def _clip_rules(prefix: str, cfg, tp: int) -> list[tuple[str, str]]:
    """CLIPTextModel (FLUX.1's text_encoder)."""
    layer, rules = f"{prefix}encoder.layers.*.", []
    if cfg.num_attention_heads % tp == 0:
        rules += [(layer + f"self_attn.{n}_proj", "colwise") for n in "qkv"]
        rules += [(layer + "self_attn.out_proj", "rowwise")]
    if cfg.intermediate_size % tp == 0:
        rules += [(layer + "mlp.fc1", "colwise"), (layer + "mlp.fc2", "rowwise")]
    if cfg.vocab_size % tp == 0:
        rules += [(f"{prefix}embeddings.token_embedding", "vocab")]
    return rules


_VL_DECODERS = (  # a vision tower beside a decoder at model.language_model
    "Mistral3ForConditionalGeneration",  # FLUX.2-dev
    "Qwen2_5_VLForConditionalGeneration",  # Qwen-Image
    "Qwen3VLForConditionalGeneration",  # FLUX.3, Qwen-Image 2.1
)


def _rules(module, tp: int) -> list[tuple[str, str]]:
    name, cfg = type(module).__name__, module.config
    if name == "T5EncoderModel":
        return _t5_rules(cfg, tp)
    if name == "CLIPTextModel":
        return _clip_rules("text_model." if hasattr(module, "text_model") else "", cfg, tp)
    if name == "Qwen3ForCausalLM":
        return _decoder_rules("model.", cfg, tp)
    if name in _VL_DECODERS:
        return _decoder_rules("model.language_model.", cfg.text_config, tp)
    raise ValueError(
        f"encoder_placement: no tensor-parallel plan for a {name} text encoder; expected 'replicate', 'cpu' or "
        "'offload' for it"
    )


def plan(module, tp: int) -> dict[str, str]:
    """Module path -> style ("colwise", "rowwise", "vocab", "embed_cols") of every module of
    ``module`` split over ``tp`` ranks; the rest stays whole. Vision towers stay whole
    (text-to-image never runs them)."""
    rules = _rules(module, tp)
    out = {}
    for path, _ in module.named_modules():
        style = next((s for pattern, s in rules if fnmatch.fnmatchcase(path, pattern)), None)
        if style is not None:
            out[path] = style
    return out


PLANE = "fsdp_tp"  # the fsdp x tp ranks of a dp group as one axis (`sharding.internal.flat_mesh`, fsdp-major)


def _split(shape, tp_dim, tp_split: bool, tp: int, fsdp: int) -> tuple[str, int, int] | None:
    """(axis, size, dim) the ``"fsdp"`` placement splits a parameter of tp-local ``shape``
    over (None: kept as tp left it). ``tp_dim``: tp's dim (None: whole over tp);
    ``tp_split``: its module is in `plan` (a DTensor after `shard`, a row-parallel bias too).
    What tp splits is split further over "fsdp"; what tp leaves whole over every rank of the
    fsdp x tp group (`PLANE`) when a dim divides by fsdp x tp, else over "fsdp" (or "tp"
    alone on a mesh without fsdp). The dim is `sharding`'s `fsdp_dim` rule."""
    if tp_split:
        over = [("fsdp", fsdp)]
    elif tp > 1 and fsdp > 1:
        over = [(PLANE, tp * fsdp), ("fsdp", fsdp)]
    else:
        over = [("tp", tp), ("fsdp", fsdp)]
    for axis, n in over:
        dim = fsdp_dim(tuple(shape), {tp_dim} - {None}, n) if n > 1 else None
        if dim is not None:
            return axis, n, dim
    return None


def bytes_per_rank(module, tp: int, fsdp: int = 1, placement: str = "shard") -> int:
    """Parameter bytes one rank holds with ``module`` sharded over ``tp`` by `plan` (tied
    weights counted once per placement, as `shard` re-ties them) and, for ``placement=
    "fsdp"``, fully sharded by `fully_shard` on a mesh with those ``tp`` and ``fsdp`` sizes
    (`_split`); works on the meta device."""
    if placement not in ("shard", "fsdp"):
        raise ValueError(f"placement: expected 'shard' or 'fsdp', got {placement!r}")
    styles = plan(module, tp) if tp > 1 else {}
    seen, total = set(), 0
    for path, sub in module.named_modules(remove_duplicate=False):
        for pname, p in sub.named_parameters(recurse=False):
            style = styles.get(path)
            dim = _SHARD_DIM[style] if style is not None and not (style == "rowwise" and pname == "bias") else None
            if (id(p), dim) in seen:
                continue
            seen.add((id(p), dim))
            shape = list(p.shape)
            if dim is not None:
                shape[dim] //= tp
            split = _split(shape, dim, style is not None, tp, fsdp) if placement == "fsdp" else None
            if split is not None:
                shape[split[2]] //= split[1]
            total += math.prod(shape) * p.element_size()
    return total


# ----------------------------------------------------------------------------- shard


def _style(name: str):
    if name == "vocab":
        return RowwiseParallel(input_layouts=Replicate())
    return ColwiseParallel() if name in ("colwise", "embed_cols") else RowwiseParallel()


def _local_heads(module, styles: dict, tp: int) -> None:
    """Head counts the attention modules read in forward, made this rank's."""
    for path, sub in module.named_modules():
        if f"{path}.q" in styles and hasattr(sub, "n_heads"):  # T5Attention
            sub.n_heads, sub.inner_dim = sub.n_heads // tp, sub.inner_dim // tp
        sharded_q, sharded_k = f"{path}.q_proj" in styles, f"{path}.k_proj" in styles
        if sharded_q and not sharded_k and hasattr(sub, "num_key_value_groups"):  # one KV head, replicated
            sub.num_key_value_groups //= tp


def _retie(module, before: dict, styles: dict) -> None:
    """Weights tied before sharding (T5's shared embedding, tied LM heads) and split alike
    share one shard again."""
    first: dict = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        if "weight" not in sub._parameters or path not in before:
            continue
        key = (before[path], _SHARD_DIM.get(styles.get(path)))
        if key in first:
            sub.weight = first[key]
        else:
            first[key] = sub.weight


def shard(module, tp_mesh, device=None) -> None:
    """Split ``module`` in place over ``tp_mesh`` (1-D) by `plan`, once, then move it to
    ``device`` (a module on the host is split first, one weight at a time, so no rank
    holds it whole on the device)."""
    if getattr(module, "_fd_tp_mesh", None) is not None:
        return
    tp = tp_mesh.size()
    styles = plan(module, tp)
    before = {p: id(m.weight) for p, m in module.named_modules(remove_duplicate=False) if "weight" in m._parameters}
    for path, style in styles.items():
        parallelize_module(module.get_submodule(path), tp_mesh, _style(style))
    _retie(module, before, styles)
    _local_heads(module, styles, tp)
    module._fd_tp_mesh = tp_mesh
    if device is not None:
        module.to(device)


def _size(mesh, axis: str) -> int:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return mesh.size(names.index(axis)) if mesh is not None and axis in names else 1


def _tp_mesh(mesh):
    return mesh["tp"] if _size(mesh, "tp") > 1 else None


# ----------------------------------------------------------------------------- fully shard


class _Param:
    """One fully sharded parameter of a layer: where it sits (``sub._parameters[name]``),
    its resting DTensor (``rest``: this rank's shard), the axis and dim it is split on and
    how to rebuild the tp-local whole as tp placed it (``tp``: (mesh, placements, shape,
    stride) of the DTensor `shard` made, or None for a plain tensor)."""

    __slots__ = ("sub", "name", "rest", "axis", "dim", "tp")

    def __init__(self, sub, name, rest, axis, dim, tp):
        self.sub, self.name, self.rest, self.axis, self.dim, self.tp = sub, name, rest, axis, dim, tp

    def whole(self, full: torch.Tensor):
        """The gathered tp-local ``full`` as the module computes with it."""
        if self.tp is None:
            return full
        mesh, placements, shape, stride = self.tp
        return DTensor.from_local(full, mesh, placements, run_check=False, shape=shape, stride=stride)


class _Unit:
    """A layer's fully sharded parameters (`_Param`), gathered by a forward pre-hook in one
    coalesced all-gather per axis they are split over (``sharding``'s block gather; ``meshes``:
    the mesh to bind for each axis) and put back to their shards by a forward hook; ``next``:
    the layer after it in its ``ModuleList``, whose gathers the pre-hook issues before this
    layer computes."""

    def __init__(self, meshes: dict):
        self.meshes, self.params, self.pending, self.next = meshes, [], None, None

    def _groups(self) -> dict:
        """``{axis: (indices into params, shards, dims)}``."""
        out: dict = {}
        for i, p in enumerate(self.params):
            ix, xs, dims = out.setdefault(p.axis, ([], [], []))
            ix.append(i)
            xs.append(local_tensor(p.rest))
            dims.append(p.dim)
        return out

    def start(self) -> None:
        if self.pending is None:
            self.pending = {}
            for axis, (_, xs, dims) in self._groups().items():
                with sharding.bind(self.meshes[axis]):
                    self.pending[axis] = start_block(xs, dims, axis)

    def gather(self, module, args) -> None:
        with torch.no_grad():
            self.start()
            if self.next is not None and prefetching():  # sharding.fsdp_options(prefetch=False): none ahead
                self.next.start()  # in flight while this layer computes
            pending, self.pending = self.pending, None
            for axis, (ix, xs, dims) in self._groups().items():
                with sharding.bind(self.meshes[axis]):
                    fulls = finish_block(xs, dims, pending[axis], axis)
                for i, full in zip(ix, fulls):
                    p = self.params[i]
                    p.sub._parameters[p.name] = p.whole(full)

    def release(self, module, args, output) -> None:
        for p in self.params:
            p.sub._parameters[p.name] = p.rest


def _unit_paths(module) -> set:
    """Paths of the modules that are items of a ``ModuleList`` (the repeated layers)."""
    return {
        f"{p}.{k}" if p else k
        for p, m in module.named_modules()
        if isinstance(m, torch.nn.ModuleList)
        for k in m._modules
    }


def _unit_of(path: str, items: set) -> str:
    """The unit a parameter of the module at ``path`` gathers with: its outermost ancestor
    that is a ``ModuleList`` item (a layer), else the module itself."""
    parts = path.split(".")
    return next((".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in items), path)


def _rest(local: torch.Tensor, p, split: tuple[str, int, int], mesh):
    """This rank's shard of ``local`` (``p``'s tp-local data) on ``split``'s dim as a frozen
    Parameter holding a DTensor placed honestly: on ``mesh``'s (fsdp, tp) dims (``Shard(dim)``
    on both for the fsdp x tp plane, fsdp-major), or its fsdp or tp dim alone
    (``full_tensor()`` is the whole weight)."""
    axis, n, dim = split
    index = _plane_index(mesh) if axis == PLANE else mesh.get_local_rank(axis)
    chunk = local.shape[dim] // n
    mine = local.narrow(dim, index * chunk, chunk).clone()
    mine = mine.to(mesh.device_type) if local.device.type != mesh.device_type else mine
    if axis == PLANE:
        where, placements = mesh["fsdp", "tp"], [Shard(dim), Shard(dim)]
    elif axis == "tp":
        where, placements = mesh["tp"], [Shard(dim)]
    elif "tp" in mesh.mesh_dim_names:
        where, placements = mesh["fsdp", "tp"], [Shard(dim), p.placements[0] if is_dtensor(p) else Replicate()]
    else:
        where, placements = mesh["fsdp"], [Shard(dim)]
    rest = DTensor.from_local(mine, where, placements, run_check=False, shape=p.shape, stride=p.stride())
    return torch.nn.Parameter(rest, requires_grad=False)


def _plane_index(mesh) -> int:
    """This rank's index in the fsdp x tp plane, fsdp-major (`flat_mesh`'s order, DTensor's
    for ``[Shard(d), Shard(d)]``)."""
    return mesh.get_local_rank("fsdp") * _size(mesh, "tp") + mesh.get_local_rank("tp")


def _meshes(mesh, splits) -> dict:
    """The mesh to bind for each axis among ``splits``: ``mesh`` itself for "fsdp" and "tp",
    the flattened fsdp x tp plane for `PLANE` (made here: collective, every rank calls it)."""
    out = {axis: mesh for axis in ("fsdp", "tp")}
    if any(s[0] == PLANE for s in splits):
        out[PLANE] = flat_mesh(mesh, ("fsdp", "tp"), PLANE)
    return out


def fully_shard(module, mesh) -> None:
    """Fully shard ``module`` (tp-split by `shard` first, where the mesh has tp) in place,
    once, on a mesh with "fsdp" or "tp" above 1: each parameter's tp-local data split as
    `_split` says (what tp split over "fsdp"; what tp left whole over the fsdp x tp plane,
    or over "tp" alone on a mesh without fsdp), the rest kept as tp left it; every layer (a
    ``ModuleList`` item) and every other module owning such parameters gathers them in one
    all-gather per axis just before it runs (`_Unit`). The gathers are collectives: every
    rank of the group must run the same layers, in the same order, the same number of times
    (as every rank of a tp group encodes the same prompts)."""
    tp, fsdp = _size(mesh, "tp"), _size(mesh, "fsdp")
    if max(tp, fsdp) == 1 or getattr(module, "_fd_fsdp", None) is not None:
        return
    found = []
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            tp_dim = next((q.dim for q in p.placements if hasattr(q, "dim")), None) if is_dtensor(p) else None
            split = _split(local_tensor(p).shape, tp_dim, is_dtensor(p), tp, fsdp)
            if split is not None:
                found.append((path, sub, name, p, split))
    meshes = _meshes(mesh, [f[4] for f in found])
    items, units, made = _unit_paths(module), {}, {}
    for path, sub, name, p, split in found:
        if id(p) not in made:  # tied weights: one shard, gathered by each module that reads it
            tp_as = (p.device_mesh, p.placements, p.shape, p.stride()) if is_dtensor(p) else None
            made[id(p)] = (_rest(local_tensor(p).detach(), p, split, mesh), tp_as)
        rest, tp_as = made[id(p)]
        sub._parameters[name] = rest
        units.setdefault(_unit_of(path, items), _Unit(meshes)).params.append(
            _Param(sub, name, rest, split[0], split[2], tp_as)
        )
    for path, unit in units.items():
        head, _, index = path.rpartition(".")
        unit.next = units.get(f"{head}.{int(index) + 1}" if head else str(int(index) + 1)) if index.isdigit() else None
        target = module.get_submodule(path)
        target.register_forward_pre_hook(unit.gather)
        target.register_forward_hook(unit.release, always_call=True)
    module._fd_fsdp = (tp, fsdp)


# ----------------------------------------------------------------------------- placement


@contextlib.contextmanager
def _encode_on(pipe, device):
    """The pipeline's ``encode_prompt`` with ``device=`` this device while inside."""
    own = pipe.__dict__.get("encode_prompt")
    stock = pipe.encode_prompt

    def encode_prompt(*args, **kwargs):
        return stock(*args, **{**kwargs, "device": device})

    pipe.encode_prompt = encode_prompt
    try:
        yield
    finally:
        if own is None:
            del pipe.encode_prompt
        else:
            pipe.encode_prompt = own


@contextlib.contextmanager
def placed(pipe, placement: str, mesh, device):
    """Inside: ``pipe``'s text encoders placed as ``placement`` says (`PLACEMENTS`), for a
    transformer on ``device`` whose params live on ``mesh`` (or None)."""
    mods = encoders(pipe)
    sharded = [n for n, m in mods.items() if any(getattr(m, a, None) is not None for a in ("_fd_tp_mesh", "_fd_fsdp"))]
    if placement in ("cpu", "offload") and sharded:
        raise ValueError(
            f"encoder_placement: {sharded} are sharded already (an earlier 'shard' or 'fsdp'); expected 'shard' or "
            "'fsdp'"
        )
    for m in mods.values() if placement in ("shard", "fsdp") else ():
        if _tp_mesh(mesh) is not None:
            shard(m, _tp_mesh(mesh))
        if placement == "fsdp":
            fully_shard(m, mesh)
        m.to(device)  # (whole, where the transformer is, when there is nothing to split over)
    if placement not in ("cpu", "offload"):
        yield
        return
    run_on = torch.device("cpu") if placement == "cpu" else torch.device(device)
    for m in mods.values():
        m.to(run_on)
    try:
        with _encode_on(pipe, run_on):
            yield
    finally:
        if placement == "offload":
            for m in mods.values():
                m.to("cpu")


def load_to(pipe, device, placement: str) -> None:
    """After loading on the host: every component on ``device`` except text encoders that
    `placed` moves itself ("shard": split first; "cpu", "offload": kept on the host)."""
    keep = set(encoders(pipe)) if placement != "replicate" else set()
    for name, m in pipe.components.items():
        if isinstance(m, torch.nn.Module) and name not in keep:
            m.to(device)


def cli_kwargs(args) -> dict:
    """``generate --encoders --vae-tiling`` as `fd.sample` keyword arguments."""
    return {"encoder_placement": args.encoders, "vae_tiling": args.vae_tiling}


@contextlib.contextmanager
def tiling(pipe, on: bool):
    """Inside: the VAE decodes in tiles when ``on`` (diffusers' ``enable_tiling``); its own
    setting is restored after."""
    vae = getattr(pipe, "vae", None)
    was = getattr(vae, "use_tiling", None)
    if on and vae is not None:
        vae.enable_tiling()
    try:
        yield
    finally:
        if on and vae is not None and not was:
            vae.disable_tiling()
