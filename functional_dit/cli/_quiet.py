"""The commands' output is their own: around the loading they do, the notices and loading
bars of the libraries they load with are held back, then restored.

Scoped, never global: `loading` raises named loggers' levels and turns the libraries'
progress bars off only inside its ``with`` block, so a user's own code (and
``import functional_dit``) sees every warning as before. What is held back, and why:

- transformers' ``X requires torchvision (not installed); falling back to XPil`` notices,
  logged when diffusers' pipeline modules import the image processors they never use
  here (the fallback is what the tiny pipelines want);
- diffusers' "Loading pipeline components" and transformers' weight-loading bars, which
  would nest around and inside the command's own progress line.
"""

from __future__ import annotations

import contextlib
import logging

# logger name -> the level inside `loading` (see the module docstring)
NOTICES = {"transformers.utils.import_utils": logging.ERROR}


@contextlib.contextmanager
def loading(progress: bool = False):
    """Inside: the `NOTICES` loggers at their raised level and, unless ``progress``, the
    diffusers / transformers progress bars off; both restored after."""
    # transformers: seconds to import, loaded when first used
    import diffusers
    import transformers

    loggers = {name: logging.getLogger(name) for name in NOTICES}
    levels = {name: lg.level for name, lg in loggers.items()}
    bars = [
        (diffusers.utils.logging, diffusers.utils.logging.is_progress_bar_enabled()),
        (transformers.utils.logging, transformers.utils.logging.is_progress_bar_enabled()),
    ]
    for name, lg in loggers.items():
        lg.setLevel(max(NOTICES[name], lg.getEffectiveLevel()))
    if not progress:
        for lib, _ in bars:
            lib.disable_progress_bar()
    try:
        yield
    finally:
        for name, lg in loggers.items():
            lg.setLevel(levels[name])
        for lib, was in bars:
            if was and not progress:
                lib.enable_progress_bar()
