"""Max abs error of `fd.apply` against the diffusers classes at the same weights, per
family and case, fp32 and bf16: the figures the README quotes (the tests assert the
tolerances; this script prints the measurements).

    python examples/parity_report.py

Uses the test suite's tiny cases (tests/cases_*.py), so run it from the repository root.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import cases_flux1  # noqa: E402
import cases_flux2  # noqa: E402
import cases_qwenimage  # noqa: E402
from oracle import diffusers_model, max_err  # noqa: E402

import functional_dit as fd  # noqa: E402

CASES = [  # (case, case module, config, input builder keyword arguments)
    ("flux1 tiny (dev-like), B=2", cases_flux1, cases_flux1.TINY, dict(batch=2, txt_len=7)),
    ("flux1 tiny schnell, B=1", cases_flux1, cases_flux1.TINY_SCHNELL, dict(batch=1, txt_len=5)),
    ("flux2 tiny (dev-like), B=2", cases_flux2, cases_flux2.TINY, dict(batch=2, txt_len=7)),
    ("flux2 tiny klein, B=2", cases_flux2, cases_flux2.TINY_KLEIN, dict(batch=2, txt_len=5)),
    ("qwen-image tiny, ragged mask, B=2", cases_qwenimage, cases_qwenimage.TINY, dict(batch=2, holes=True)),
    ("qwen-image edit-2511, B=2", cases_qwenimage, cases_qwenimage.TINY_EDIT, dict(batch=2)),
    ("qwen-image layered, ragged, B=2", cases_qwenimage, cases_qwenimage.TINY_LAYERED, dict(batch=2, holes=True)),
]


def measure(module_of_cases, config, kwargs, dtype) -> float:
    module, params = diffusers_model(config, seed=3, dtype=dtype)
    kw = module_of_cases.inputs(config, dtype=dtype, seed=4, **kwargs)
    (ref,) = module(**module_of_cases.diffusers_kwargs(kw))
    return max_err(fd.apply(params, **kw), ref)


def main() -> None:
    print(f"torch {torch.__version__}, CPU")
    print(f"{'case':<36} {'fp32':>9} {'bf16':>9}   (max |fd.apply - diffusers|)")
    for name, cases, config, kwargs in CASES:
        errs = [measure(cases, config, kwargs, dtype) for dtype in (torch.float32, torch.bfloat16)]
        print(f"{name:<36} {errs[0]:>9.2g} {errs[1]:>9.2g}")


if __name__ == "__main__":
    main()
