# SPDX-License-Identifier: Apache-2.0
"""The tuned CSV's validator: every cell of every row, with file, line and column in each reason.

The plugin reads a table leniently (``tuning.usable_row``: rows it cannot use are skipped, with one
WARNING); doctor and ``tune --out`` hold a file to this stricter rule and say why each row fails, so a
user learns what the plugin skipped. One validator (:func:`check_row`) for every row whatever its gfx.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from vllm_flydsl_indexer.envs import ACCEPTED, parse_bool
from vllm_flydsl_indexer.tools import files
from vllm_flydsl_indexer.tuning import (
    COLUMNS,
    COMMENT,
    KEY_COLUMNS,
    SIZE_COLUMNS,
    WHOLE,
    TunedTable,
    arch_of,
    parse,
)

__all__ = [
    "COLUMNS", "COMMENT", "CONTEXT_LEN_SEPARATOR", "KEY_COLUMNS", "TableError", "TunedRow", "arch_of",
    "check_row", "read", "read_rows", "read_table", "row_problems", "table_of",
]  # fmt: skip

BACKENDS = ("flydsl", "gluon")
# Each backend's own knobs must be positive; the other backend's are written 0 (aiter's tuner).
# FlyDSL's wg_per_cu may be 0: aiter's dispatcher reads 0 as its default.
OWN_KNOBS = {"gluon": ("ChunkK", "WavePerEU"), "flydsl": ()}
KNOB_COLUMNS = ("ChunkK", "WavePerEU", "wg_per_cu")
TIME_COLUMNS = ("us", "gluon_us", "flydsl_us")
# aiter's tuner leaves a backend's time empty when it had no correct candidate.
OPTIONAL_TIME_COLUMNS = ("gluon_us", "flydsl_us")
# aiter writes the context lengths a row was measured over as one int or a
# ``;``-separated list (``8192;32768``, aiter PR #6140's shipped table).
CONTEXT_LEN_SEPARATOR = ";"
RowKey = tuple[int, int, int, int, int, int, bool]


class TableError(ValueError):
    """Why a table file cannot be used (the WARNING's text): file, line and column."""


class TunedRow(NamedTuple):
    """One validated row; ``text`` is the row as read, for writing it back unchanged."""

    gfx: str
    key: RowKey
    backend: str
    wg_per_cu: int
    text: dict[str, str]

    @property
    def shape(self) -> tuple[int, int, int, int, int, bool]:
        cus, _, next_n, heads, head_dim, kvb, preshuffle = self.key
        return (cus, next_n, heads, head_dim, kvb, preshuffle)

    @property
    def batch(self) -> int:
        return self.key[1]


def _int(text: str, least: int) -> int:
    """An int cell, as aiter reads it (``3`` or ``3.0``, ASCII digits, the plugin's own rule); at least
    ``least``."""
    number = float(text) if WHOLE.fullmatch(text.lstrip("-")) else math.nan
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not an integer")
    if int(number) < least:
        raise ValueError(f"{int(number)} is not {'positive' if least == 1 else f'>= {least}'}")
    return int(number)


def _time(text: str, optional: bool) -> float | None:
    if optional and not text.strip():
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not a number of microseconds") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a finite, non-negative time")
    return value


def _context_lens(text: str) -> list[int]:
    parts = [part for part in text.split(CONTEXT_LEN_SEPARATOR) if part.strip()]
    if not parts:
        raise ValueError("is empty")
    return [_int(part.strip(), 1) for part in parts]


def _bool(text: str) -> bool:
    value = parse_bool(text)
    if value is None:
        raise ValueError(f"{text!r} is not {'/'.join(ACCEPTED)}")
    return value


def _backend(text: str) -> str:
    if text.lower() not in BACKENDS:
        raise ValueError(f"{text!r} is not flydsl or gluon")
    return text.lower()


def check_row(row: dict[str, str | None]) -> TunedRow:
    """Validate every column of one CSV row; raises ``ValueError("column ...: why")``.

    The one rule of what a row is, for the plugin, doctor and ``tune --out`` alike: a row that no
    call can match (``preshuffle`` other than ``kv_block_size > 1``) is refused, not kept unreachable.
    """

    def checked(column: str, parse=str):
        value = row.get(column)
        try:
            if value is None:
                raise ValueError("is missing (the row is short)")
            return parse(value.strip())
        except ValueError as e:
            raise ValueError(f"column {column}: {e}") from None

    if None in row:  # csv.DictReader puts a long row's extra cells under the key None
        extra = len(row[None])  # type: ignore[arg-type]
        raise ValueError(
            f"after column {COLUMNS[-1]}: {extra} more cell(s) than the header's {len(row) - 1} columns"
        )
    gfx = arch_of(checked("gfx"))
    if not gfx:
        raise ValueError("column gfx: is empty")
    if not gfx.isalnum():  # a zero-width or control character: the plugin's lookup skips the row
        raise ValueError(f"column gfx: {gfx!r} is not letters and digits")
    sizes = [checked(c, lambda t: _int(t, 1)) for c in SIZE_COLUMNS]
    preshuffle, kvb = checked("preshuffle", _bool), sizes[-1]
    if preshuffle != (kvb > 1):  # the lookup reads preshuffle off the call's KVBlockSize: no call matches
        raise ValueError(
            f"column preshuffle: {checked('preshuffle')!r} with kv_block_size {kvb}: no call can match this "
            f"row (vLLM's calls are preshuffled exactly when KVBlockSize > 1, so {int(kvb > 1)} here)"
        )
    checked("context_len", _context_lens)
    backend = checked("backend", _backend)
    knobs = {c: checked(c, lambda t: _int(t, 0)) for c in KNOB_COLUMNS}
    for column in OWN_KNOBS[backend]:
        if knobs[column] < 1:
            raise ValueError(f"column {column}: {knobs[column]} is not positive (a {backend} row's knob)")
    for column in TIME_COLUMNS:
        checked(column, lambda t, c=column: _time(t, c in OPTIONAL_TIME_COLUMNS))
    text = {c: (row.get(c) or "") for c in COLUMNS}
    return TunedRow(
        gfx, (*sizes, preshuffle), backend, knobs["wg_per_cu"] if backend == "flydsl" else 0, text
    )


def read_table(
    lines: Iterable[str], source: str, errors: list[str] | None = None
) -> tuple[list[str], list[TunedRow], list[tuple[int, str]]]:
    """An aiter-format CSV as read: its header, every row validated, and its ``#`` lines with their
    places (rows before each; -1: before the header). Raises :class:`TableError` at the first bad row,
    or, with ``errors``, appends each bad row's reason there and goes on (doctor's list).

    One reader for the plugin, doctor and ``tune --out``: a UTF-8 byte-order mark is dropped, and an
    error names the line its record starts on (a quoted field may run over several).
    """
    comments: list[tuple[int, str]] = []
    header: list[str] = []
    rows: list[TunedRow] = []

    def uncommented() -> Iterator[str]:
        for i, line in enumerate(lines):
            line = line.removeprefix("\ufeff") if i == 0 else line
            if line.lstrip().startswith(COMMENT):
                comments.append((len(rows) if header else -1, line.rstrip("\r\n")))
                line = "\n"
            yield line

    reader = csv.reader(uncommented())
    while True:
        first = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raise TableError(f"{source}: line {first}: {e}") from None
        if not cells:  # a blank or comment line
            continue
        where = f"line {first}"
        if reader.line_num > first:
            where += f" (a quoted field runs to line {reader.line_num})"
        if not header:
            header = cells
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise TableError(f"{source}: {where}: missing column(s) {', '.join(missing)}")
            continue
        row: dict[str | None, object] = dict(zip(header, cells, strict=False))
        if len(cells) > len(header):
            row[None] = cells[len(header) :]
        try:
            rows.append(check_row(row))  # type: ignore[arg-type]
        except ValueError as e:
            if errors is None:
                raise TableError(f"{source}: {where}, {e}") from None
            errors.append(f"{source}: {where}, {e}")
    if not header:
        raise TableError(f"{source}: missing column(s) {', '.join(COLUMNS)} (no header)")
    return header, rows, comments


def read_rows(lines: Iterable[str], source: str) -> list[TunedRow]:
    """Every row of an aiter-format CSV, validated (:func:`read_table`)."""
    return read_table(lines, source)[1]


def row_problems(path: str) -> list[str]:
    """Why each row of the file ``path`` is refused (file, line and column), or why the file is; never
    raises. What the plugin skipped, in words."""
    errors: list[str] = []
    try:
        read_table(io.StringIO(files.read_text(path), newline=""), path, errors)
    except Exception as e:  # noqa: BLE001 - a table file must never crash doctor
        errors.append(str(e) if isinstance(e, TableError) else f"{path}: {type(e).__name__}: {e}")
    return errors


def table_of(rows: Iterable[TunedRow], source: str, gfx: str, origin: str = "env") -> TunedTable:
    """The plugin's lookup table over validated ``rows`` (written back as CSV and read as the plugin
    reads it); raises :class:`TableError` when none is for ``gfx``."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row.text)
    table = parse(text.getvalue(), gfx, source, origin)
    if isinstance(table, str):
        raise TableError(table)
    return table


def read(source: str, gfx: str) -> TunedTable:
    """The table in file ``source`` for ``gfx``, every row validated. Whatever the file is (a directory,
    a FIFO, a device, over the size cap, not UTF-8, NUL bytes, empty...), every failure is a TableError."""
    try:
        return table_of(read_rows(io.StringIO(files.read_text(source), newline=""), source), source, gfx)
    except TableError:
        raise
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise TableError(
            f"{source}: line {line}: not UTF-8 ({e.reason}, byte {e.object[e.start]:#04x})"
        ) from None
    except Exception as e:  # noqa: BLE001 - a table file must never crash doctor
        raise TableError(f"{source}: {type(e).__name__}: {e}") from None
