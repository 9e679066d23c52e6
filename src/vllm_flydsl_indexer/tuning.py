# SPDX-License-Identifier: Apache-2.0
"""The measured per-shape choice between FlyDSL and stock, from an aiter-format tuned CSV (where aiter has
its tuned dispatcher, its own table decides; ``docs/aiter-kernels.md``, "The tuned table").

* **Where from** (:func:`sources`, once at registration, the first usable winning): the user's table
  (``envs.TUNED_CSV``; :data:`OFF_VALUES`: none, FlyDSL wherever eligible), else the built-in one (AMD's
  MI355X measurements) for the kernel it measured. Uncovered shapes: this node's cache or measurement.
* **Read leniently, as aiter's reader:** unusable rows skipped with one WARNING per file (``doctor`` says
  why); a file with no usable row for this GPU falls to the next source, with one WARNING.
* **Lookup, as aiter's:** this GPU's rows (``gfx``, ``cu_num``) and shape, at the largest ``batch_size`` at
  or below the call's; its rows must agree on one backend (and ``wg_per_cu``, aiter's SplitKV rule).
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from vllm_flydsl_indexer.envs import HEAD, TABLE_IGNORED_LINE, TUNED_CSV, parse_bool
from vllm_flydsl_indexer.target import read_capped

COLUMNS = tuple(
    "gfx cu_num batch_size next_n heads head_dim kv_block_size preshuffle context_len backend "
    "ChunkK WavePerEU wg_per_cu us gluon_us flydsl_us".split()
)
# aiter's lookup key: a later row of the same key replaces an earlier one.
KEY_COLUMNS = COLUMNS[:8]
SIZE_COLUMNS = ("cu_num", "batch_size", "next_n", "heads", "head_dim", "kv_block_size")
# aiter's reader skips lines starting with this.
COMMENT = "#"
# $VLLM_FLYDSL_INDEXER_TUNED_CSV=none (or another of OFF_VALUES; trimmed, case-insensitive): no table at all.
OFF_VALUES = ("none", "off", "0", "false")
# The built-in table: AMD's MI355X measurements (aiter PR #6140 at 39029932), shipped as package data with
# its provenance in its own comment lines, for the one kernel variant it was measured on.
BUILTIN_PATH = str(Path(__file__).resolve().parent / "data" / "paged_mqa_logits_tuned.csv")
BUILTIN_VARIANT = "gfx950"
BUILTIN_LABEL = "built-in table (aiter 39029932, AMD's MI355X measurements)"
DOCTOR_HINT = "vllm-flydsl-indexer doctor names each row's reason"
# A whole number as aiter's reader takes it: ASCII digits, ``3`` or ``3.0``.
WHOLE = re.compile(r"[0-9]+(?:\.0*)?")


def arch_of(gcn_arch: str) -> str:
    """``gfx950:sramecc+:xnack-`` -> ``gfx950``."""
    return gcn_arch.split(":", 1)[0].strip()


def usable_row(row: dict) -> tuple[str, tuple, int, str, int] | None:
    """``(gfx, shape key, batch, backend, wg_per_cu)`` of a row the lookup can use, else ``None``. The
    tools' validator (``tools/tuned.py``) says why a row is not usable; this is only what the lookup reads."""
    try:
        cells = {c: row[c].strip() for c in (*KEY_COLUMNS, "backend", "wg_per_cu")}
    except (KeyError, AttributeError):
        return None
    if not all(WHOLE.fullmatch(cells[c]) for c in (*SIZE_COLUMNS, "wg_per_cu")):
        return None
    cus, batch, next_n, heads, head_dim, kvb = (int(float(cells[c])) for c in SIZE_COLUMNS)
    backend, preshuffle = cells["backend"].lower(), parse_bool(cells["preshuffle"])
    gfx = arch_of(cells["gfx"])
    if min(cus, batch, next_n, heads, head_dim, kvb) < 1 or preshuffle is not (kvb > 1) or not gfx.isalnum():
        return None  # no call can match a preshuffle other than KVBlockSize > 1
    if backend not in ("flydsl", "gluon"):
        return None
    wg = int(float(cells["wg_per_cu"])) if backend == "flydsl" else 0
    return gfx, (cus, next_n, heads, head_dim, kvb), batch, backend, wg


@dataclass
class TunedTable:
    """One file's rows for one GPU arch, by shape: ``{shape: {batch: [(backend, wg_per_cu), ...]}}``."""

    name: str  # how reasons and log lines name it: the built-in one by its label, a file by its path
    gfx: str
    origin: str = "env"  # "env", "built-in" or "node"
    shapes: dict[tuple, dict[int, list[tuple[str, int]]]] = field(default_factory=dict)
    skipped: int = 0  # rows the lookup cannot use (any gfx)

    def cu_counts(self) -> set[int]:
        return {shape[0] for shape in self.shapes}

    def choice(self, cus: int, batch: int, next_n: int, heads: int, head_dim: int, block_size: int):
        """``(backend, bucket, wg_per_cu, conflict)`` for the call, or ``None`` where no row covers it (the
        router memoises it per call signature). ``conflict``: why the bucket's FlyDSL rows cannot be launched
        as one measurement."""
        buckets = self.shapes.get((cus, next_n, heads, head_dim, block_size), {})
        tuned = [b for b in buckets if b <= batch]
        if not tuned:
            return None
        measured = buckets[max(tuned)]
        knobs, backends = sorted({knob for _, knob in measured}), {backend for backend, _ in measured}
        if len(backends) > 1 or "gluon" in backends:
            return "gluon", max(tuned), 0, None
        conflict = f"its FlyDSL rows disagree on wg_per_cu ({knobs})" if len(knobs) > 1 else None
        return backends.pop(), max(tuned), knobs[0], conflict


def parse(text: str, gfx: str, name: str, origin: str = "env") -> TunedTable | str:
    """The table in CSV ``text`` for ``gfx``, or why it has none usable. Never raises."""
    table, total = TunedTable(name, gfx, origin), 0
    try:
        # Dropped, not blanked: a blank line before the header would be read as an empty header.
        lines = (line for line in io.StringIO(text, newline="") if not line.lstrip().startswith(COMMENT))
        reader = csv.DictReader(lines)
        missing = [c for c in (*KEY_COLUMNS, "backend", "wg_per_cu") if c not in (reader.fieldnames or ())]
        if missing:
            return f"{name}: missing column(s) {', '.join(missing)}"
        for row in reader:
            total += 1
            found = usable_row(row)
            if found is None:
                table.skipped += 1
            elif found[0] == gfx:
                _, shape, batch, backend, wg = found
                table.shapes.setdefault(shape, {}).setdefault(batch, []).append((backend, wg))
    except Exception as e:  # noqa: BLE001 - a table file must never crash start-up
        return f"{name}: {type(e).__name__}: {e}"
    if not table.shapes:
        return f"{name}: {total} rows, {table.skipped} unusable, none usable for {gfx}"
    return table


def read(path: str, gfx: str, origin: str = "env") -> TunedTable | str:
    """The table in file ``path`` (one capped read) for ``gfx``, named by its path (the built-in one by its
    label), or why it has none usable. Never raises."""
    try:
        text = read_capped(path)
    except Exception as e:  # noqa: BLE001 - not a regular file, too large, not UTF-8...
        return f"{path}: {type(e).__name__}: {e}"
    return parse(text, gfx, BUILTIN_LABEL if origin == "built-in" else path, origin)


def sources(env_value: str | None, variant: str | None) -> list[tuple[str | None, str, str]]:
    """``(path, origin, label)`` of each table for the found kernel ``variant``, in precedence order; the
    last has no path (``None``): no table, with what then decides."""
    value = (env_value or "").strip()
    if value.lower() in OFF_VALUES:
        return [(None, "off", f"no tuned table ({TUNED_CSV}={value.lower()}): FlyDSL wherever eligible")]
    found: list[tuple[str | None, str, str]] = []
    if value:
        found.append((value, "env", f"tuned table {value} ({TUNED_CSV})"))
    if variant == BUILTIN_VARIANT:
        found.append((BUILTIN_PATH, "built-in", BUILTIN_LABEL))
    none = "shapes no table covers: this node's measurement (vllm-flydsl-indexer tune), else stock"
    return [*found, (None, "none", none)]


def load(variant: str | None, gfx: str, logger: logging.Logger) -> tuple[TunedTable | None, str]:
    """The first usable table for ``variant`` on ``gfx`` and the label the ACTIVE line gives it; one
    WARNING per source that cannot be used and per file with rows skipped. Never raises."""
    *files, (_, _, no_table) = sources(os.environ.get(TUNED_CSV), variant)  # the last: no path
    for path, origin, label in files:
        table = read(path, gfx, origin)
        if isinstance(table, str):
            logger.warning("%s %s; trying the next source", TABLE_IGNORED_LINE, table)
            continue
        if table.skipped:
            line = f"{table.skipped} row(s) of {path} skipped: the lookup cannot use them ({DOCTOR_HINT})"
            logger.warning("%s %s", HEAD, line)
        return table, label
    return None, no_table
