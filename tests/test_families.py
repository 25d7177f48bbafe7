"""The family registry (`functional_dit.families`) is the one source of "which family is
this": every family module in its table declares the facts callers read, and the lookups
of the sampler, the adapter, the tiny pipelines, bench, the CLI, lora and weights answer
from it (each lookup is called per family and compared with the registry, not grepped).
"""

from __future__ import annotations

import dataclasses

import diffusers
import pytest
from safetensors.torch import save_file

import functional_dit as fd
import weights
from functional_dit import families, tiny
from functional_dit.cli import _checks, bench, demo, generate
from functional_dit.configs import DiTConfig, Pipeline
from functional_dit.lora import _io as lora_io
from functional_dit.pipelines import adapter, sampler

FAMILIES = families.FAMILIES
IDS = [fam.KEY for fam in FAMILIES]


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_every_family_declares_its_facts(fam):
    missing = [f for f in families.FIELDS if not hasattr(fam, f)]
    assert not missing, f"{fam.__name__} lacks {missing}"
    assert isinstance(fam.KEY, str) and isinstance(fam.NAME, str)
    assert dataclasses.is_dataclass(fam.CONFIG) and issubclass(fam.CONFIG, DiTConfig)
    assert isinstance(getattr(diffusers, fam.DIFFUSERS_CLASS), type)  # a class diffusers has
    assert fam.PRESETS and all(type(c) is fam.CONFIG for c in fam.PRESETS.values())
    assert fam.TINY in fam.PRESETS and set(fam.REPOS) <= set(fam.PRESETS)
    assert fam.PIPELINES and all(isinstance(p, Pipeline) for p in fam.PIPELINES)
    for p in fam.PIPELINES:  # names only in the core; each resolves in diffusers
        assert isinstance(getattr(diffusers, p.name), type), p.name


def test_one_line_per_family_and_no_name_twice():
    for field in ("KEY", "NAME", "CONFIG", "DIFFUSERS_CLASS"):
        values = [getattr(fam, field) for fam in FAMILIES]
        assert len(set(values)) == len(values), field
    names = [p.name for fam in FAMILIES for p in fam.PIPELINES]
    kinds = [p.tiny for fam in FAMILIES for p in fam.PIPELINES if p.tiny is not None]
    presets = [n for fam in FAMILIES for n in fam.PRESETS]
    for what in (names, kinds, presets):
        assert len(set(what)) == len(what)
    assert fd.api.FAMILIES == {fam.CONFIG: fam for fam in FAMILIES}
    assert fd.PRESETS == {n: c for fam in FAMILIES for n, c in fam.PRESETS.items()}


def _params(fam):
    return fd.init(families.tiny_config(fam), device="meta")


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_core_and_product_lookups_agree_with_the_registry(fam):
    config, params = families.tiny_config(fam), _params(fam)
    assert families.of(config) is fam and families.of(params) is fam and fd.api.family(params) is fam
    assert fd.config_from_diffusers(fd.config_to_diffusers(config)) == config  # DIFFUSERS_CLASS both ways
    assert sampler._family_name(params) == fam.KEY
    assert adapter._family(params) == fam.KEY
    assert adapter._stock_class(fam.KEY) == fam.DIFFUSERS_CLASS
    assert adapter._served(fam.KEY).split(" / ") == [p.name for p in fam.PIPELINES]
    assert lora_io._family(config) == fam.DIFFUSERS_CLASS
    assert weights._layouts.FAMILY_NAMES[fam.DIFFUSERS_CLASS] == fam.NAME
    assert {n: r for n, r in generate.PRESET_REPOS.items() if n in fam.PRESETS} == fam.REPOS


def test_adapter_classes_are_the_stock_class_names():
    for fam in FAMILIES:
        module = fd.DiffusersTransformer(fd.init(families.tiny_config(fam)))
        assert type(module).__name__ == fam.DIFFUSERS_CLASS


def test_pipeline_tables_come_from_the_registry():
    want = [p.name for fam in FAMILIES for p in fam.PIPELINES if p.sample]
    assert families.SAMPLED == want
    assert tiny.PIPELINE_CLASSES == {p.tiny: p.name for fam in FAMILIES for p in fam.PIPELINES if p.tiny}
    for kind in tiny.KINDS:  # each kind's config belongs to the family its pipeline runs
        fam = families.of_pipeline(tiny.PIPELINE_CLASSES[kind])
        assert tiny.family(kind) == fam.KEY and families.of(tiny.transformer_config(kind)) is fam
    for name, config in bench.mid_configs().items():
        assert families.key(config) == name
    for row in demo.rows():  # the demo table's family column
        assert row.family == families.of(tiny.transformer_config(row.kind)).NAME


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_weights_detects_each_family_from_its_keys(fam, tmp_path):
    # A checkpoint with no config.json: weights recognises the family from its keys and
    # names it as the registry does.
    path = tmp_path / "model.safetensors"
    save_file(fd.to_state_dict(fd.init(families.tiny_config(fam))), path)
    with pytest.raises(ValueError, match=f"its keys are {fam.NAME}'s \\(diffusers layout\\)"):
        weights.inspect(path)


def test_cli_checks_name_the_family_of_any_registry_config(tmp_path):
    # FLUX.3 and Qwen-Image 2.1 included (a hand-written three-family dict once missed them).
    for fam in FAMILIES:
        path = tmp_path / f"{fam.KEY}.safetensors"
        save_file(fd.to_state_dict(fd.init(families.tiny_config(fam))), path)
        name = families.pipeline_names(fam, sample=True)[0]
        assert type(_checks.check_checkpoint(str(path), fam.TINY, name, "--base")) is fam.CONFIG


def test_unknown_lookups_are_value_errors():
    with pytest.raises(ValueError, match="config: expected one of .*Flux1Config.*, got dict"):
        families.of({})
    with pytest.raises(ValueError, match="pipeline: expected one of .*FluxPipeline.*, got 'StableDiffusionPipeline'"):
        families.of_pipeline("StableDiffusionPipeline")
