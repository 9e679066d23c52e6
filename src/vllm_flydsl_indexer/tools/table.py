# SPDX-License-Identifier: Apache-2.0
"""The plain-text tables that ``check`` and ``bench`` print."""

from __future__ import annotations

import re
import textwrap

__all__ = ["WIDTH", "format_table"]

# A terminal's columns the tables fit in: the widest columns wrap at spaces onto the row's next lines.
WIDTH = 120
GAP = "  "
# The narrowest a column is made when even its longest word must break.
HARD_FLOOR = 4
# Where a word may break when wrapping at spaces cannot fit the table: after a '/', between two
# numbers (``11640/`` and ``11640``), never inside a run of characters, so a number is never broken
# into two that read as other numbers (``11640/1164`` and ``0``).
_PIECE = re.compile(r"[^/]*/|[^/]+")


class _SlashWrapper(textwrap.TextWrapper):
    """Wraps at spaces, and after a '/' where a word is wider than the column; breaks nothing else."""

    wordsep_re = re.compile(r"(\s+|(?<=/)(?=[^\s/]))")


def _narrowest(cells: list[str]) -> int:
    """The width a column can wrap down to at spaces: its longest word."""
    return max((len(word) for cell in cells for word in cell.split()), default=0)


def _unbreakable(cells: list[str]) -> int:
    """The width a column can wrap down to at all: its longest piece of a word between '/'s."""
    return max((len(p) for cell in cells for word in cell.split() for p in _PIECE.findall(word)), default=0)


def format_table(rows: list[tuple[str, ...]], width: int = WIDTH, keep: int = 1) -> list[str]:
    """``rows`` (the header first) in padded columns, a rule under the header.

    Wider than ``width``, the widest of the columns after the first ``keep`` (each row's key,
    never wrapped) wrap at spaces, a row taking more lines, until the table fits; if wrapping at
    spaces cannot make it fit, their longest words break after a '/' too, never elsewhere (a number
    is never broken across lines), and never below :data:`HARD_FLOOR`. A table whose key columns and
    unbreakable pieces leave no room is wider than ``width``.
    """
    columns = list(zip(*rows, strict=True))
    widths = [max(map(len, column)) for column in columns]
    words = [_narrowest(list(c)) for c in columns]
    pieces = [_unbreakable(list(c)) for c in columns]
    for floors in (
        [w if i < keep else words[i] for i, w in enumerate(widths)],
        [w if i < keep else min(w, max(HARD_FLOOR, pieces[i])) for i, w in enumerate(widths)],
    ):
        while sum(widths) + len(GAP) * (len(widths) - 1) > width:
            shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
            if not shrinkable:
                break
            widest = max(shrinkable, key=lambda i: widths[i])
            widths[widest] -= 1

    def fmt(row: tuple[str, ...]) -> list[str]:
        # Narrower than a word: wrap after a '/' too (the wrapper's wordsep_re, used with break_on_hyphens).
        wrappers = [
            _SlashWrapper(w, break_long_words=False) if w < floor else None
            for w, floor in zip(widths, words, strict=True)
        ]
        cells = [
            (wrapper.wrap(cell) if wrapper else textwrap.wrap(cell, w, break_long_words=False)) or [""]
            for cell, w, wrapper in zip(row, widths, wrappers, strict=True)
        ]
        return [
            GAP.join(
                (cell[k] if k < len(cell) else "").ljust(w) for cell, w in zip(cells, widths, strict=True)
            ).rstrip()
            for k in range(max(map(len, cells)))
        ]

    header, *body = rows
    return [*fmt(header), GAP.join("-" * w for w in widths), *[line for row in body for line in fmt(row)]]
