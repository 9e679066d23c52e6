# SPDX-License-Identifier: Apache-2.0
"""The plain-text tables that ``check`` and ``bench`` print."""

from __future__ import annotations

__all__ = [
    "format_table",
]


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` (the header first) in padded columns, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def fmt(row: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()

    header, *body = rows
    return [fmt(header), fmt(tuple("-" * w for w in widths)), *[fmt(row) for row in body]]
