"""The LoRA adapter pytree: `LoraConfig` (static) and `Adapter` (factors as leaves).

An adapter holds, for every adapted linear module ``m`` of a base model, the factors
``A`` = ``m.lora_A.weight`` (rank, in) and ``B`` = ``m.lora_B.weight`` (out, rank) of
the low-rank update ``W + s * (alpha / rank) * B @ A`` (Hu et al., "LoRA", 2021; PEFT's
``LoraLayer``). PEFT's two variants add one leaf per module: ``lora_bias`` a bias
``m.lora_B.bias`` (out,) on ``B`` (the update is ``s * (B @ A @ x + b)``), ``use_dora``
a magnitude ``m.lora_magnitude_vector`` (out,) (DoRA, Liu et al. 2024, PEFT's
``DoraLinearLayer``: the layer's output is ``mag / ||W + s B A||_row * (W + s B A) x``
plus its bias, the row norm detached). Like `functional_dit.Params`, its flattened dotted paths are the
diffusers/PEFT state-dict keys (without the pipeline's ``transformer.`` prefix), its
config is static metadata, and it is a pytree for ``torch.func`` and optree alike.

Each factor has a `ParamSpec` derived from its base weight's: ``A`` keeps the base's
input axis, ``B`` its output axis (with the fused blocks of either), the rank axis is
``"lora_rank"``. So `sharding.plan` / `sharding.shard_params` place the factors from
the same rules as the base: the factor on the base's sharded dim is sharded (per block
for a fused projection), the other replicated; a bias and a magnitude follow ``B``'s
output axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

import sharding
from sharding.tree import flatten, get, nest

from ..params import Params, ParamSpec, register_tree_node

RANK = "lora_rank"  # logical axis of a factor's rank dim; no rule maps it: replicated


def linear_modules(config) -> dict[str, ParamSpec]:
    """``{module path: weight ParamSpec}`` of every linear layer of a base model config
    (read through the one-method protocol ``config.param_specs()``, as `sharding.plan` does)."""
    specs = flatten(config.param_specs())
    return {k[: -len(".weight")]: s for k, s in specs.items() if k.endswith(".weight") and len(s.shape) == 2}


def factor_specs(weight: ParamSpec, rank: int, bias: bool = False, dora: bool = False) -> dict:
    """``{"lora_A": {"weight": spec}, "lora_B": {"weight": spec}}`` for a base ``weight`` spec,
    with ``lora_B.bias`` (``bias``) and ``lora_magnitude_vector`` (``dora``) on its output axis."""
    (out_dim, in_dim), (out_axis, in_axis) = weight.shape, weight.axes
    blocks = weight.blocks
    a_blocks = blocks if weight.block_dim == 1 else None
    b_blocks = blocks if weight.block_dim == 0 else None
    out = ParamSpec((out_dim,), (out_axis,), b_blocks)
    specs = {
        "lora_A": {"weight": ParamSpec((rank, in_dim), (RANK, in_axis), a_blocks)},
        "lora_B": {"weight": ParamSpec((out_dim, rank), (out_axis, RANK), b_blocks)} | ({"bias": out} if bias else {}),
    }
    return specs | ({"lora_magnitude_vector": out} if dora else {})


def weight_norm(
    W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s, axis: str | None = None, fsdp: int | None = None
) -> torch.Tensor:
    """DoRA's ``||W + s * B @ A||`` per output row (out,), in the adapter's dtype and
    detached, as PEFT's ``DoraLinearLayer.get_weight_norm``. ``axis``: the mesh axis a
    row-parallel ``W`` and ``A`` hold their columns on; the squares are summed over it.
    ``fsdp``: the dim ``W`` is this rank's "fsdp" slice on (fully sharded params; ``A`` and
    ``B`` whole, tp-local): each rank squares only its slice of ``W + s B A`` (the matching
    slice of ``B``'s rows or ``A``'s columns) and the squares are summed over "fsdp" (a
    column slice) or all-gathered (a row slice), so no rank holds the whole weight."""
    with torch.no_grad():
        A, B = A.detach(), B.detach()
        if fsdp == 0:
            B = fsdp_slice(B, 0)
        elif fsdp == 1:
            A = fsdp_slice(A, 1)
        w = W.detach().to(A.dtype) + s * (B @ A)
        whole = axis is None or sharding.axis_size(axis) == 1
        if fsdp is None and whole:
            return torch.linalg.norm(w, dim=1).to(w.dtype)
        sq = w.square().sum(1)
        if fsdp == 0:
            sq = sharding.all_gather(sq, "fsdp", 0)
        elif fsdp == 1:
            sq = sharding.psum(sq, "fsdp")
        return (sq if whole else sharding.psum(sq, axis)).sqrt()


def fsdp_slice(full: torch.Tensor, dim: int | None) -> torch.Tensor:
    """This rank's "fsdp" slice of the (tp-local) ``full`` on ``dim`` (the bound mesh's
    even split, as `sharding.plan`'s `FullyShard` places it); ``full`` when ``dim`` is None."""
    if dim is None:
        return full
    chunk = full.shape[dim] // sharding.axis_size("fsdp")
    return full.narrow(dim, sharding.axis_index("fsdp") * chunk, chunk)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What an adapter adapts: the ``base`` model config and, per module, its ``rank`` and
    ``alpha`` (``modules``: a tuple of ``(path, rank, alpha)``, in the base's order). The
    update of module ``m`` is scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with
    ``use_rslora``, PEFT's rank-stabilised LoRA), times the scale the caller passes.
    ``lora_bias`` / ``use_dora``: every module has a ``lora_B.bias`` / a
    ``lora_magnitude_vector`` (PEFT's fields; PEFT does not combine them, nor do we)."""

    base: object
    modules: tuple[tuple[str, int, float], ...]
    use_rslora: bool = False
    lora_bias: bool = False
    use_dora: bool = False

    def __post_init__(self):
        for name in ("use_rslora", "lora_bias", "use_dora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.lora_bias and self.use_dora:
            raise ValueError("lora_bias: a LoRA bias is not supported with DoRA (nor by PEFT); got use_dora=True too")
        known = linear_modules(self.base)
        bad = [m for m, _, _ in self.modules if m not in known]
        if bad:
            raise ValueError(f"modules: {bad[:10]} are not linear layers of {type(self.base).__name__}")
        for m, r, a in self.modules:
            if not (isinstance(r, int) and r > 0) or not math.isfinite(a):
                raise ValueError(f"modules: {m}: expected a positive int rank and a finite alpha, got {r!r}, {a!r}")
        # Each module's scale, computed once and kept on the instance (not a field: eq and hash ignore
        # it). Not a functools.cached_property: its RLock (Python < 3.12) is a context manager
        # torch.compile cannot trace, a graph break in every fd.apply(..., lora=...).
        scales = {m: a / math.sqrt(r) if self.use_rslora else a / r for m, r, a in self.modules}
        object.__setattr__(self, "_scales", scales)

    def scale(self, module: str) -> float:
        """``alpha / rank`` (or ``alpha / sqrt(rank)``) of ``module``."""
        return self.__dict__["_scales"][module]

    def param_specs(self) -> dict:
        """Nested dict of the factors' `ParamSpec` s (read by `sharding.plan`)."""
        known = linear_modules(self.base)
        flags = self.lora_bias, self.use_dora
        specs = {m: flatten(factor_specs(known[m], r, *flags)) for m, r, _ in self.modules}
        return nest({f"{m}.{k}": s for m, leaves in specs.items() for k, s in leaves.items()})


class Adapter(Params):
    """LoRA factors: ``config`` (a `LoraConfig`) and ``tree`` (nested dicts whose dotted
    paths are ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``, and
    ``<module>.lora_B.bias`` / ``<module>.lora_magnitude_vector`` where the config says).
    Treat it as immutable; a pytree like `Params` (``torch.func.grad`` over it returns an Adapter)."""

    __slots__ = ()

    def factors(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        return get(self.tree, f"{module}.lora_A.weight"), get(self.tree, f"{module}.lora_B.weight")

    def bias(self, module: str) -> torch.Tensor | None:
        """``lora_B``'s bias of ``module`` (None without ``lora_bias``)."""
        return self._leaf(f"{module}.lora_B.bias", "lora_bias") if self.config.lora_bias else None

    def magnitude(self, module: str) -> torch.Tensor | None:
        """DoRA's magnitude vector of ``module`` (None without ``use_dora``)."""
        return self._leaf(f"{module}.lora_magnitude_vector", "use_dora") if self.config.use_dora else None

    def _leaf(self, path: str, flag: str) -> torch.Tensor:
        try:
            return get(self.tree, path)
        except KeyError:
            raise ValueError(f"adapter: its config has {flag}=True but its tree has no {path}") from None

    def replace(self, tree: Mapping) -> Adapter:
        return Adapter(self.config, tree)

    def __repr__(self) -> str:
        n = sum(t.numel() for t in self.leaves() if isinstance(t, torch.Tensor))
        ranks = sorted({r for _, r, _ in self.config.modules})
        return (
            f"Adapter({type(self.config.base).__name__}, {len(self.config.modules)} modules, "
            f"rank {ranks[0] if len(ranks) == 1 else ranks}, {n:,} elements)"
        )


register_tree_node(Adapter, lambda a: a.config, Adapter)


def base_config(params_or_config):
    """The base model config of ``params_or_config`` (`Params` or a model config)."""
    config = params_or_config.config if isinstance(params_or_config, Params) else params_or_config
    if not callable(getattr(config, "param_specs", None)):
        raise ValueError(
            f"params_or_config: expected Params or a model config (fd.as_config(name) for a preset), "
            f"got {type(params_or_config).__name__}"
        )
    return config


def init(
    params_or_config,
    rank: int = 4,
    targets=None,
    alpha: float | None = None,
    seed: int = 0,
    dtype=torch.float32,
    device="cpu",
    zero_b: bool = True,
    lora_bias: bool = False,
    use_dora: bool = False,
) -> Adapter:
    """A fresh adapter as PEFT initialises one: ``A`` Kaiming-uniform, ``B`` zero (so the
    adapted model starts equal to the base); ``zero_b=False`` draws ``B`` (and the bias)
    small and random too (tests). ``targets``: module paths, or suffixes such as
    ``"attn.to_q"`` (default: every attention q/k/v/out projection); ``alpha`` defaults to
    ``rank`` (scale 1). ``lora_bias``: a ``lora_B`` bias (zero); ``use_dora``: DoRA, its
    magnitude ``||W + (alpha / rank) B @ A||`` per row, so ``params_or_config`` must be Params."""
    config = base_config(params_or_config)
    if use_dora and not isinstance(params_or_config, Params):
        raise ValueError(
            "params_or_config: use_dora=True needs the base Params (DoRA's magnitude is ||W||), got a config"
        )
    known = linear_modules(config)
    targets = DEFAULT_TARGETS if targets is None else tuple(targets)
    modules = [m for m in known if any(m == t or m.endswith("." + t) for t in targets)]
    if not modules:
        raise ValueError(f"targets: {targets} match no linear layer of {type(config).__name__}")
    spec = tuple((m, int(rank), float(rank if alpha is None else alpha)) for m in modules)
    lcfg = LoraConfig(config, spec, lora_bias=lora_bias, use_dora=use_dora)
    gen = torch.Generator().manual_seed(seed)
    flat = {}
    for m in modules:
        out_dim, in_dim = known[m].shape
        bound = 1 / math.sqrt(in_dim)  # kaiming_uniform_(a=sqrt(5)) on (rank, in)
        flat[f"{m}.lora_A.weight"] = (torch.rand(rank, in_dim, generator=gen) * 2 - 1) * bound
        b = torch.randn(out_dim, rank, generator=gen) * 0.1 if not zero_b else torch.zeros(out_dim, rank)
        flat[f"{m}.lora_B.weight"] = b
        if lora_bias:
            flat[f"{m}.lora_B.bias"] = torch.randn(out_dim, generator=gen) * 0.1 if not zero_b else torch.zeros(out_dim)
    flat = {k: v.to(device=device, dtype=dtype) for k, v in flat.items()}
    if use_dora:
        flat.update(magnitudes(params_or_config, lcfg, flat))
    return Adapter(lcfg, nest(flat))


def magnitudes(params: Params, lcfg: LoraConfig, flat: Mapping) -> dict:
    """``{"<m>.lora_magnitude_vector": ||W + (alpha / rank) B @ A||}`` for every module of
    ``lcfg`` from the factors in ``flat``: PEFT's DoRA initialisation (``||W||`` at ``B`` = 0)."""
    weights = params.flat()
    out = {}
    for m, _, _ in lcfg.modules:
        A, B = flat[f"{m}.lora_A.weight"], flat[f"{m}.lora_B.weight"]
        out[f"{m}.lora_magnitude_vector"] = weight_norm(weights[f"{m}.weight"].to(A.device), A, B, lcfg.scale(m))
    return out


# The projections LoRA trainers adapt by default (diffusers' training scripts: to_q, to_k,
# to_v, to_out.0 and their context twins; FLUX.2's fused single-block projections).
DEFAULT_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_qkv_mlp_proj",
    "attn.to_out",
)
