"""Shared by the CLI tests: run ``python -m functional_dit`` in-process and read its one-line error."""

from __future__ import annotations

from functional_dit.__main__ import main


def one_line_error(argv, capsys) -> str:
    """Run the CLI with ``argv``; it must exit 2 with one ``error: ...`` line on stderr, returned."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err
