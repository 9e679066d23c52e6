# SPDX-License-Identifier: Apache-2.0
"""The plain-text tables that ``check`` and ``bench`` print."""

from __future__ import annotations

import textwrap

__all__ = [
    "WIDTH",
    "format_table",
]

# A terminal's columns the tables fit in: the widest columns wrap at spaces onto the row's next lines.
WIDTH = 120
GAP = "  "
# The narrowest a column is made when even its longest word must break.
HARD_FLOOR = 4


def _narrowest(cells: list[str]) -> int:
    """The width a column can wrap down to: its longest word."""
    return max((len(word) for cell in cells for word in cell.split()), default=0)


def format_table(rows: list[tuple[str, ...]], width: int = WIDTH, keep: int = 1) -> list[str]:
    """``rows`` (the header first) in padded columns, a rule under the header.

    Wider than ``width``, the widest of the columns after the first ``keep`` (each row's key,
    never wrapped) wrap at spaces, a row taking more lines, until the table fits; if wrapping at
    spaces cannot make it fit, their longest words break too.
    """
    columns = list(zip(*rows, strict=True))
    widths = [max(map(len, column)) for column in columns]
    words = [_narrowest(list(c)) for c in columns]
    # First wrap at spaces only; if that cannot fit, break the longest words too (never the key columns,
    # nor below HARD_FLOOR): the table fits ``width`` whenever its key columns leave room.
    for floors in (
        [w if i < keep else words[i] for i, w in enumerate(widths)],
        [w if i < keep else min(w, HARD_FLOOR) for i, w in enumerate(widths)],
    ):
        while sum(widths) + len(GAP) * (len(widths) - 1) > width:
            shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
            if not shrinkable:
                break
            widest = max(shrinkable, key=lambda i: widths[i])
            widths[widest] -= 1

    def fmt(row: tuple[str, ...]) -> list[str]:
        cells = [
            textwrap.wrap(cell, w, break_long_words=w < floor) or [""]
            for cell, w, floor in zip(row, widths, words, strict=True)
        ]
        return [
            GAP.join(
                (cell[k] if k < len(cell) else "").ljust(w) for cell, w in zip(cells, widths, strict=True)
            ).rstrip()
            for k in range(max(map(len, cells)))
        ]

    header, *body = rows
    return [*fmt(header), GAP.join("-" * w for w in widths), *[line for row in body for line in fmt(row)]]
