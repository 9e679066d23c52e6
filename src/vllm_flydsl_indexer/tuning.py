# SPDX-License-Identifier: Apache-2.0
"""A measured per-shape choice between FlyDSL and stock, in aiter's tuned-CSV format.

aiter's tuned dispatcher (aiter PR #6140, ``aiter/paged_mqa_logits.py``) reads
``paged_mqa_logits_tuned.csv`` with the columns of :data:`COLUMNS` and picks
Gluon or FlyDSL per shape, with that row's knobs. When the installed aiter has
that dispatcher, the plugin routes through it and its table decides. When aiter
has a FlyDSL kernel but no dispatcher, this module gives the plugin the same
choice, and the same launch, from the same kind of file:

* **Where from** (:func:`table_source`), first found: ``$VLLM_FLYDSL_INDEXER_TUNED_CSV``
  if set (trimmed; ``none``, ``off``, ``0`` or ``false`` turn every table off: FlyDSL wherever
  eligible, the A/B of the kernel alone); else the table the installed aiter ships
  (``aiter/configs/paged_mqa_logits_tuned.csv``); else the **built-in** table,
  for the kernel it was measured on only (:data:`BUILTIN`: aiter's published
  table, AMD's MI355X measurements of the ``gfx950`` kernel); else none. The
  first usable one replaces the others: tables are never merged. A file that
  cannot be used (below) falls to the next source, with one WARNING naming
  both (:func:`resolve`). Read once per process, when the plugin registers.
* **Lookup, as aiter's:** the rows of this GPU (``gfx`` and ``cu_num``) and
  this shape (``next_n``, ``heads``, ``head_dim``, ``kv_block_size``,
  ``preshuffle``); of those, the largest tuned ``batch_size`` at or below the
  call's batch. Several rows of that batch (older tables kept one per
  ``context_len``) must all say ``flydsl`` with one ``wg_per_cu`` for FlyDSL: a
  table never sends a shape to FlyDSL that one of its own measurements found
  slower, nor launches a knob that one of them did not measure.
* **The knob:** a FlyDSL row's ``wg_per_cu`` is what aiter's dispatcher turns
  into ``SplitKV = max(1, min(pages, ceil(CUs * wg_per_cu / batch)))``; ``0``
  means the kernel's default launch (aiter's ``FLYDSL_DEFAULT_WG_PER_CU`` 3 for
  the gfx950 kernel). The router launches exactly that
  (:meth:`~vllm_flydsl_indexer.kernels.KernelVariant.launch_kwargs`); a kernel
  whose launch cannot take the row's knob keeps the call stock. A Gluon row's
  ``ChunkK``/``WavePerEU`` are informational here: stock is called unchanged.
* **Not covered** (no row for the shape, or only larger batches): the switch
  keeps its meaning, FlyDSL where eligible, with the kernel's default launch.
* **Bad file:** one validator (:func:`check_row`) for every column of every
  row, whatever its gfx: unreadable, a missing column or a bad value anywhere
  gives one WARNING naming the file, line and column, and the next source in use;
  the table is ignored as a whole, never read in part. No row for this GPU's arch likewise. Rows of
  the right arch but another CU count are dropped by the router with one
  WARNING at the first call on the device.

The decision reads shapes only (a decode graph fixes batch and ``next_n``)
and is memoised with the router's verdict, so it costs the hot path nothing.
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
from vllm_flydsl_indexer._logging import TABLE_IGNORED_LINE
from vllm_flydsl_indexer.envs import ACCEPTED, parse_bool
from vllm_flydsl_indexer.target import Call, RouterView

__all__ = [
    "BUILTIN",
    "COLUMNS",
    "KEY_COLUMNS",
    "OFF",
    "OFF_VALUES",
    "Pick",
    "TableError",
    "TunedRow",
    "TableSource",
    "TunedTable",
    "check_row",
    "describe",
    "load",
    "read",
    "read_rows",
    "read_table",
    "pick_for",
    "in_use",
    "resolve",
    "table_source",
    "where",
]

COLUMNS = (
    "gfx",
    "cu_num",
    "batch_size",
    "next_n",
    "heads",
    "head_dim",
    "kv_block_size",
    "preshuffle",
    "context_len",
    "backend",
    "ChunkK",
    "WavePerEU",
    "wg_per_cu",
    "us",
    "gluon_us",
    "flydsl_us",
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


# (cu_num, next_n, heads, head_dim, kv_block_size, preshuffle)
ShapeKey = tuple[int, int, int, int, int, bool]


class TableError(ValueError):
    """Why a table file cannot be used (the WARNING's text): file, line and column."""


class TunedRow(NamedTuple):
    """One validated row; ``text`` is the row as read, for writing it back unchanged."""

    gfx: str
    key: tuple[
        int, int, int, int, int, int, bool
    ]  # cu_num, batch_size, next_n, heads, head_dim, kvb, preshuffle
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
    value = int(number)
    if value < least:
        raise ValueError(f"{value} is not {'positive' if least == 1 else f'>= {least}'}")
    return value


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


def _cell(row: dict[str, str | None], column: str) -> str:
    value = row.get(column)
    if value is None:
        raise ValueError("is missing (the row is short)")
    return value.strip()


def check_row(row: dict[str, str | None]) -> TunedRow:
    """Validate every column of one CSV row; raises ``ValueError("column ...: why")``.

    The one rule of what a row is, for the plugin, doctor and ``bench --tune`` alike: a row that no
    call can match (``preshuffle`` other than ``kv_block_size > 1``) is refused, not kept unreachable.
    """

    def cell(column: str) -> str:
        try:
            return _cell(row, column)
        except ValueError as e:
            raise ValueError(f"column {column}: {e}") from None

    def checked(column: str, parse):
        text = cell(column)
        try:
            return parse(text)
        except ValueError as e:
            raise ValueError(f"column {column}: {e}") from None

    if None in row:  # csv.DictReader puts a long row's extra cells under the key None
        raise ValueError(
            f"after column {COLUMNS[-1]}: {len(row[None])} more cell(s) "
            f"than the header's {len(row) - 1} columns"
        )
    gfx = arch_of(cell("gfx"))
    if not gfx:
        raise ValueError("column gfx: is empty")
    sizes = [checked(c, lambda t: _int(t, 1)) for c in SIZE_COLUMNS]
    preshuffle = checked("preshuffle", _bool)
    kvb = sizes[SIZE_COLUMNS.index("kv_block_size")]
    if preshuffle != (kvb > 1):  # the lookup reads preshuffle off the call's KVBlockSize: no call matches
        raise ValueError(
            f"column preshuffle: {cell('preshuffle')!r} with kv_block_size {kvb}: no call can match this row "
            f"(vLLM's calls are preshuffled exactly when KVBlockSize > 1, so {int(kvb > 1)} here)"
        )
    checked("context_len", _context_lens)
    backend = checked("backend", _backend)
    knobs = {c: checked(c, lambda t: _int(t, 0)) for c in KNOB_COLUMNS}
    for column in OWN_KNOBS[backend]:
        if knobs[column] < 1:
            raise ValueError(f"column {column}: {knobs[column]} is not positive (a {backend} row's knob)")
    for column in TIME_COLUMNS:
        checked(column, lambda t, c=column: _time(t, c in OPTIONAL_TIME_COLUMNS))
    key = (sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], preshuffle)
    text = {c: (row.get(c) or "") for c in COLUMNS}
    return TunedRow(gfx, key, backend, knobs["wg_per_cu"] if backend == "flydsl" else 0, text)


def _bool(text: str) -> bool:
    value = parse_bool(text)
    if value is None:
        raise ValueError(f"{text!r} is not {'/'.join(ACCEPTED)}")
    return value


def _backend(text: str) -> str:
    backend = text.lower()
    if backend not in BACKENDS:
        raise ValueError(f"{text!r} is not flydsl or gluon")
    return backend


class NotATable(TableError):
    """The file's header lacks aiter's columns: not an aiter-format tuned CSV at all."""


@dataclass
class ParsedTable:
    """An aiter-format CSV as read: its header, validated rows, and ``#`` lines with their places."""

    header: list[str]
    rows: list[TunedRow]
    # (data rows before it, the line as read); -1: before the header.
    comments: list[tuple[int, str]] = field(default_factory=list)


def read_table(lines: Iterable[str], source: str) -> ParsedTable:
    """Every row of an aiter-format CSV, validated; raises :class:`TableError` at the first bad one.

    One reader for the plugin, doctor and ``bench --tune``: ``#`` lines are skipped (and kept, with
    their places, for writing the table back), a UTF-8 byte-order mark is dropped, and an error names
    the line its record starts on (a quoted field may run over several).
    """
    comments: list[tuple[int, str]] = []
    header: list[str] = []
    rows: list[TunedRow] = []

    def uncommented() -> Iterator[str]:
        for i, line in enumerate(lines):
            if i == 0:
                line = line.removeprefix("\ufeff")
            if line.lstrip().startswith(COMMENT):
                comments.append((len(rows) if header else -1, line.rstrip("\r\n")))
                yield "\n"
            else:
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
        where = f"line {first}" + (
            f" (a quoted field runs to line {reader.line_num})" if reader.line_num > first else ""
        )
        if not header:
            header = cells
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise NotATable(f"{source}: {where}: missing column(s) {', '.join(missing)}")
            continue
        row: dict[str | None, object] = dict(zip(header, cells, strict=False))
        if len(cells) > len(header):
            row[None] = cells[len(header) :]
        try:
            rows.append(check_row(row))  # type: ignore[arg-type]
        except ValueError as e:
            raise TableError(f"{source}: {where}, {e}") from None
    if not header:
        raise NotATable(f"{source}: missing column(s) {', '.join(COLUMNS)} (no header)")
    return ParsedTable(header, rows, comments)


def read_rows(lines: Iterable[str], source: str) -> list[TunedRow]:
    """Every row of an aiter-format CSV, validated (:func:`read_table`)."""
    return read_table(lines, source).rows


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
        """The table's :class:`Pick` for the call, or ``None`` when it does not cover it (memoised)."""
        args = (cus, batch, next_n, heads, head_dim, block_size)
        if args not in self._picks:
            self._picks[args] = self._choice(*args)
        return self._picks[args]

    def _choice(
        self, cus: int, batch: int, next_n: int, heads: int, head_dim: int, block_size: int
    ) -> Pick | None:
        buckets = self.shapes.get((cus, next_n, heads, head_dim, block_size, block_size > 1))
        if not buckets:
            return None
        tuned = [b for b in buckets if b <= batch]
        if not tuned:
            return None
        bucket = max(tuned)
        measured = buckets[bucket]
        if any(backend != "flydsl" for backend, _ in measured):
            return Pick("gluon", bucket, 0)
        knobs = sorted({knob for _, knob in measured})
        if len(knobs) > 1:
            return Pick("flydsl", bucket, knobs[0], f"its FlyDSL rows disagree on wg_per_cu ({knobs})")
        return Pick("flydsl", bucket, knobs[0])

    @classmethod
    def of(cls, rows: Iterable[TunedRow], source: str, gfx: str) -> TunedTable:
        """The rows of ``gfx``; raises :class:`TableError` when there are none."""
        table = cls(source, gfx, 0)
        total = 0
        for row in rows:
            total += 1
            if row.gfx != gfx:
                continue
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
    """The table in file ``source`` for ``gfx``; every failure is a :class:`TableError`.

    Whatever the file is (a directory, a FIFO, a device, over the size cap, unreadable,
    not UTF-8, NUL bytes, an oversize field, empty, a header only), this raises nothing else.
    """
    try:  # regular files only, size-capped: a FIFO never hangs
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
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / AITER_TABLE[1]
        if candidate.is_file():
            return str(candidate)
    return None


def table_source(env_value: str | None, variant: str | None) -> TableSource:
    """The table for the found kernel ``variant``: the variable's, aiter's shipped one, the built-in one
    (only for the variant it was measured on), or none. The first found replaces the rest; each source
    names the next (:attr:`TableSource.fallback`), used only when its own file cannot be.

    The variable's value is trimmed; one of :data:`OFF_VALUES` (any case) turns tables off; any other
    non-empty value names a file.
    """
    value = (env_value or "").strip()
    if value.lower() in OFF_VALUES:
        return TableSource(
            None, "off", f"no tuned table ({envs.TUNED_CSV}={value.lower()}): FlyDSL wherever eligible"
        )
    chain = TableSource(
        None,
        "none",
        f"no measurement for the {variant or 'found'} FlyDSL kernel: FlyDSL wherever eligible "
        "(vllm-flydsl-indexer bench --tune measures this node)",
    )
    if variant == BUILTIN.variant:
        chain = TableSource(BUILTIN.path(), "built-in", BUILTIN.label, chain)
    shipped = _aiter_table()
    if shipped is not None:
        chain = TableSource(shipped, "aiter", f"tuned table {shipped} (shipped with aiter)", chain)
    if value:
        chain = TableSource(value, "env", f"tuned table {value} ({envs.TUNED_CSV})", chain)
    return chain


@dataclass(frozen=True)
class Resolution:
    """Which source decides after the unusable ones fell through: the source, its table, the skipped."""

    used: TableSource  # the source in use (path None: no table)
    table: TunedTable | None
    ignored: tuple[tuple[TableSource, str], ...]  # each unusable source before it, and why


def resolve(source: TableSource, gfx: str) -> Resolution:
    """Read ``source`` for ``gfx``; a file that cannot be used falls to the next source. Never raises."""
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
        return Resolution(current, table, tuple(ignored))
    return Resolution(current or source, None, tuple(ignored))


def ignored_text(resolution: Resolution) -> list[str]:
    """One text per source that could not be used: why, and the source used instead."""
    used = resolution.used
    then = f"using the {used.label} instead" if used.path is not None else f"no other table: {used.label}"
    return [f"{why}; {then}" for _, why in resolution.ignored]


def load_source(source: TableSource, gfx: str, logger: logging.Logger) -> TunedTable | None:
    """Read ``source`` for ``gfx`` (:func:`resolve`): ``None`` for no table. A source that cannot be used
    gets one WARNING naming its file and the source used instead. Never raises."""
    resolution = resolve(source, gfx)
    for text in ignored_text(resolution):
        logger.warning("%s %s", TABLE_IGNORED_LINE, text)
    return resolution.table


def load(source: str | None, gfx: str, logger: logging.Logger) -> TunedTable | None:
    """Read ``source`` for ``gfx``; ``None`` (after one WARNING) when it cannot be used. Never raises."""
    if source is None:
        return None
    try:
        return read(source, gfx)
    except TableError as e:
        logger.warning("%s %s", TABLE_IGNORED_LINE, e)
        return None


def in_use(source: TableSource, loaded: TunedTable | bool | None) -> str:
    """What the ACTIVE line says decides per shape: the label of the table loaded (``loaded``, the
    table :func:`load_source` returned), or, when none could be, the last source's."""
    if isinstance(loaded, TunedTable) and loaded.label:
        return loaded.label
    if source.path is None or loaded:
        return source.label
    last = source
    while last.fallback is not None:
        last = last.fallback
    return f"{source.label} ignored, {last.label}"


def env_source(variant: str | None) -> TableSource:
    """:func:`table_source` from this process's environment."""
    return table_source(os.environ.get(envs.TUNED_CSV), variant)


def describe(table: TunedTable) -> list[dict[str, object]]:
    """Per shape and CU count, the arm (and FlyDSL knob) of each batch bucket (for ``doctor``)."""
    out = []
    for (cus, next_n, heads, head_dim, block_size, preshuffle), buckets in sorted(table.shapes.items()):
        entries = []
        for batch in sorted(buckets):
            pick = table.choice(cus, batch, next_n, heads, head_dim, block_size)
            if pick is None or pick.bucket != batch:  # unreachable for a table check_row passed
                entries.append({"batch_at_least": batch, "arm": "stock", "why": "no call matches"})
                continue
            entry: dict[str, object] = {
                "batch_at_least": batch,
                "arm": "flydsl" if pick.backend == "flydsl" and pick.conflict is None else "stock",
            }
            if pick.backend == "flydsl":
                entry["wg_per_cu"] = pick.wg_per_cu
            entries.append(entry)
        out.append(
            {
                "cu_num": cus,
                "next_n": next_n,
                "heads": heads,
                "head_dim": head_dim,
                "kv_block_size": block_size,
                "preshuffle": preshuffle,
                "buckets": entries,
            }
        )
    return out


def pick_for(call: Call, router: RouterView, cus: int) -> Pick | None:
    """The router's table's :class:`Pick` for this call on a GPU of ``cus`` CUs, or ``None``."""
    table = router.table
    if table is None:
        return None
    batch, next_n, heads, head_dim = call.q_fp8.shape
    return table.choice(cus, batch, next_n, heads, head_dim, call.kv_cache.shape[1])


def where(table: TunedTable, pick: Pick, cus: int) -> str:
    return f"{table.name}, batch >= {pick.bucket} on {table.gfx} with {cus} CUs"
