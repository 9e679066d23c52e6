# SPDX-License-Identifier: Apache-2.0
"""The measured per-shape choice between FlyDSL and stock, in aiter's tuned-CSV format.

Where aiter has its tuned dispatcher, its own table decides. Otherwise this module gives the plugin the
same choice and the same launch from the same kind of file (``docs/aiter-kernels.md``, "The tuned table"):

* **Where from** (:func:`table_source`), the first found replacing the rest, read once at registration:
  ``$VLLM_FLYDSL_INDEXER_TUNED_CSV`` (one of :data:`OFF_VALUES`: no table); the table the installed aiter
  ships; the **built-in** one (:data:`BUILTIN`, AMD's MI355X measurements), for the kernel it was
  measured on only; else none. A file that cannot be used falls to the next, with one WARNING.
* **Lookup, as aiter's:** this GPU's rows (``gfx``, ``cu_num``) and shape; of those, the largest tuned
  ``batch_size`` at or below the call's. That bucket's rows must all say ``flydsl`` with one
  ``wg_per_cu`` for FlyDSL, launched as aiter's dispatcher turns it into SplitKV (``0``: the default).
* **Not covered:** FlyDSL where eligible, at the default launch. **Bad file:** one validator
  (:func:`check_row`) for every row whatever its gfx; the table is used whole or not at all.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from vllm_flydsl_indexer import envs, files
from vllm_flydsl_indexer.envs import ACCEPTED, TABLE_IGNORED_LINE, parse_bool

__all__ = [
    "BUILTIN", "COLUMNS", "COMMENT", "CONTEXT_LEN_SEPARATOR", "KEY_COLUMNS", "OFF", "OFF_VALUES", "Pick",
    "TableError", "TableSource", "TunedRow", "TunedTable", "arch_of", "check_row", "env_source",
    "ignored_text", "in_use", "load", "load_source", "parse", "read", "read_rows", "read_table", "resolve",
    "table_source", "where",
]  # fmt: skip

COLUMNS = tuple(
    "gfx cu_num batch_size next_n heads head_dim kv_block_size preshuffle context_len backend "
    "ChunkK WavePerEU wg_per_cu us gluon_us flydsl_us".split()
)
# aiter's lookup key: a later row of the same key replaces an earlier one.
KEY_COLUMNS = COLUMNS[:8]
BACKENDS = ("flydsl", "gluon")
SIZE_COLUMNS = ("cu_num", "batch_size", "next_n", "heads", "head_dim", "kv_block_size")
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
# aiter's reader skips lines starting with this.
COMMENT = "#"
# Where an aiter without the dispatcher may still ship its measured table.
AITER_TABLE = ("aiter", "configs/paged_mqa_logits_tuned.csv")
# $VLLM_FLYDSL_INDEXER_TUNED_CSV=none (or another of OFF_VALUES; trimmed, case-insensitive): no table at all.
OFF = "none"
OFF_VALUES = (OFF, "off", "0", "false")


@dataclass(frozen=True)
class BuiltinTable:
    """A measured table shipped as package data, and the one kernel variant it was measured on."""

    resource: str  # inside this package
    checksum: str  # beside it: SHA-256 of its lines after the provenance comment
    source: str  # where the figures come from
    revision: str
    variant: str  # KernelVariant.name it applies to, and only it
    label: str  # how the log, doctor and the stock-path reasons name it

    def path(self) -> str:
        return str(Path(__file__).resolve().parent / self.resource)


BUILTIN = BuiltinTable(
    resource="data/paged_mqa_logits_tuned.csv",
    checksum="data/paged_mqa_logits_tuned.csv.sha256",
    source="ROCm/aiter aiter/configs/paged_mqa_logits_tuned.csv (aiter PR #6140)",
    revision="39029932a1fcde68e23c63a4e84ab02417177e01",
    # The contiguous-q gfx950 kernel: aiter's tuner measured it (FlyDSL at wg_per_cu 1-4).
    variant="gfx950",
    label="built-in table (aiter 39029932, AMD's MI355X measurements)",
)


@dataclass(frozen=True)
class TableSource:
    """Which table decides per shape: ``path`` to read (``None``: no table), its origin and name."""

    path: str | None
    origin: str  # "env", "aiter", "built-in", "off" (none asked for) or "none" (no measurement)
    label: str  # a few words for the ACTIVE line and doctor
    # The next source in the precedence, used when this one's file cannot be (None: no table at all).
    fallback: TableSource | None = None

    @property
    def name(self) -> str | None:
        """How reasons and doctor name the table: the built-in one by its label, a file by its path."""
        return BUILTIN.label if self.origin == "built-in" else self.path


# (cu_num, next_n, heads, head_dim, kv_block_size, preshuffle), and the same with batch_size second.
ShapeKey = tuple[int, int, int, int, int, bool]
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
    def shape(self) -> ShapeKey:
        cus, _, next_n, heads, head_dim, kvb, preshuffle = self.key
        return (cus, next_n, heads, head_dim, kvb, preshuffle)

    @property
    def batch(self) -> int:
        return self.key[1]


class Pick(NamedTuple):
    """What a table says for one call: the arm, the bucket that decided, and the FlyDSL knob."""

    backend: str  # "flydsl" or "gluon"
    bucket: int  # the tuned batch_size at or below the call's
    wg_per_cu: int  # the FlyDSL row's knob (0: the kernel's default launch)
    conflict: str | None = None  # why the bucket's rows cannot be launched as one measurement


def arch_of(gcn_arch: str) -> str:
    """``gfx950:sramecc+:xnack-`` -> ``gfx950``."""
    return gcn_arch.split(":", 1)[0].strip()


def _int(text: str, least: int) -> int:
    """An int cell, as aiter reads it (``3`` or ``3.0``); at least ``least``."""
    try:
        number = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not an integer") from None
    if not math.isfinite(number) or number != int(number):
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

    The one rule of what a row is, for the plugin, doctor and ``bench --tune`` alike: a row that no
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


def read_table(lines: Iterable[str], source: str) -> tuple[list[str], list[TunedRow], list[tuple[int, str]]]:
    """An aiter-format CSV as read: its header, every row validated, and its ``#`` lines with their
    places (rows before each; -1: before the header). Raises :class:`TableError` at the first bad row.

    One reader for the plugin, doctor and ``bench --tune``: a UTF-8 byte-order mark is dropped, and an
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
            raise TableError(f"{source}: {where}, {e}") from None
    if not header:
        raise TableError(f"{source}: missing column(s) {', '.join(COLUMNS)} (no header)")
    return header, rows, comments


def read_rows(lines: Iterable[str], source: str) -> list[TunedRow]:
    """Every row of an aiter-format CSV, validated (:func:`read_table`)."""
    return read_table(lines, source)[1]


@dataclass
class TunedTable:
    """The rows of one GPU arch, grouped by shape: ``{key: {batch: [(backend, wg_per_cu), ...]}}``."""

    source: str
    gfx: str
    rows: int
    origin: str = "env"  # a TableSource origin
    label: str = ""  # the TableSource label it was loaded from (what the ACTIVE line names)
    shapes: dict[ShapeKey, dict[int, list[tuple[str, int]]]] = field(default_factory=dict)
    _picks: dict[tuple, Pick | None] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        """How reasons and log lines name the table: the built-in one by its label, a file by its path."""
        return self.source if self.origin == "built-in" else f"tuned table {self.source}"

    def cu_counts(self) -> set[int]:
        return {key[0] for key in self.shapes}

    def choice(
        self, cus: int, batch: int, next_n: int, heads: int, head_dim: int, block_size: int
    ) -> Pick | None:
        """The table's :class:`Pick` for the call, or ``None`` where it does not cover it (memoised)."""
        args = (cus, batch, next_n, heads, head_dim, block_size)
        if args in self._picks:
            return self._picks[args]
        pick = None
        buckets = self.shapes.get((cus, next_n, heads, head_dim, block_size, block_size > 1), {})
        tuned = [b for b in buckets if b <= batch]
        if tuned:
            bucket = max(tuned)
            measured = buckets[bucket]
            knobs = sorted({knob for _, knob in measured})
            if any(backend != "flydsl" for backend, _ in measured):
                pick = Pick("gluon", bucket, 0)
            elif len(knobs) > 1:
                pick = Pick("flydsl", bucket, knobs[0], f"its FlyDSL rows disagree on wg_per_cu ({knobs})")
            else:
                pick = Pick("flydsl", bucket, knobs[0])
        self._picks[args] = pick
        return pick

    @classmethod
    def of(cls, rows: Iterable[TunedRow], source: str, gfx: str) -> TunedTable:
        """The rows of ``gfx``; raises :class:`TableError` when there are none."""
        table = cls(source, gfx, 0)
        total = 0
        for row in rows:
            total += 1
            if row.gfx == gfx:
                table.shapes.setdefault(row.shape, {}).setdefault(row.batch, []).append(
                    (row.backend, row.wg_per_cu)
                )
                table.rows += 1
        if total == 0:
            raise TableError(f"{source}: no rows")
        if table.rows == 0:
            raise TableError(f"{source}: valid, {total} row{'s' if total != 1 else ''}; none for {gfx}")
        return table


def parse(lines: Iterable[str], source: str, gfx: str) -> TunedTable:
    """The rows of ``gfx`` in an aiter-format CSV; raises :class:`TableError` on any bad row."""
    return TunedTable.of(read_rows(lines, source), source, gfx)


def read(source: str, gfx: str) -> TunedTable:
    """The table in file ``source`` for ``gfx``. Whatever the file is (a directory, a FIFO, a device,
    over the size cap, not UTF-8, NUL bytes, empty...), every failure is a :class:`TableError`."""
    try:
        return parse(io.StringIO(files.read_text(source), newline=""), source, gfx)
    except TableError:
        raise
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        byte = e.object[e.start]
        raise TableError(f"{source}: line {line}: not UTF-8 ({e.reason}, byte {byte:#04x})") from None
    except Exception as e:  # noqa: BLE001 - a table file must never crash startup or doctor
        raise TableError(f"{source}: {type(e).__name__}: {e}") from None


def _aiter_table() -> str | None:
    """The table the installed aiter ships, found without importing aiter; ``None`` if none."""
    try:
        import importlib.util

        spec = importlib.util.find_spec(AITER_TABLE[0])
    except Exception:  # noqa: BLE001 - no aiter, or one that fails to import
        return None
    for folder in (spec.submodule_search_locations or ()) if spec is not None else ():
        candidate = Path(folder) / AITER_TABLE[1]
        if candidate.is_file():
            return str(candidate)
    return None


def table_source(env_value: str | None, variant: str | None) -> TableSource:
    """The table for the found kernel ``variant``: the variable's (trimmed; one of :data:`OFF_VALUES`,
    any case: none), aiter's shipped one, the built-in one (for its variant only), or none. Each source
    names the next (:attr:`TableSource.fallback`), used only where its own file cannot be."""
    value = (env_value or "").strip()
    if value.lower() in OFF_VALUES:
        label = f"no tuned table ({envs.TUNED_CSV}={value.lower()}): FlyDSL wherever eligible"
        return TableSource(None, "off", label)
    label = (
        f"no measurement for the {variant or 'found'} FlyDSL kernel: FlyDSL wherever eligible "
        "(vllm-flydsl-indexer bench --tune measures this node)"
    )
    chain = TableSource(None, "none", label)
    if variant == BUILTIN.variant:
        chain = TableSource(BUILTIN.path(), "built-in", BUILTIN.label, chain)
    shipped = _aiter_table()
    if shipped is not None:
        chain = TableSource(shipped, "aiter", f"tuned table {shipped} (shipped with aiter)", chain)
    if value:
        chain = TableSource(value, "env", f"tuned table {value} ({envs.TUNED_CSV})", chain)
    return chain


def env_source(variant: str | None) -> TableSource:
    """:func:`table_source` from this process's environment."""
    return table_source(os.environ.get(envs.TUNED_CSV), variant)


def resolve(
    source: TableSource, gfx: str
) -> tuple[TableSource, TunedTable | None, list[tuple[TableSource, str]]]:
    """Read ``source`` for ``gfx``, a file that cannot be used falling to the next source: the source in
    use (path ``None``: no table), its table, and each unusable source before it with why. Never raises."""
    ignored: list[tuple[TableSource, str]] = []
    current: TableSource | None = source
    while current is not None and current.path is not None:
        try:
            table = read(current.path, gfx)
        except TableError as e:
            ignored.append((current, str(e)))
            current = current.fallback
            continue
        table.origin, table.label = current.origin, current.label
        table.source = current.name or table.source
        return current, table, ignored
    return current or source, None, ignored


def ignored_text(used: TableSource, ignored: list[tuple[TableSource, str]]) -> list[str]:
    """One text per source that could not be used: why, and the source used instead."""
    then = f"using the {used.label} instead" if used.path is not None else f"no other table: {used.label}"
    return [f"{why}; {then}" for _, why in ignored]


def load_source(source: TableSource, gfx: str, logger: logging.Logger) -> TunedTable | None:
    """Read ``source`` for ``gfx`` (:func:`resolve`): ``None`` for no table, one WARNING for each source
    that could not be used. Never raises."""
    used, table, ignored = resolve(source, gfx)
    for text in ignored_text(used, ignored):
        logger.warning("%s %s", TABLE_IGNORED_LINE, text)
    return table


def load(source: str | None, gfx: str, logger: logging.Logger) -> TunedTable | None:
    """Read file ``source`` for ``gfx``; ``None`` (after one WARNING) when it cannot be used. Never raises."""
    if source is None:
        return None
    try:
        return read(source, gfx)
    except TableError as e:
        logger.warning("%s %s", TABLE_IGNORED_LINE, e)
        return None


def in_use(source: TableSource, loaded: TunedTable | bool | None) -> str:
    """What the ACTIVE line says decides per shape: the label of the table loaded, or, when none could
    be, the last source's."""
    if isinstance(loaded, TunedTable) and loaded.label:
        return loaded.label
    if source.path is None or loaded:
        return source.label
    last = source
    while last.fallback is not None:
        last = last.fallback
    return f"{source.label} ignored, {last.label}"


def where(table: TunedTable, pick: Pick, cus: int) -> str:
    return f"{table.name}, batch >= {pick.bucket} on {table.gfx} with {cus} CUs"
