"""What the commands write: files that appear whole or not at all."""

from __future__ import annotations

import os


def write_image(image, out: str, pnginfo=None) -> None:
    """Write through a temporary file in the target folder, then rename: never a partial file
    (``pnginfo``: PNG text chunks)."""
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    stem, suffix = os.path.splitext(os.path.basename(out))
    tmp = os.path.join(folder, f".{stem}.partial-{os.getpid()}{suffix}")
    try:
        image.save(tmp, **({} if pnginfo is None else {"pnginfo": pnginfo}))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
