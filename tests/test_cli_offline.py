"""What a newcomer meets first: the README's offline ``generate`` line run as written
(``--model flux``: the tiny pipeline at its default seed, the same image as `fd.sample`
on ``tiny.pipeline("flux")``), the step cache's one-line feedback and its warning, the
argument checks made before anything loads, and argparse's errors as one line."""

from __future__ import annotations

import os
import re
import shlex
import warnings

import numpy as np
import pytest
from _cli import one_line_error
from PIL import Image

import functional_dit as fd
from functional_dit import tiny
from functional_dit.__main__ import main
from functional_dit.cli import _models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--height", "32", "--width", "32"]


def readme_generate_line() -> str:
    """The README's offline generate command: the line of its command-line block that
    runs ``--model flux`` (a README edit that drops or breaks it fails the test)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = [ln for ln in text.splitlines() if ln.startswith("python -m functional_dit generate --model flux ")]
    assert len(lines) == 1, lines
    return lines[0].split("  #")[0]


def test_readme_offline_generate_line_runs_and_equals_fd_sample(tmp_path, monkeypatch, capsys):
    words = shlex.split(readme_generate_line())
    assert words[:3] == ["python", "-m", "functional_dit"], words
    monkeypatch.chdir(tmp_path)
    assert main(words[3:]) == 0
    out = words[words.index("--out") + 1]
    said = capsys.readouterr().out
    assert re.search(rf"wrote {re.escape(out)} \(", said), said
    # the oracle: fd.sample on the tiny pipeline at its default seed, the same settings
    pipe = tiny.pipeline("flux")
    assert pipe.vae_scale_factor == _models.TINY_VAE_SCALE
    arg = lambda flag, kind=int: kind(words[words.index(flag) + 1])  # noqa: E731
    kw = dict(height=arg("--height"), width=arg("--width"), steps=arg("--steps"), seed=arg("--seed"))
    want = fd.sample(fd.from_diffusers(pipe.transformer), pipe, arg("--prompt", str), **kw)[0]
    assert np.array_equal(np.asarray(Image.open(tmp_path / out)), np.asarray(want))


def test_generate_flux3_flow_map_equals_fd_sample(tmp_path, capsys):
    """The modular FLUX.3 pipelines are names too: ``--model flux3-distilled`` (the tiny
    flow map at the default seed) writes ``fd.sample``'s image."""
    out = tmp_path / "flux3.png"
    argv = ["generate", "--model", "flux3-distilled", "--prompt", "a cat", "--steps", "2", "--seed", "3", *SMALL]
    assert main([*argv, "--out", str(out)]) == 0
    pipe = tiny.pipeline("flux3-distilled", seed=_models.SEED)
    want = fd.sample(fd.from_diffusers(pipe.transformer), pipe, "a cat", height=32, width=32, steps=2, seed=3)[0]
    assert np.array_equal(np.asarray(Image.open(out)), np.asarray(want))


def test_every_tiny_name_resolves_and_presets_keep_their_names():
    assert _models.tiny_kind("flux") == "flux" and _models.tiny_kind("tiny:qwen-image") == "qwen-image"
    assert _models.tiny_kind("qwen-image") is None  # the released preset (from the Hugging Face cache)
    assert _models.tiny_kind("flux1-dev") is None and _models.tiny_kind("FLUX.1-dev/") is None
    with pytest.raises(ValueError, match=r"--model: expected tiny:KIND with a KIND of flux, "):
        _models.tiny_kind("tiny:nope")
    names = _models.generatable()
    assert "flux" in names and "tiny:qwen-image" in names and "flux1-dev" in names
    assert not [n for n in names if n.endswith("-tiny")]  # shapes without weights are not offered
    for name in _models.tiny_names():  # the pipeline class and config known without building it
        fam, p = fd.families.TINY_KINDS[_models.tiny_kind(name)]
        assert _models.tiny_pipeline_class(name) == p.name and fd.families.key(_models.tiny_config(name)) == fam.KEY


@pytest.mark.parametrize(
    "model, match",
    [
        ("no-such-model", "nor a model name; expected a checkpoint or one of flux, flux-kontext, flux2,"),
        (
            "flux1-tiny",
            "preset 'flux1-tiny' is a transformer shape without released weights or a pipeline; "
            "offline, generate with a tiny pipeline (flux, flux-kontext)",
        ),  # fmt: skip
        ("tiny:nope", "--model: expected tiny:KIND with a KIND of flux,"),
    ],
)
def test_unknown_models_list_what_can_be_generated(tmp_path, capsys, model, match):
    err = one_line_error(["generate", "--model", model, "--prompt", "a", "--out", str(tmp_path / "x.png")], capsys)
    assert match in err and "flux1-tiny," not in err, err


def test_tiny_model_refuses_base_and_config(tmp_path, capsys):
    argv = ["generate", "--model", "flux", "--prompt", "a", "--out", str(tmp_path / "x.png")]
    assert "--base: not with --model flux" in one_line_error([*argv, "--base", str(tmp_path)], capsys)
    assert "--config: not with --model flux" in one_line_error([*argv, "--config", "flux1-tiny"], capsys)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--steps", "0"], "error: --steps: expected a positive int, got '0'"),
        (
            ["--cache", "nonsense"],
            "error: --cache: expected one of ['fastercache', 'fbcache', 'magcache', 'taylorseer']",
        ),
        (["--guidance", "nan"], "error: --guidance: expected a finite number, got 'nan'"),
        (["--guidance", "-3"], "error: --guidance: expected a scale >= 0, got '-3'"),
        (["--true-cfg", "-2"], "error: --true-cfg: expected a scale >= 0, got '-2'"),
        (["--strength", "inf"], "error: --strength: expected a finite number, got 'inf'"),
        (["--encoders", "all"], "error: --encoders: invalid choice: 'all'"),
    ],
)
def test_argument_errors_are_one_line_before_loading(tmp_path, capsys, monkeypatch, extra, match):
    from functional_dit.cli import _models as models

    def heavy(*args, **kw):
        raise AssertionError("the pipeline was built before the error")

    monkeypatch.setattr(models, "tiny_pipeline", heavy)
    argv = ["generate", "--model", "flux", "--prompt", "a", *extra, "--out", str(tmp_path / "x.png")]
    assert one_line_error(argv, capsys).startswith(match)  # no usage lines before it
    assert not (tmp_path / "x.png").exists()


def test_no_command_is_one_line(capsys):
    assert one_line_error([], capsys) == "error: the following arguments are required: COMMAND"


@pytest.mark.parametrize("name, value", [("guidance", -3.0), ("true_cfg", -2.0), ("guidance", float("nan"))])
def test_sample_refuses_negative_or_nan_scales(name, value):
    pipe = tiny.pipeline("flux")
    with pytest.raises(ValueError, match=rf"^{name}: expected None or a finite number >= 0, got {value!r}"):
        fd.sample(fd.from_diffusers(pipe.transformer), pipe, "a", height=32, width=32, steps=1, **{name: value})


def _blocks(kind: str) -> int:
    config = tiny.transformer_config(kind)
    return config.num_layers + getattr(config, "num_single_layers", 0)


def test_generate_cache_says_what_it_skipped_and_warns_when_nothing(tmp_path, capsys):
    base = ["generate", "--model", "flux", "--prompt", "a cube", *SMALL, "--steps", "4"]
    # a threshold no change reaches: step 0 computes, the 3 others skip all blocks but block 0
    assert main([*base, "--cache", "fbcache:1e9", "--out", str(tmp_path / "a.png")]) == 0
    got = capsys.readouterr()
    want = f"step cache fbcache:1e+09: 1 of 4 steps computed ({3 * (_blocks('flux') - 1)} block calls skipped)"
    assert want in got.out and "warning" not in got.err, got
    # a threshold nothing stays under: every step computes, one warning line on stderr
    assert main([*base, "--cache", "fbcache:1e-12", "--out", str(tmp_path / "b.png")]) == 0
    got = capsys.readouterr()
    assert "step cache fbcache:1e-12: 4 of 4 steps computed (0 block calls skipped)" in got.out, got.out
    warned = [ln for ln in got.err.splitlines() if ln.startswith("warning:")]
    assert warned == ["warning: --cache fbcache:1e-12 skipped nothing: all 4 steps ran the whole network "
                      "(a larger threshold or interval skips more)"], got.err  # fmt: skip


def test_generate_prompts_passes_the_cache_on(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("a cube\na sphere\n")
    argv = ["generate", "--model", "flux", "--prompts", str(tmp_path / "p.txt"), "--out-dir", str(tmp_path / "o")]
    assert main([*argv, *SMALL, "--steps", "2", "--cache", "fbcache:1e9"]) == 0
    out = capsys.readouterr().out
    assert f"2 of 4 steps computed ({2 * (_blocks('flux') - 1)} block calls skipped)" in out, out


def test_compiled_local_view_raises_no_dynamo_cache_warning(monkeypatch):
    """`sharding.local_view` runs inside every compiled `fd.apply`; it used to reach an
    ``lru_cache``-wrapped helper, which dynamo traces with a UserWarning."""
    import torch._dynamo.utils

    import sharding

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set(), raising=False)  # as in a fresh process
    torch._dynamo.reset()
    params = fd.init("flux1-tiny", seed=0)
    f = torch.compile(lambda x: x + (sharding.local_view(params)[1] is None), backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert torch.equal(f(torch.zeros(2)), torch.ones(2))
    assert not [w for w in seen if "lru_cache" in str(w.message)], [str(w.message) for w in seen]
