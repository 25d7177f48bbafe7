"""The README's Python examples run as written: each ```python block, standalone, in order.

Blocks whose first line is ``# not run by the tests: <why>`` (real checkpoints, a GPU,
several processes) are left out; every other block runs in a fresh namespace in a
temporary working directory, so it cannot lean on an earlier block's names or files.
"""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"
NOT_RUN = "# not run by the tests:"
MIN_RUN = 9  # the README's runnable blocks today; skipping everything must not pass


def _blocks() -> list[tuple[str, str]]:
    """(id, code) per ```python block: the id names the nearest heading above it."""
    out, heading, counts, fence, code = [], "top", {}, None, []
    for line in README.read_text().splitlines():
        if fence is None and line.startswith("```"):
            fence, code = line[3:].strip(), []
        elif fence is not None and line == "```":
            if fence == "python":
                counts[heading] = counts.get(heading, 0) + 1
                out.append((f"{heading}-{counts[heading]}", "\n".join(code) + "\n"))
            fence = None
        elif fence is not None:
            code.append(line)
        elif m := re.match(r"#{1,6} (.+)", line):
            heading = re.sub(r"[^A-Za-z0-9]+", "-", m.group(1)).strip("-").lower()
    assert fence is None, f"README.md: unclosed ``` fence ({fence!r})"
    return out


BLOCKS = _blocks()
RUN = [(i, code) for i, code in BLOCKS if not code.startswith(NOT_RUN)]


def test_blocks_found():
    assert len(RUN) >= MIN_RUN, f"expected at least {MIN_RUN} runnable README blocks, found {len(RUN)}"
    for i, code in BLOCKS:
        first = code.splitlines()[0] if code else ""
        if first.startswith("# not run"):
            assert re.fullmatch(re.escape(NOT_RUN) + r" \S.*", first), f"{i}: say why after {NOT_RUN!r}"


@pytest.mark.parametrize("code", [c for _, c in RUN], ids=[i for i, _ in RUN])
def test_readme_block_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
