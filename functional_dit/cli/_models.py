"""What a command's ``--model`` names: the offline tiny pipelines by name, and the list of
names that can be generated with (`generate`; `bench --preset`; a server reuses
`tiny_pipeline`).

A tiny name is a `functional_dit.pipelines.tiny` kind (``flux``, ``flux2-klein``,
``qwen-image-edit``, ...: the names the demo's rows are built from), written ``tiny:KIND``
or, where no preset has that name, plain ``KIND``: ``--model flux`` is
``tiny.pipeline("flux", seed=0)``, random weights and byte-level tokenizers built in
memory, nothing downloaded. ``qwen-image`` and ``qwen-image-2.1`` are also preset names;
as presets they keep meaning the released models (from the local Hugging Face cache), and
their tiny pipelines are ``tiny:qwen-image`` and ``tiny:qwen-image-2.1``.
"""

from __future__ import annotations

import inspect

import torch

from .. import families
from ..api import PRESETS
from ..pipelines import tiny
from ..pipelines.families import product

PREFIX = "tiny:"
SEED = 0  # the tiny pipelines' weights: tiny.pipeline's default seed, as the demo
TINY_VAE_SCALE = 8  # every tiny VAE downscales x8 (tests/test_cli.py checks the pipelines' vae_scale_factor)
# The ControlNet pipelines (each family's CONTROLNET_PIPELINES) need a control image and
# ControlNet params, which generate has no flags for (fd.sample(controlnet=...) in Python;
# docs/controlnet.md).
_NOT_GENERATED = {n for fam in families.FAMILIES for n in product(fam).CONTROLNET_PIPELINES}
TINY = tuple(kind for kind, (_, p) in families.TINY_KINDS.items() if p.sample and p.name not in _NOT_GENERATED)
# Presets with released weights (looked up in the local Hugging Face cache only).
PRESET_REPOS = {name: repo for fam in families.FAMILIES for name, repo in fam.REPOS.items()}


def tiny_kind(name: str) -> str | None:
    """The tiny pipeline kind ``name`` names (``tiny:KIND``, or a bare KIND that is no
    preset), else None. ``tiny:`` with an unknown kind is a ValueError listing them."""
    kind = name[len(PREFIX) :] if name.startswith(PREFIX) else name
    if kind not in TINY:
        if name.startswith(PREFIX):
            raise ValueError(f"--model: expected {PREFIX}KIND with a KIND of {', '.join(TINY)}; got {name!r}")
        return None
    return kind if name.startswith(PREFIX) or name not in PRESETS else None


def tiny_pipeline(name: str, *, dtype=None, pipeline_class: str | None = None):
    """``name``'s stock diffusers pipeline (`tiny_kind`), its weights at seed `SEED`, the
    progress bar off; ``pipeline_class`` (e.g. ``"FluxInpaintPipeline"``) rebuilds it as
    another stock class over the same components. The one place a tiny name becomes a
    pipeline: generate, the demo and a server call it."""
    kind = tiny_kind(name)
    if kind is None:
        raise ValueError(f"--model: expected a tiny pipeline name ({', '.join(tiny_names())}), got {name!r}")
    pipe = tiny.pipeline(kind, seed=SEED, dtype=dtype or torch.float32)
    return pipe if pipeline_class is None else as_class(pipe, pipeline_class)


def as_class(pipe, name: str):
    """``pipe``'s components as the stock pipeline class ``name`` (what ``from_pipe`` does,
    without its ``.to(dtype)``, which logs a float32 notice per module), progress bar off."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    cls = getattr(diffusers, name)
    takes = inspect.signature(cls.__init__).parameters
    new = cls(**{k: v for k, v in pipe.components.items() if k in takes})
    new.set_progress_bar_config(disable=True)
    return new


def tiny_names(family: str | None = None) -> list[str]:
    """How each tiny pipeline (of ``family``, a registry key such as ``"flux1"``, or all)
    is named on the command line (``tiny:`` where a preset takes the bare name)."""
    kinds = [k for k in TINY if family is None or families.TINY_KINDS[k][0] is families.BY_KEY[family]]
    return [kind if kind not in PRESETS else PREFIX + kind for kind in kinds]


def generatable() -> list[str]:
    """Every ``--model`` name that can be generated on some machine: the tiny pipelines
    (anywhere, offline), then the presets with released weights (once in the cache)."""
    return tiny_names() + sorted(PRESET_REPOS)


def tiny_pipeline_class(name: str) -> str:
    """The stock pipeline class a tiny name builds (no pipeline is built)."""
    return families.TINY_KINDS[tiny_kind(name)][1].name


def tiny_config(name: str):
    """The transformer config of a tiny name's pipeline (no pipeline is built)."""
    return tiny.transformer_config(tiny_kind(name))
