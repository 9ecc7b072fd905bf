"""Plain-text tables for command output."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Format rows as a Markdown-style table with right-aligned columns.

    Parameters
    ----------
    header : sequence of str
        Column titles.
    rows : sequence of sequences
        Cell values, converted with ``str``.

    Returns
    -------
    str
        The table, one line per row, no trailing newline.
    """
    cells = [list(map(str, header)), *[list(map(str, row)) for row in rows]]
    widths = [max(len(row[k]) for row in cells) for k in range(len(header))]

    def line(row: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
            + " |"
        )

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])
