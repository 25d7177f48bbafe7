"""diffusers' own *pipeline* test files, run twice: with the stock transformer and with it
swapped for `fd.DiffusersTransformer` over the same weights. Prints per-file counts and
every test whose outcome differs. A measurement, not part of our CI (which cannot
download diffusers' tests tree).

    python examples/diffusers_pipeline_suites.py DIFFUSERS_REPO [--files ...]

DIFFUSERS_REPO is a checkout of https://github.com/huggingface/diffusers (its `tests/`
tree is used, against the diffusers installed here). Needs `parameterized` and
`requests_mock` (the suites import them). The tests name tiny tokenizers and configs on
the hub (`hf-internal-testing/tiny-random-{clip,t5,Qwen2VLForConditionalGeneration}`,
Mistral's processor); with no hub here, they are replaced by the local tiny ones of
`functional_dit.pipelines.tiny`, saved once under the checkout. Tests that compare with
hard-coded output slices then fail on both sides alike; only the differences between the
two runs say something about the adapter (docs/diffusers-model-tests.md).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

FILES = (
    "tests/pipelines/flux/test_pipeline_flux.py",
    "tests/pipelines/flux/test_pipeline_flux_img2img.py",
    "tests/pipelines/controlnet_flux/test_controlnet_flux.py",
    "tests/pipelines/flux2/test_pipeline_flux2.py",
    "tests/pipelines/flux2/test_pipeline_flux2_klein_inpaint.py",
    "tests/pipelines/qwenimage/test_qwenimage.py",
    "tests/pipelines/qwenimage/test_qwenimage_img2img.py",
)

# Loaded by pytest from the checkout's tests/pipelines/ (written there by this script).
CONFTEST = """\
import functools
import os

import transformers

import functional_dit as fd

HUB = os.environ["FD_LOCAL_HUB"]


def _local(name):
    if isinstance(name, str) and name.startswith("hf-internal-testing/"):
        return os.path.join(HUB, name.split("/", 1)[1])
    return name


def _redirect(cls):
    orig = cls.__dict__["from_pretrained"].__func__
    cls.from_pretrained = classmethod(lambda c, name, *a, **k: orig(c, _local(name), *a, **k))


for _cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoProcessor,
             transformers.PreTrainedTokenizerBase):
    _redirect(_cls)


def _swap(cls):
    orig = cls.get_dummy_components
    if getattr(orig, "_fd_swapped", False):
        return

    @functools.wraps(orig)  # the tests read its signature (num_layers, num_single_layers)
    def get_dummy_components(self, *a, **k):
        parts = orig(self, *a, **k)
        t = parts.get("transformer")
        if t is not None and not isinstance(t, fd.DiffusersTransformer):
            parts["transformer"] = fd.DiffusersTransformer(fd.from_diffusers(t))
        return parts

    get_dummy_components._fd_swapped = True
    cls.get_dummy_components = get_dummy_components


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FD_ADAPTER") == "1":
        for item in items:
            if hasattr(getattr(item, "cls", None), "get_dummy_components"):
                _swap(item.cls)
"""


def local_hub(root: str) -> None:
    """The hub names the suites load, saved from our offline tiny builders."""
    from functional_dit.pipelines import tiny

    t5 = tiny.t5_tokenizer()
    saves = {
        "tiny-random-clip": [tiny.clip_tokenizer()],
        "tiny-random-t5": [t5, tiny.t5_encoder(t5).config],
        "tiny-random-Qwen2VLForConditionalGeneration": [tiny.qwen_tokenizer()],
        "Mistral-Small-3.1-24B-Instruct-2503-only-processor": [tiny.mistral_tokenizer()],
    }
    for name, objs in saves.items():
        for obj in objs:
            obj.save_pretrained(os.path.join(root, name))


def outcomes(junit: str) -> dict[str, str]:
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        state = "passed"
        for child in case:
            state = {"failure": "failed", "error": "failed", "skipped": "skipped"}.get(child.tag, state)
        out[f"{case.get('classname')}::{case.get('name')}"] = state
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo", help="a diffusers checkout (its tests/ tree is run)")
    ap.add_argument("--files", nargs="+", default=list(FILES))
    args = ap.parse_args(argv)
    repo = os.path.abspath(args.repo)
    missing = [f for f in args.files if not os.path.isfile(os.path.join(repo, f))]
    if missing:
        sys.exit(f"--files: expected test files under {repo}, missing {missing}")
    hub = os.path.join(repo, ".fd_local_hub")
    local_hub(hub)
    with open(os.path.join(repo, "tests", "pipelines", "conftest.py"), "w") as f:
        f.write(CONFTEST)
    env = dict(os.environ, FD_LOCAL_HUB=hub, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    runs = {}
    for side, flag in (("stock", "0"), ("adapter", "1")):
        junit = os.path.join(repo, f".fd_{side}.xml")
        cmd = [sys.executable, "-m", "pytest", *args.files, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        subprocess.run(cmd, cwd=repo, env=dict(env, FD_ADAPTER=flag), stdout=subprocess.DEVNULL, check=False)
        runs[side] = outcomes(junit)
    print("| file | stock: passed / failed / skipped | adapter: passed / failed / skipped |")
    print("|---|---|---|")
    for path in args.files:
        mod = path[: -len(".py")].replace("/", ".")
        row = []
        for side in ("stock", "adapter"):
            n = collections.Counter(s for k, s in runs[side].items() if k.startswith(mod + "."))
            row.append(f"{n['passed']} / {n['failed']} / {n['skipped']}")
        print(f"| {path.split('/')[-1]} | {row[0]} | {row[1]} |")
    diff = sorted(k for k in runs["stock"] if runs["stock"][k] != runs["adapter"].get(k))
    print(f"\n{len(diff)} tests differ:")
    for k in diff:
        print(f"  {k}: stock {runs['stock'][k]}, adapter {runs['adapter'].get(k)}")


if __name__ == "__main__":
    main()
