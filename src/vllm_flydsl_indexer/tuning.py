# SPDX-License-Identifier: Apache-2.0
"""A measured per-shape choice between FlyDSL and stock, in aiter's tuned-CSV format.

aiter's tuned dispatcher (aiter PR #6140) reads ``paged_mqa_logits_tuned.csv``
with the columns of :data:`COLUMNS` and picks Gluon or FlyDSL per shape. When
the installed aiter has that dispatcher, the plugin routes through it and its
table decides. When aiter has a FlyDSL kernel but no dispatcher, this module
gives the plugin the same choice from the same kind of file:

* **Where from:** ``$VLLM_FLYDSL_INDEXER_TUNED_CSV`` if set, else the table the
  installed aiter ships (``aiter/configs/paged_mqa_logits_tuned.csv``) if it
  has one. Read once per process, when the plugin registers.
* **Lookup, as aiter's:** the rows of this GPU (``gfx`` and ``cu_num``) and
  this shape (``next_n``, ``heads``, ``head_dim``, ``kv_block_size``,
  ``preshuffle``); of those, the largest tuned ``batch_size`` at or below the
  call's batch. Several rows of that batch (other ``context_len``) must all say
  ``flydsl`` for FlyDSL: a table never sends a shape to FlyDSL that one of its
  own measurements found slower.
* **Not covered** (no row for the shape, or only larger batches): the switch
  keeps its meaning, FlyDSL where eligible.
* **Bad file:** unreadable, a missing column, a bad value on any row, or no
  row for this GPU's arch: one WARNING, and the table is ignored as a whole,
  never read in part. Rows of the right arch but another CU count warn once
  at the first call on the device and are likewise ignored.

The decision reads shapes only (a decode graph fixes batch and ``next_n``)
and is memoised with the router's verdict, so it costs the hot path nothing.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_flydsl_indexer._logging import TABLE_IGNORED_LINE
from vllm_flydsl_indexer.envs import ACCEPTED, parse_bool
from vllm_flydsl_indexer.kernels import cu_count
from vllm_flydsl_indexer.target import Call, RouterView

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
BACKENDS = ("flydsl", "gluon")
INT_COLUMNS = ("cu_num", "batch_size", "next_n", "heads", "head_dim", "kv_block_size")
# aiter writes the context lengths a row was measured over as one int or a
# ``;``-separated list (``8192;32768``, aiter PR #6140's shipped table).
CONTEXT_LEN_SEPARATOR = ";"
# Where an aiter without the dispatcher may still ship its measured table.
AITER_TABLE = ("aiter", "configs/paged_mqa_logits_tuned.csv")

# (cu_num, next_n, heads, head_dim, kv_block_size, preshuffle)
ShapeKey = tuple[int, int, int, int, int, bool]


class TableError(ValueError):
    """Why a table file cannot be used (the WARNING's text)."""


def arch_of(gcn_arch: str) -> str:
    """``gfx950:sramecc+:xnack-`` -> ``gfx950``."""
    return gcn_arch.split(":", 1)[0].strip()


def _context_lens(text: str) -> list[int]:
    values = [int(part) for part in (text or "").split(CONTEXT_LEN_SEPARATOR) if part.strip()]
    if not values:
        raise ValueError("context_len is empty")
    return values


def _bool(text: str) -> bool:
    value = parse_bool(text)
    if value is None:
        raise ValueError(f"{text!r} is not {'/'.join(ACCEPTED)}")
    return value


@dataclass
class TunedTable:
    """The rows of one GPU arch, grouped by shape: ``{key: {batch: {backends}}}``."""

    source: str
    gfx: str
    rows: int
    shapes: dict[ShapeKey, dict[int, set[str]]] = field(default_factory=dict)

    def cu_counts(self) -> set[int]:
        return {key[0] for key in self.shapes}

    def choice(
        self, cus: int, batch: int, next_n: int, heads: int, head_dim: int, block_size: int
    ) -> tuple[str, int] | None:
        """``(backend, tuned batch)`` for the call, or ``None`` when the table does not cover it."""
        buckets = self.shapes.get((cus, next_n, heads, head_dim, block_size, block_size > 1))
        if not buckets:
            return None
        tuned = [b for b in buckets if b <= batch]
        if not tuned:
            return None
        bucket = max(tuned)
        backends = buckets[bucket]
        return ("flydsl" if backends == {"flydsl"} else "gluon"), bucket


def parse(lines: Iterable[str], source: str, gfx: str) -> TunedTable:
    """The rows of ``gfx`` in an aiter-format CSV; raises :class:`TableError` on any bad row."""
    reader = csv.DictReader(lines)
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise TableError(f"{source}: missing column(s) {', '.join(missing)}")
    table = TunedTable(source, gfx, 0)
    total = 0
    for number, row in enumerate(reader, start=2):
        total += 1
        try:
            values = {c: int(row[c]) for c in INT_COLUMNS}
            values["context_len"] = min(_context_lens(row["context_len"]))
            preshuffle = _bool(row["preshuffle"])
            backend = row["backend"].strip().lower()
            if backend not in BACKENDS:
                raise ValueError(f"backend {row['backend']!r} is not flydsl or gluon")
            if min(values.values()) < 0 or values["batch_size"] < 1 or values["next_n"] < 1:
                raise ValueError("sizes must be positive")
        except (TypeError, ValueError, AttributeError) as e:
            raise TableError(f"{source}: line {number}: {e}") from e
        if arch_of(row["gfx"] or "") != gfx:
            continue
        key = (
            values["cu_num"],
            values["next_n"],
            values["heads"],
            values["head_dim"],
            values["kv_block_size"],
            preshuffle,
        )
        table.shapes.setdefault(key, {}).setdefault(values["batch_size"], set()).add(backend)
        table.rows += 1
    if total == 0:
        raise TableError(f"{source}: no rows")
    if table.rows == 0:
        raise TableError(f"{source}: no rows for {gfx} (of {total})")
    return table


def table_source(env_value: str | None) -> str | None:
    """The file to read: the variable's, else the installed aiter's shipped table, else none."""
    if env_value:
        return env_value
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


def load(source: str | None, gfx: str, logger: logging.Logger) -> TunedTable | None:
    """Read ``source`` for ``gfx``; ``None`` (after one WARNING) when it cannot be used. Never raises."""
    if source is None:
        return None
    try:
        with open(source, newline="") as f:
            return parse(f, source, gfx)
    except (OSError, UnicodeDecodeError, csv.Error, TableError) as e:
        logger.warning(
            "%s %s",
            TABLE_IGNORED_LINE,
            e if isinstance(e, TableError) else f"{source}: {e}",
        )
        return None


def env_source() -> str | None:
    from vllm_flydsl_indexer import envs

    return table_source(os.environ.get(envs.TUNED_CSV) or None)


def describe(table: TunedTable) -> list[dict[str, object]]:
    """Per shape and CU count, the arm of each batch bucket (for ``doctor``)."""
    out = []
    for (cus, next_n, heads, head_dim, block_size, preshuffle), buckets in sorted(table.shapes.items()):
        out.append(
            {
                "cu_num": cus,
                "next_n": next_n,
                "heads": heads,
                "head_dim": head_dim,
                "kv_block_size": block_size,
                "preshuffle": preshuffle,
                "buckets": [
                    {"batch_at_least": b, "arm": "flydsl" if backends == {"flydsl"} else "stock"}
                    for b, backends in sorted(buckets.items())
                ],
            }
        )
    return out


def _choice(call: Call, router: RouterView) -> tuple[str, int, int] | None:
    """``(backend, batch bucket, CUs)`` of the router's table for this call, or ``None``.

    A table with no rows for this GPU's CU count is dropped from the router,
    with one WARNING.
    """
    table = router.table
    if table is None:
        return None
    batch, next_n, heads, head_dim = call.q_fp8.shape
    cus = cu_count(call.q_fp8.device)
    if cus not in table.cu_counts():
        router.logger.warning(
            "%s %s has %s rows for CU count(s) %s, none for this GPU's %d CUs",
            TABLE_IGNORED_LINE,
            table.source,
            table.gfx,
            sorted(table.cu_counts()),
            cus,
        )
        router.table = None
        return None
    pick = table.choice(cus, batch, next_n, heads, head_dim, call.kv_cache.shape[1])
    return None if pick is None else (*pick, cus)


def _where(table: TunedTable, bucket: int, cus: int) -> str:
    return f"tuned table {table.source}, batch >= {bucket} on {table.gfx} with {cus} CUs"


def table_rule(call: Call, router: RouterView) -> str | None:
    """A measured table that found stock (Gluon) faster at this shape and batch keeps it stock."""
    table = router.table
    pick = _choice(call, router)
    if pick is None or pick[0] == "flydsl":
        return None
    assert table is not None
    _, next_n, heads, head_dim = call.q_fp8.shape
    return (
        f"{_where(table, pick[1], pick[2])} measured stock (Gluon) faster for heads={heads} "
        f"head_dim={head_dim} KVBlockSize={call.kv_cache.shape[1]} next_n={next_n}"
    )


def flydsl_note(call: Call, router: RouterView) -> str:
    """For the first-taken log line: the table's FlyDSL pick, when a table decided."""
    table = router.table
    pick = _choice(call, router)
    if table is None or pick is None:
        return ""
    return f"; {_where(table, pick[1], pick[2])} measured FlyDSL faster"
