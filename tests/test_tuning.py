# SPDX-License-Identifier: Apache-2.0
"""The tuned table: aiter's CSV format, aiter's lookup, and what the router does with it.

Two readers: the plugin's (``tuning``: lenient, as aiter's; a row the lookup cannot use is skipped with one
WARNING per file, a file with no usable row falls to the next source) and the tools' validator
(``tools/tuned.py``: every cell, with file, line and column; doctor lists each skipped row's reason and
``tune --out`` refuses to merge into a bad table).
"""

from __future__ import annotations

import importlib
import io
import logging
import os

import pytest
import torch

from test_agreement import poison_workspace
from vllm_flydsl_indexer import envs, patch, tuning
from vllm_flydsl_indexer.selftest import read_window_ends
from vllm_flydsl_indexer.target import TARGET_MODULE
from vllm_flydsl_indexer.tools import doctor
from vllm_flydsl_indexer.tools import tuned as validator
from vllm_flydsl_indexer.tools.harness import compare_in_windows
from vllm_flydsl_indexer.tools.paths import call_site_in
from vllm_flydsl_indexer.tools.reference import make_paged_problem

HEADER = ",".join(tuning.COLUMNS)
LOGGER = logging.getLogger(envs.LOGGER_NAME)


def row(gfx="gfx950", cu=1, batch=4, next_n=1, heads=32, kvb=64, ctx=4096, backend="flydsl", wg=0):
    """One row as aiter's tuner writes it: each backend's own knobs, 0 for the other's."""
    fields = [
        gfx,
        cu,
        batch,
        next_n,
        heads,
        128,
        kvb,
        int(kvb > 1),
        ctx,
        backend,
        256 if backend == "gluon" else 0,
        2 if backend == "gluon" else 0,
        wg if backend == "flydsl" else 0,
        10.0,
        12.0,
        10.0,
    ]
    return ",".join(str(f) for f in fields)


def table_text(*rows: str) -> str:
    return "\n".join([HEADER, *rows]) + "\n"


def parse(*rows: str, gfx="gfx950") -> tuning.TunedTable:
    """The plugin's (lenient) reading of a table of ``rows``; it must have a usable row."""
    table = tuning.parse(table_text(*rows), gfx, "t.csv")
    assert isinstance(table, tuning.TunedTable), table
    return table


def usable(table: tuning.TunedTable) -> int:
    """How many rows of ``table``'s GPU the lookup holds."""
    return sum(len(rows) for buckets in table.shapes.values() for rows in buckets.values())


def choice(table: tuning.TunedTable, *args: int) -> tuple[str, int] | None:
    """The table's (arm, bucket) for a call, as aiter's lookup gives it."""
    pick = table.choice(*args)
    return None if pick is None else pick[:2]


def warnings_of(records) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


# What decides the shapes no table covers (issue 44): this node's measurement, else stock.
UNCOVERED = "shapes no table covers: this node's measurement"
# The reason such a shape stays stock with the measurement off (VLLM_FLYDSL_INDEXER_TUNE=0).
NOT_MEASURED = f"not yet measured on this GPU: stock ({envs.TUNE}=0)"


def uncovered_label(label: str) -> bool:
    """The ACTIVE line's words where no table decides: measured on this node, else stock."""
    return label.startswith(UNCOVERED) and label.endswith("else stock")


def test_lookup_takes_the_largest_tuned_batch_at_or_below_the_call():
    t = parse(row(batch=4, backend="gluon"), row(batch=16), row(batch=64, backend="gluon"), row(gfx="gfx942"))
    assert usable(t) == 3
    assert choice(t, 1, 3, 1, 32, 128, 64) is None  # below every tuned batch: not covered
    assert choice(t, 1, 4, 1, 32, 128, 64) == ("gluon", 4)
    assert choice(t, 1, 15, 1, 32, 128, 64) == ("gluon", 4)
    assert choice(t, 1, 16, 1, 32, 128, 64) == ("flydsl", 16)
    assert choice(t, 1, 63, 1, 32, 128, 64) == ("flydsl", 16)
    assert choice(t, 1, 500, 1, 32, 128, 64) == ("gluon", 64)
    # Other shapes and other GPUs are not covered.
    assert choice(t, 1, 16, 2, 32, 128, 64) is None
    assert choice(t, 1, 16, 1, 64, 128, 64) is None
    assert choice(t, 1, 16, 1, 32, 128, 1) is None
    assert choice(t, 256, 16, 1, 32, 128, 64) is None


def test_a_bucket_goes_to_flydsl_only_if_every_context_length_says_so():
    t = parse(row(batch=8, ctx=4096), row(batch=8, ctx=65536, backend="gluon"), row(batch=32, ctx=4096))
    assert choice(t, 1, 8, 1, 32, 128, 64) == ("gluon", 8)
    assert choice(t, 1, 40, 1, 32, 128, 64) == ("flydsl", 32)


def test_aiters_own_table_lists_context_lengths_with_semicolons():
    """aiter PR #6140's shipped table writes ``8192;32768`` in context_len: the table stays usable."""
    t = parse(row(batch=64, ctx="8192;32768"), row(batch=16, ctx="8192;32768", backend="gluon"))
    assert usable(t) == 2
    assert choice(t, 1, 64, 1, 32, 128, 64) == ("flydsl", 64)
    assert choice(t, 1, 32, 1, 32, 128, 64) == ("gluon", 16)


# Where aiter's shipped table (PR #6140, revision 39029932: gfx950, 256 CUs, heads 32, KVB 64,
# context_len "8192;32768", preshuffle "True") measured FlyDSL faster; Gluon at every other batch.
SHIPPED_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SHIPPED_FLYDSL = {
    1: {64, 256},
    2: {256},
    3: {256},
    4: {128, 256},
    5: {128, 256},
    6: {128, 256},
    7: {128, 256},
    8: {32, 64, 128, 256},
}


def shipped_like_rows() -> list[str]:
    rows = []
    for next_n, flydsl in SHIPPED_FLYDSL.items():
        for batch in SHIPPED_BATCHES:
            backend = "flydsl" if batch in flydsl else "gluon"
            knobs = "0,0,3" if backend == "flydsl" else "256,4,0"
            rows.append(
                f"gfx950,256,{batch},{next_n},32,128,64,True,8192;32768,{backend},{knobs},10.0,11.0,10.5"
            )
    return rows


def test_rows_above_next_n_2_are_parsed_and_decide_only_their_own_next_n():
    t = parse(*shipped_like_rows())
    assert usable(t) == 72 and len(t.shapes) == 8
    for next_n, flydsl in SHIPPED_FLYDSL.items():
        for batch in SHIPPED_BATCHES:
            expected = "flydsl" if batch in flydsl else "gluon"
            assert choice(t, 256, batch, next_n, 32, 128, 64) == (expected, batch), (next_n, batch)
    # vLLM's calls: next_n 1 (plain decode, and speculative decode flattened to one row per
    # token) and 2 (native MTP) see only their own rows, whatever next_n 3..8 measured.
    assert choice(t, 256, 128, 1, 32, 128, 64) == ("gluon", 128)  # FlyDSL at 128 for next_n 4..8
    assert choice(t, 256, 4 * 32, 1, 32, 128, 64) == ("gluon", 128)  # 32 requests, 3 draft tokens, flattened
    assert choice(t, 256, 64, 2, 32, 128, 64) == ("gluon", 64)  # FlyDSL at 64 for next_n 8
    assert choice(t, 256, 64, 9, 32, 128, 64) is None  # no row: not covered
    assert [s["next_n"] for s in doctor.describe(t)] == list(range(1, 9))


def test_rows_above_next_n_2_never_decide_vllms_calls(target, tuned, aiter_calls, plugin_log):
    # This CPU "device" has 1 CU. Stock is measured faster only at next_n 3..8.
    rows = [row(cu=1, batch=1, next_n=n, backend="flydsl" if n <= 2 else "gluon") for n in range(1, 9)]
    installed = tuned(*rows)
    assert run_batch(target, installed, aiter_calls, 3) == ["flydsl"]  # plain decode
    assert run_batch(target, installed, aiter_calls, 3 * 4) == ["flydsl"]  # 3 draft tokens, flattened
    assert run_batch(target, installed, aiter_calls, 3, next_n=2) == ["flydsl"]  # native MTP
    taken = [r.getMessage() for r in plugin_log if "FlyDSL taken for" in r.getMessage()]
    # One line per shape (next_n 1, next_n 2), naming the table that decides per batch.
    decided_by = f"; {installed.router.table.name} on gfx950 with 1 CUs; "
    assert len(taken) == 2 and all(decided_by in m for m in taken), taken
    # A native (B, 3) table, which vLLM's ROCm indexer never builds, would use the next_n 3 row.
    assert run_batch(target, installed, aiter_calls, 3, next_n=3) == ["gluon"]
    assert not [r for r in plugin_log if r.levelno >= logging.WARNING]


def cells(text: str, **values: object) -> str:
    """``text`` (one row) with the named columns' cells replaced."""
    fields = text.split(",")
    for column, value in values.items():
        fields[tuning.COLUMNS.index(column)] = str(value)
    return ",".join(fields)


# Rows the plugin's lookup cannot use: each is skipped by the plugin and refused by the validator (with
# the reason the validator gives it). Digits are ASCII only, as aiter's reader (issue 45 item 15): Python's
# float() would read Arabic-Indic or fullwidth digits. A gfx with a zero-width or control character names
# no GPU.
UNUSABLE_ROWS = [
    (row(batch="x"), "column batch_size: 'x' is not an integer"),
    (row(batch="2.5"), "column batch_size: '2.5' is not an integer"),
    (row(batch="\u0664"), "column batch_size: '\u0664' is not an integer"),  # Arabic-Indic 4
    (row(batch="\uff14"), "column batch_size: '\uff14' is not an integer"),  # fullwidth 4
    (row(batch="1\u0660"), "column batch_size: '1\u0660' is not an integer"),  # 1 and an Arabic-Indic 0
    (row(batch=0), "column batch_size: 0 is not positive"),
    (row(cu=-1), "column cu_num: -1 is not positive"),
    (row(backend="triton"), "column backend: 'triton' is not flydsl or gluon"),
    (cells(row(), gfx=" "), "column gfx: is empty"),
    (cells(row(), gfx="gfx9\u200b50"), "column gfx: 'gfx9\\u200b50' is not letters and digits"),
    (cells(row(), gfx="gfx950\u200b"), "column gfx: 'gfx950\\u200b' is not letters and digits"),
    (cells(row(), gfx="gfx\x07950"), "column gfx: 'gfx\\x07950' is not letters and digits"),
    (cells(row(), preshuffle="maybe"), "column preshuffle: 'maybe' is not 1/0/true/false"),
    # A row no call can match: vLLM preshuffles exactly when KVBlockSize > 1.
    (cells(row(), preshuffle=0), "column preshuffle: '0' with kv_block_size 64: no call can match this row"),
    (
        cells(row(kvb=1), preshuffle="true"),
        "column preshuffle: 'true' with kv_block_size 1: no call can match this row",
    ),
    (cells(row(), wg_per_cu="abc"), "column wg_per_cu: 'abc' is not an integer"),
    (cells(row(), wg_per_cu="-1"), "column wg_per_cu: -1 is not >= 0"),
    (cells(row(), wg_per_cu="\uff12"), "column wg_per_cu: '\uff12' is not an integer"),
    ("gfx950,1,2", "column next_n: is missing (the row is short)"),
]
UNUSABLE_IDS = [
    "batch-x", "batch-2.5", "arabic-indic", "fullwidth", "mixed-digits", "batch-0", "cu-negative",
    "backend", "gfx-empty", "gfx-zero-width", "gfx-zero-width-end", "gfx-control", "preshuffle-word",
    "preshuffle-0-kvb-64", "preshuffle-1-kvb-1", "wg-word", "wg-negative", "wg-fullwidth", "short",
]  # fmt: skip


@pytest.mark.parametrize(("bad", "reason"), UNUSABLE_ROWS, ids=UNUSABLE_IDS)
def test_the_plugin_skips_a_row_its_lookup_cannot_use_and_keeps_the_rest(bad, reason):
    table = parse(row(batch=1), bad, row(batch=8, backend="gluon"))
    assert table.skipped == 1 and usable(table) == 2
    assert choice(table, 1, 4, 1, 32, 128, 64) == ("flydsl", 1)
    assert choice(table, 1, 8, 1, 32, 128, 64) == ("gluon", 8)
    # Alone in its file, the row leaves no usable table: the reason says so (the next source is tried).
    assert (
        tuning.parse(table_text(bad), "gfx950", "t.csv")
        == "t.csv: 1 rows, 1 unusable, none usable for gfx950"
    )


@pytest.mark.parametrize(("bad", "reason"), UNUSABLE_ROWS, ids=UNUSABLE_IDS)
def test_the_validator_refuses_the_same_row_naming_line_and_column(bad, reason):
    with pytest.raises(validator.TableError) as refused:
        validator.read_table(io.StringIO(table_text(row(batch=1), bad)), "t.csv")
    assert str(refused.value) == f"t.csv: line 3, {reason}" or str(refused.value).startswith(
        f"t.csv: line 3, {reason}"
    ), str(refused.value)
    errors: list[str] = []
    header, rows, _ = validator.read_table(
        io.StringIO(table_text(row(batch=1), bad, row(batch=2))), "t.csv", errors
    )
    assert len(rows) == 2 and len(errors) == 1 and errors[0].startswith(f"t.csv: line 3, {reason}"), errors


def test_the_plugin_reads_only_the_lookups_columns():
    """Cells the lookup never reads (context_len, the other backend's knobs, the times) do not make a row
    unusable to the plugin; the validator refuses them, and doctor says so."""
    for bad in (
        row(ctx="8192;x"),
        cells(row(), us="fast"),
        cells(row(), flydsl_us="inf"),
        cells(row(), ChunkK="x"),
    ):
        table = parse(row(batch=1), bad)
        assert table.skipped == 0 and usable(table) == 2, bad
        with pytest.raises(validator.TableError):
            validator.read_table(io.StringIO(table_text(bad)), "t.csv")


def test_a_table_without_the_lookups_columns_is_no_table():
    text = HEADER.replace(",wg_per_cu", "") + "\n" + row() + "\n"
    assert tuning.parse(text, "gfx950", "t.csv") == "t.csv: missing column(s) wg_per_cu"
    assert tuning.parse("", "gfx950", "t.csv").startswith("t.csv: missing column(s) gfx, cu_num, ")


@pytest.mark.parametrize(
    "text,message",
    [
        (HEADER.replace(",wg_per_cu", "") + "\n", "line 1: missing column(s) wg_per_cu"),
        (table_text(row(ctx="8192;x")), "line 2, column context_len: 'x' is not an integer"),
        (table_text(row(ctx=";")), "line 2, column context_len: is empty"),
        (table_text(row(ctx="0")), "line 2, column context_len: 0 is not positive"),
        (
            table_text(row(ctx="\u0664\u0660\u0669\u0666")),
            "line 2, column context_len: '\u0664\u0660\u0669\u0666' is not",
        ),
        # Every knob and time column, not only the lookup key.
        (table_text(cells(row(), ChunkK="x")), "line 2, column ChunkK: 'x' is not an integer"),
        (table_text(cells(row(), WavePerEU="")), "line 2, column WavePerEU: '' is not an integer"),
        (
            table_text(row(backend="gluon").replace(",256,2,", ",0,2,")),
            "line 2, column ChunkK: 0 is not positive",
        ),
        (table_text(cells(row(), us="fast")), "line 2, column us: 'fast' is not a number of microseconds"),
        (table_text(cells(row(), us="")), "line 2, column us: '' is not a number of microseconds"),
        (table_text(cells(row(), gluon_us="nan")), "line 2, column gluon_us: 'nan' is not a finite"),
        (table_text(cells(row(), flydsl_us="inf")), "line 2, column flydsl_us: 'inf' is not a finite"),
        (table_text(cells(row(), flydsl_us="-1")), "line 2, column flydsl_us: '-1' is not a finite"),
        # A row with a cell too many.
        (
            table_text(row() + ",7"),
            "line 2, after column flydsl_us: 1 more cell(s) than the header's 16 columns",
        ),
    ],
)
def test_the_validator_checks_every_cell(text, message):
    with pytest.raises(validator.TableError) as refused:
        validator.read_table(io.StringIO(text), "t.csv")
    assert str(refused.value).startswith(f"t.csv: {message}"), str(refused.value)


def test_the_validators_table_for_a_gpu_is_the_plugins():
    """``tools.tuned.read`` (doctor's, tune --out's): every row valid, then the plugin's lookup over them; a
    file with no row for the GPU is refused with the plugin's words."""
    assert validator.read_rows(io.StringIO(HEADER + "\n"), "t.csv") == []
    with pytest.raises(validator.TableError, match=r"^t.csv: 0 rows, 0 unusable, none usable for gfx950$"):
        validator.table_of([], "t.csv", "gfx950")
    rows = validator.read_rows(
        io.StringIO(table_text(row(gfx="gfx942"), row(gfx="gfx942", batch=8))), "t.csv"
    )
    with pytest.raises(validator.TableError, match=r"^t.csv: 2 rows, 0 unusable, none usable for gfx950$"):
        validator.table_of(rows, "t.csv", "gfx950")
    table = validator.table_of(rows, "t.csv", "gfx942")
    assert usable(table) == 2 and choice(table, 1, 9, 1, 32, 128, 64) == ("flydsl", 8)


def test_load_warns_once_per_file_with_the_count_of_skipped_rows(tmp_path, monkeypatch, plugin_log):
    bad = tmp_path / "bad.csv"
    bad.write_text(table_text(row(), row(backend="nope"), row(batch="\u0668"), row(batch=8)))
    monkeypatch.setenv(envs.TUNED_CSV, str(bad))
    table, label = tuning.load("general", "gfx950", LOGGER)
    assert table is not None and table.skipped == 2 and usable(table) == 2
    assert label == f"tuned table {bad} ({envs.TUNED_CSV})"
    assert warnings_of(plugin_log) == [
        f"vllm-flydsl-indexer: 2 row(s) of {bad} skipped: the lookup cannot use them "
        "(vllm-flydsl-indexer doctor names each row's reason)"
    ]


def test_a_file_with_no_usable_row_falls_to_the_next_source(tmp_path, monkeypatch, plugin_log):
    """Each unusable source is one WARNING, and the next source decides: the built-in table where the
    kernel is the one it was measured on, else no table (this node's measurement, else stock)."""
    bad = tmp_path / "bad.csv"
    bad.write_text(table_text(row(backend="nope"), row(gfx="gfx942")))
    for path in (bad, tmp_path / "absent.csv", tmp_path):
        monkeypatch.setenv(envs.TUNED_CSV, str(path))
        plugin_log.clear()
        table, label = tuning.load("gfx950", "gfx950", LOGGER)
        assert table is not None and table.origin == "built-in" and label == tuning.BUILTIN_LABEL
        (warning,) = warnings_of(plugin_log)
        assert warning.startswith(f"vllm-flydsl-indexer: tuned table ignored: {path}: ") and warning.endswith(
            "; trying the next source"
        ), warning
        plugin_log.clear()
        table, label = tuning.load("general", "gfx950", LOGGER)
        assert table is None and uncovered_label(label), label
        assert len(warnings_of(plugin_log)) == 1
    assert "2 rows, 1 unusable, none usable for gfx950" in tuning.read(str(bad), "gfx950")
    assert "FileNotFoundError" in tuning.read(str(tmp_path / "absent.csv"), "gfx950")
    assert f"{tmp_path} is a directory, not a regular file" in tuning.read(str(tmp_path), "gfx950")


def test_the_off_values_mean_no_table_and_no_warning(monkeypatch, plugin_log):
    for value in tuning.OFF_VALUES + (" None ", "OFF"):
        monkeypatch.setenv(envs.TUNED_CSV, value)
        table, label = tuning.load("gfx950", "gfx950", LOGGER)
        assert table is None and label.startswith("no tuned table ("), label
    assert not warnings_of(plugin_log)


@pytest.fixture
def tuned(target, workspace, monkeypatch, fresh_register, plugin_log, tmp_path):
    """Register with a tuned table of the given rows; returns the installed patch. The measurement is off
    (shapes the table does not cover stay stock, deterministically; tests/test_measure.py times them) and
    this node's cache is the test's own, empty."""

    def install(*rows: str):
        path = tmp_path / "tuned.csv"
        path.write_text(table_text(*rows))
        monkeypatch.setenv(envs.SWITCH, "1")
        monkeypatch.setenv(envs.TUNED_CSV, str(path))
        monkeypatch.setenv(envs.TUNE, "0")
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
        fresh_register()
        installed = patch.installed()
        assert installed is not None, [r.getMessage() for r in plugin_log]
        return installed

    return install


def run_batch(target, installed, calls, batch, next_n=1, heads=32, min_len=None) -> list[str]:
    """Stock and patched on one fresh problem; asserts agreement, returns the patched call's arms.

    ``min_len``: lengths from there up (default ``next_n``), e.g. so that ``max_model_len``'s pages
    do not cap SplitKV.
    """
    return run_problem(target, installed, calls, batch_problem(batch, next_n, heads, min_len))


def batch_problem(batch, next_n=1, heads=32, min_len=None):
    """A fresh problem of ``batch`` sequences at KVBlockSize 64, lengths from ``min_len`` up."""
    low = next_n if min_len is None else min_len
    return make_paged_problem(
        torch.randint(low, low + 300, (batch,), generator=torch.Generator().manual_seed(batch)).tolist(),
        next_n=next_n,
        heads=heads,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        per_row_bounds=next_n > 1,
        generator=torch.Generator().manual_seed(7 * batch),
    )


def run_problem(target, installed, calls, p) -> list[str]:
    """Stock and patched on problem ``p``; asserts agreement, returns the patched call's arms."""
    batch, next_n = p.q_fp8.shape[:2]
    args = (p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, p.max_model_len)
    rows = batch * next_n
    poison_workspace(rows, p.max_model_len)
    stock = installed.original(*args).clone()
    poison_workspace(rows, p.max_model_len)
    calls.clear()
    tested = len(installed.router.self_tests)
    out = call_site_in(importlib.import_module(TARGET_MODULE))(target.rocm_fp8_paged_mqa_logits, args, {})
    result = compare_in_windows(stock, out, read_window_ends(p.context_lens, rows, next_n), topk=64)
    assert result.nan_free and result.ok(0), result.describe()
    if len(installed.router.self_tests) > tested:
        # A shape's first call: its self-test came first: stock, then FlyDSL itself at SplitKV 1 and at
        # the largest reachable SplitKV (or once, where the launch takes no SplitKV); the live one is last.
        tests = calls[1:-1]
        assert calls[0][0] == "gluon" and tests and {a for a, _ in tests} == {calls[-1][0]}, calls
        assert calls[-1][1].get("SplitKV") is None or [k["SplitKV"] for _, k in tests][:1] == [1], calls
        del calls[:-1]
    return [a for a, _ in calls]


def last_reason(installed) -> str | None:
    """Why the latest new call signature stays stock (``None``: it took FlyDSL)."""
    return list(installed.router.routes.values())[-1].reason


def test_the_table_decides_per_batch_bucket(target, tuned, aiter_calls, plugin_log):
    # This CPU "device" reports 1 CU, so the simulated GPU is (gfx950, 1 CU).
    installed = tuned(row(batch=4, backend="gluon"), row(batch=8), row(batch=4, next_n=2))
    name = installed.router.table.name
    where = f"{name} on gfx950 with 1 CUs"
    shape = "heads=32 head_dim=128 KVBlockSize=64 next_n=1"
    gluon_at_4 = f"{where} measured stock (Gluon) faster at batch 4 of {shape}"
    # Below every tuned batch (2, 3): not covered, so this node's measurement, here off: stock.
    expected = {2: NOT_MEASURED, 3: NOT_MEASURED, 4: gluon_at_4, 7: gluon_at_4, 8: None, 12: None}
    for batch, reason in expected.items():
        assert run_batch(target, installed, aiter_calls, batch) == ["gluon" if reason else "flydsl"], batch
        assert last_reason(installed) == reason, batch
    assert run_batch(target, installed, aiter_calls, 2, next_n=2) == ["gluon"]  # not covered (4 > 2)
    assert last_reason(installed) == NOT_MEASURED
    assert run_batch(target, installed, aiter_calls, 5, next_n=2) == ["flydsl"]  # tuned FlyDSL
    # Another shape (64 heads) is not covered either: not measured, stock.
    assert run_batch(target, installed, aiter_calls, 5, heads=64) == ["gluon"]
    assert last_reason(installed) == NOT_MEASURED
    messages = [r.getMessage() for r in plugin_log]
    stock = [m for m in messages if "stock path for this call" in m]
    assert stock == [
        f"vllm-flydsl-indexer: stock path for this call: {NOT_MEASURED}",
        f"vllm-flydsl-indexer: stock path for this call: {gluon_at_4}",
    ], stock  # one line per reason, not per batch
    taken = [m for m in messages if "FlyDSL taken for" in m]
    assert len(taken) == 2 and all(f"; {where}; " in m for m in taken), taken  # next_n 1 and 2
    assert installed.router.spent == 0 and not installed.router.node[2]  # nothing measured or read


def test_a_table_for_another_cu_count_warns_once_and_is_ignored(target, tuned, aiter_calls, plugin_log):
    installed = tuned(row(cu=256, batch=1, backend="flydsl"))
    for batch in (2, 3):
        # Its FlyDSL row is not this GPU's: no table covers the call, and unmeasured it stays stock.
        assert run_batch(target, installed, aiter_calls, batch) == ["gluon"]
        assert last_reason(installed) == NOT_MEASURED
    assert installed.router.table is None
    warnings = [r.getMessage() for r in plugin_log if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "none for this GPU's 1 CUs" in warnings[0]


def test_a_bad_row_is_skipped_and_the_rest_of_the_table_decides(target, tuned, aiter_calls, plugin_log):
    installed = tuned(row(batch=1, backend="gluon"), "gfx950,1,2", row(batch=2, backend="\u0441luon"))
    assert installed.router.table is not None and installed.router.table.skipped == 2
    assert run_batch(target, installed, aiter_calls, 3) == ["gluon"]
    (warning,) = warnings_of(plugin_log)
    assert warning.startswith("vllm-flydsl-indexer: 2 row(s) of ") and "vllm-flydsl-indexer doctor" in warning


def test_a_table_with_no_usable_row_leaves_the_shapes_to_this_nodes_measurement(
    target, tuned, aiter_calls, plugin_log
):
    installed = tuned("gfx950,1,2", row(batch=1, backend="flydsl").replace("gfx950", "gfx950\u200b"))
    assert installed.router.table is None
    # Its unusable FlyDSL row decides nothing: the call is not covered, and unmeasured it stays stock.
    assert run_batch(target, installed, aiter_calls, 3) == ["gluon"]
    assert last_reason(installed) == NOT_MEASURED
    (active,) = [r.getMessage() for r in plugin_log if "ACTIVE" in r.getMessage()]
    assert f"per shape: {UNCOVERED}" in active, active
    (warning,) = warnings_of(plugin_log)
    assert "tuned table ignored" in warning and "2 rows, 2 unusable, none usable for gfx950" in warning


def test_the_table_adds_no_op_to_the_hot_path():
    """With a table loaded the taken call dispatches exactly the ops it does without one."""
    from conftest import OpAudit, Recorder, as_args, base_problem, hooks, router_for

    p = base_problem(heads=32)
    ops = {}
    for name, table in (("none", None), ("tuned", parse(row(batch=1, next_n=2)))):
        router = router_for(Recorder(), hooks_=hooks(buffer=torch.full((6, p.max_model_len), float("nan"))))
        router.table = table
        router.call_from(TARGET_MODULE, *as_args(p))
        audit = OpAudit()
        with audit:
            router.call_from(TARGET_MODULE, *as_args(p))
        assert router.calls_taken == 2
        ops[name] = [n for n, _ in audit.ops]
    assert ops["tuned"] == ops["none"]


TUNE_ARGS = [
    "--heads",
    "32",
    "--block-size",
    "64,1",
    "--next-n",
    "1",
    "--batch",
    "1,2",
    "--repeats",
    "2",
    "--warmup",
    "1",
]


@pytest.mark.slow
def test_reference_tune_run_writes_a_table_the_plugin_reads_back(tmp_path, capsys):
    from vllm_flydsl_indexer.tools import cli

    path = tmp_path / "tuned.csv"
    earlier = row(gfx="gfx950", cu=256, batch=64)
    path.write_text(table_text(earlier, row(gfx="reference", cu=1, batch=1, ctx=1024, backend="gluon")))
    assert cli.main(["tune", "--out", str(path), "--reference", "--device", "cpu", *TUNE_ARGS]) == 0
    out = capsys.readouterr().out
    assert "wrote 4 rows (REFERENCE timings, not kernel timings (gfx=reference))" in out and "kept 1" in out
    lines = path.read_text().splitlines()
    assert lines[0] == HEADER and lines[1] == earlier and len(lines) == 6
    table = tuning.parse(path.read_text(), "reference", str(path))
    assert usable(table) == 4 and table.cu_counts() == {1}
    for kvb in (64, 1):
        for batch in (1, 2):
            backend, bucket = choice(table, 1, batch, 1, 32, 128, kvb)
            assert bucket == batch and backend in ("flydsl", "gluon")
    # The gfx950 rows kept from before are untouched; no GPU arch ever matches the reference rows.
    assert usable(tuning.parse(path.read_text(), "gfx950", str(path))) == 1


def test_tune_refuses_without_a_gfx950_gpu_or_over_a_foreign_csv(tmp_path, monkeypatch, capsys):
    from vllm_flydsl_indexer.tools import cli, tune

    monkeypatch.setattr(tune, "tune_rows", lambda *a, **k: pytest.fail("timed before refusing"))
    path = tmp_path / "tuned.csv"
    with pytest.raises(SystemExit) as refused:
        cli.main(["tune", "--out", str(path), "--device", "cpu", *TUNE_ARGS])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a gfx950 GPU with aiter's Gluon and FlyDSL kernels" in err[0]
    assert err[0].startswith("vllm-flydsl-indexer tune: error: argument --out: ")
    assert not path.exists()
    foreign = tmp_path / "other.csv"
    foreign.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit) as refused:
        cli.main(["tune", "--out", str(foreign), "--reference", "--device", "cpu", *TUNE_ARGS])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an aiter-format tuned CSV" in err[0]
    assert foreign.read_text() == "a,b\n1,2\n"


def test_a_tune_file_is_judged_in_the_readers_order(tmp_path):
    """A header missing a column: not a table. A bad row: not merged into, whatever the header's order.
    A header of every column in another order, with valid rows: not a table."""
    from vllm_flydsl_indexer.tools import cli_args

    good, bad = row(), row(backend="nope")
    reordered = ",".join(reversed(tuning.COLUMNS))
    cases = {
        "missing.csv": (HEADER.replace(",wg_per_cu", "") + "\n" + bad + "\n", "is not an aiter-format"),
        "bad_row.csv": (reordered + "\n" + ",".join(reversed(bad.split(","))) + "\n", "not merging into it"),
        "reordered.csv": (
            reordered + "\n" + ",".join(reversed(good.split(","))) + "\n",
            "is not an aiter-format",
        ),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        table, problem = cli_args.tune_file(str(path))
        assert table is None and problem is not None and expected in problem, (name, problem)
    assert cli_args.tune_file(str(tmp_path / "absent.csv")) == (None, None)


def test_doctor_shows_the_table_and_each_buckets_arm(tmp_path):
    from vllm_flydsl_indexer.tools import doctor

    path = tmp_path / "tuned.csv"
    path.write_text(
        table_text(row(cu=256, batch=64), row(cu=256, batch=1, backend="gluon"), row(gfx="gfx942"))
    )
    data = doctor.report({envs.SWITCH: "1", envs.TUNED_CSV: str(path)})
    table = data["tuned_table"]
    assert table["source"] == str(path) and table["rows"] == 2 and table["gfx"] == "gfx950"
    (shape,) = table["shapes"]
    assert shape["buckets"] == [
        {"batch_at_least": 1, "arm": "stock"},
        {"batch_at_least": 64, "arm": "flydsl", "wg_per_cu": 0},
    ]
    assert "256 CUs, heads=32 head_dim=128 KVB=64 next_n=1: B 1-63: stock, B >=64: flydsl" in doctor.render(
        data
    )
    path.write_text(table_text(row(backend="?")))
    assert doctor.report({envs.SWITCH: "1", envs.TUNED_CSV: str(path)})["tuned_table"]["note"].startswith(
        "IGNORED"
    )


def test_one_row_rule_for_the_plugin_doctor_and_tune(tmp_path, monkeypatch, plugin_log, capsys):
    """A row whose preshuffle disagrees with its kv_block_size, and one with an Arabic-Indic batch, beside
    rows that match calls: the plugin skips them (one WARNING with the count), doctor names each one's line
    and column, tune --out refuses to merge into the table, and doctor never raises."""
    from vllm_flydsl_indexer.tools import cli, doctor, tune

    path = tmp_path / "tuned.csv"
    bad = (cells(row(cu=256), preshuffle=0), row(cu=256, batch="\u0668"))
    path.write_text(table_text(row(cu=256, batch=1), row(cu=256, batch=64), *bad))
    why = "line 4, column preshuffle: '0' with kv_block_size 64: no call can match this row"
    why_digit = "line 5, column batch_size: '\u0668' is not an integer"
    monkeypatch.setenv(envs.TUNED_CSV, str(path))
    table, _ = tuning.load("general", "gfx950", LOGGER)
    assert table is not None and table.skipped == 2 and usable(table) == 2
    (warning,) = warnings_of(plugin_log)
    assert f"2 row(s) of {path} skipped" in warning and "vllm-flydsl-indexer doctor" in warning
    problems = validator.row_problems(str(path))
    assert len(problems) == 2 and problems[0].startswith(f"{path}: {why} (vLLM's calls are preshuffled")
    assert problems[1] == f"{path}: {why_digit}"
    data = doctor.report({envs.SWITCH: "1", envs.TUNED_CSV: str(path)})
    assert data["tuned_table"]["skipped"] == problems
    assert data["tuned_table"]["rows"] == 2 and data["tuned_table"]["note"] == "in use"
    rendered = doctor.render(data)
    assert f"  skipped by the plugin: {path}: {why}" in rendered
    assert f"  skipped by the plugin: {path}: {why_digit}" in rendered
    monkeypatch.setattr(tune, "tune_rows", lambda *a, **k: pytest.fail("timed before refusing"))
    with pytest.raises(SystemExit) as refused:
        cli.main(["tune", "--out", str(path), "--reference", "--device", "cpu", *TUNE_ARGS])
    assert refused.value.code == 2 and why in capsys.readouterr().err


def test_doctor_names_each_row_of_a_table_whose_every_row_is_unusable(tmp_path):
    """Issue 50: the reasons once showed only beside a usable row; the user whose every row is refused,
    who needs them most, got none."""
    from vllm_flydsl_indexer.tools import doctor

    path = tmp_path / "tuned.csv"
    path.write_text(table_text(row(cu=256, wg="three"), row(cu=256, batch="eight")))
    data = doctor.report({envs.SWITCH: "1", envs.TUNED_CSV: str(path)})
    (ignored,) = data["tuned_table"]["ignored"]
    assert ignored["note"].startswith(f"IGNORED: {path}: 2 rows, 2 unusable")
    lines = doctor.render(data).split("\n")
    start = lines.index(f"tuned table: {path}: {ignored['note']}")
    assert lines[start + 1 : start + 3] == [
        f"  skipped by the plugin: {path}: line 2, column wg_per_cu: 'three' is not an integer",
        f"  skipped by the plugin: {path}: line 3, column batch_size: 'eight' is not an integer",
    ]


def test_describe_reports_every_bucket_of_its_own_shape_and_never_raises():
    """doctor's per-shape buckets are the shape's own, whatever rows a table was built from."""
    table = parse(row(cu=256, batch=1, backend="gluon"), row(cu=256, batch=64), row(cu=256, kvb=1, batch=8))
    shapes = {(s["kv_block_size"], s["preshuffle"]): s["buckets"] for s in doctor.describe(table)}
    assert shapes == {
        (64, True): [
            {"batch_at_least": 1, "arm": "stock"},
            {"batch_at_least": 64, "arm": "flydsl", "wg_per_cu": 0},
        ],
        (1, False): [{"batch_at_least": 8, "arm": "flydsl", "wg_per_cu": 0}],
    }
    # A bucket whose FlyDSL rows disagree on the knob is stock, as the router keeps it.
    table = parse(row(cu=256, batch=2, ctx=4096, wg=2), row(cu=256, batch=2, ctx=65536, wg=4))
    assert doctor.describe(table)[0]["buckets"] == [{"batch_at_least": 2, "arm": "stock", "wg_per_cu": 2}]


# ---------------------------------------------------------------- the row's knob reaches the launch


def launched_split_kv(calls) -> list[int]:
    return [kwargs["SplitKV"] for name, kwargs in calls if name == "flydsl-gfx950"]


def test_a_flydsl_rows_wg_per_cu_is_the_launchs_split_kv(target, tuned, aiter_as, aiter_calls, plugin_log):
    """gfx950 simulation (1 CU): SplitKV = max(1, min(pages, ceil(1 * wg_per_cu / batch))), as aiter's
    dispatcher computes it; the default (3) only where no row or a 0 row decided."""
    from vllm_flydsl_indexer import kernels

    aiter_as(flydsl="gfx950")
    installed = tuned(row(batch=1, wg=2), row(batch=4, wg=8), row(batch=16, wg=0))
    assert installed.router.variant.name == "gfx950"
    expected = {1: 2, 2: 1, 4: 2, 7: 2, 9: 1, 16: 1}  # wg 2 at B<4, wg 8 at 4..15, default 3 at >= 16
    for batch, split_kv in expected.items():
        assert run_batch(target, installed, aiter_calls, batch, min_len=640) == ["flydsl-gfx950"], batch
        assert launched_split_kv(aiter_calls) == [split_kv], batch
    # The same rule, written out: the row's wg_per_cu, never the default, decides.
    assert kernels.explicit_split_kv(1, 1, 300, 64, 2) == 2 != kernels.explicit_split_kv(1, 1, 300, 64)
    taken = [r.getMessage() for r in plugin_log if "FlyDSL taken for" in r.getMessage()]
    decided_by = f"; {installed.router.table.name} on gfx950 with 1 CUs; "
    assert len(taken) == 1 and decided_by in taken[0], taken  # one per shape


def test_a_kernel_that_cannot_take_the_rows_knob_keeps_those_calls_stock(
    target, tuned, aiter_calls, plugin_log
):
    """The general kernel is launched without SplitKV: a row measured at wg_per_cu 2 cannot be
    launched as measured, so its bucket stays stock, said once; a 0 row (default launch) is taken."""
    installed = tuned(row(batch=1, wg=2), row(batch=8, wg=0))
    assert installed.router.variant.name == "general"
    for batch in (1, 2, 7):
        assert run_batch(target, installed, aiter_calls, batch) == ["gluon"], batch
    assert run_batch(target, installed, aiter_calls, 8) == ["flydsl"]
    assert aiter_calls == [("flydsl", {**aiter_calls[0][1], "SplitKV": None})]  # no SplitKV passed
    reasons = [r.getMessage() for r in plugin_log if "stock path for this call" in r.getMessage()]
    assert len(reasons) == 1, reasons
    assert "measured FlyDSL with wg_per_cu=2, a SplitKV that the general FlyDSL kernel" in reasons[0]
    taken = [r.getMessage() for r in plugin_log if "FlyDSL taken for" in r.getMessage()]
    assert len(taken) == 1, taken


def test_rows_of_one_bucket_that_disagree_on_the_knob_keep_it_stock(
    target, tuned, aiter_as, aiter_calls, plugin_log
):
    aiter_as(flydsl="gfx950")
    installed = tuned(row(batch=2, ctx=4096, wg=2), row(batch=2, ctx=65536, wg=4), row(batch=4, wg=4))
    assert run_batch(target, installed, aiter_calls, 3) == ["gluon"]
    assert run_batch(target, installed, aiter_calls, 4) == ["flydsl-gfx950"]
    assert launched_split_kv(aiter_calls) == [1]
    reasons = [r.getMessage() for r in plugin_log if "stock path for this call" in r.getMessage()]
    assert len(reasons) == 1 and "its FlyDSL rows disagree on wg_per_cu ([2, 4])" in reasons[0], reasons


def test_aiters_comment_lines_are_skipped_and_line_numbers_stay_true():
    text = "\n".join([HEADER, "# tuned on node 7", row(batch=1), "  # another note", row(batch="x")]) + "\n"
    with pytest.raises(validator.TableError, match=r"t.csv: line 5, column batch_size"):
        validator.read_table(io.StringIO(text), "t.csv")
    table = tuning.parse(
        text, "gfx950", "t.csv"
    )  # the plugin: the comments are not rows, the bad row skipped
    assert usable(table) == 1 and table.skipped == 1
    ok = "\n".join(["# first", HEADER, "# a comment", row(batch=1)]) + "\n"
    assert usable(tuning.parse(ok, "gfx950", "t.csv")) == 1


# ---------------------------------------------------------------- doctor and the loader survive any file


def _directory(path):
    path.mkdir()


def _not_utf8(path):
    path.write_bytes(HEADER.encode() + b"\n\xff\xfe\xfa,1\n")


def _nul_bytes(path):
    path.write_bytes((table_text() + "gfx950,1\x00,2\n").encode())


def _oversize_field(path):
    import csv

    path.write_text(table_text(row(ctx="4096;" * (csv.field_size_limit() // 5 + 1))))


def _empty(path):
    path.write_text("")


def _header_only(path):
    path.write_text(HEADER + "\n")


def _no_permission(path):
    path.write_text(table_text(row()))
    path.chmod(0)


@pytest.mark.parametrize(
    "make",
    [_directory, _not_utf8, _nul_bytes, _oversize_field, _empty, _header_only, _no_permission],
    ids=lambda f: f.__name__.strip("_"),
)
@pytest.mark.slow_except("directory", "not_utf8")
def test_doctor_and_the_loader_survive_any_file(make, tmp_path, monkeypatch, plugin_log, capsys):
    from vllm_flydsl_indexer.tools import doctor

    path = tmp_path / "tuned.csv"
    make(path)
    if make is _no_permission:  # root reads a mode-0 file: refuse the open as the kernel would for a user
        real_open = os.open  # the file layer's (files.read_text)

        def refusing_open(file, *a, **k):
            if str(file) == str(path):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(file, *a, **k)

        monkeypatch.setattr(os, "open", refusing_open)
    data = doctor.report({envs.SWITCH: "1", envs.TUNED_CSV: str(path)})
    note = data["tuned_table"]["note"]
    assert note.startswith(f"IGNORED: {path}: ") and note.endswith("; next source tried"), note
    assert f"tuned table: {path}: IGNORED: " in doctor.render(data)
    monkeypatch.setenv(envs.TUNED_CSV, str(path))
    table, label = tuning.load(data["kernel"]["variant"], "gfx950", LOGGER)
    assert table is None and uncovered_label(label), label
    warnings = warnings_of(plugin_log)
    assert len(warnings) == 1 and warnings[0].startswith("vllm-flydsl-indexer: tuned table ignored: ")
    why = note.removeprefix("IGNORED: ").removesuffix("; next source tried")
    assert (
        warnings[0] == f"vllm-flydsl-indexer: tuned table ignored: {why}; trying the next source"
    )  # one reader


# ---------------------------------------------------------------- tune --out measures and writes the knob


def tune_with_fake_times(monkeypatch, tmp_path, times: dict, extra: tuple[str, ...] = ()):
    """A --reference tune where each candidate's time is ``times[wg_per_cu or "gluon"]``.

    Every candidate still runs for real once (the agreement gate); the SplitKV each FlyDSL
    launch received is recorded. Returns (rows as dicts, the SplitKVs, the CLI's exit status).
    """
    import csv
    import dataclasses

    from vllm_flydsl_indexer.tools import cli, tune

    launched: list[int] = []
    real_launch, real_variant = tune.flydsl_launch, tune.tuned_variant

    def tagged(variant, output_buffer, cus, wg_per_cu):
        run = real_launch(variant, output_buffer, cus, wg_per_cu)
        run.wg_per_cu = wg_per_cu
        return run

    def recording_variant(arms):
        variant = real_variant(arms)

        def fn(*args, **kwargs):
            launched.append(kwargs["SplitKV"])
            return variant.fn(*args, **kwargs)

        return dataclasses.replace(variant, fn=fn)

    monkeypatch.setattr(tune, "flydsl_launch", tagged)
    monkeypatch.setattr(tune, "tuned_variant", recording_variant)
    monkeypatch.setattr(tune, "_time", lambda fn, *a: times[getattr(fn, "wg_per_cu", "gluon")])
    path = tmp_path / "t.csv"
    argv = ["tune", "--out", str(path), "--reference", "--device", "cpu", "--heads", "32"]
    small = ["--block-size", "64", "--next-n", "1", "--batch", "1,4", "--repeats", "1", "--warmup", "0"]
    rc = cli.main([*argv, *small, *extra])
    with open(path, newline="") as f:
        return list(csv.DictReader(f)), launched, rc


@pytest.mark.slow
def test_tune_sweeps_aiters_wg_per_cu_values_and_writes_the_winner(monkeypatch, tmp_path):
    from vllm_flydsl_indexer import kernels

    rows, launched, rc = tune_with_fake_times(
        monkeypatch, tmp_path, {"gluon": 2.0, 1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0}
    )
    assert rc == 0 and len(rows) == 2
    for r, batch in zip(rows, (1, 4), strict=True):
        assert (r["batch_size"], r["context_len"], r["backend"]) == (str(batch), "1024", "flydsl")
        assert (r["ChunkK"], r["WavePerEU"], r["wg_per_cu"]) == ("0", "0", "2")  # as aiter's tuner writes
        assert (float(r["us"]), float(r["gluon_us"]), float(r["flydsl_us"])) == (1.0, 2.0, 1.0)
        # Each of aiter's values was launched exactly as the router launches it (row width 131072).
        swept = {kernels.explicit_split_kv(1, batch, 131072, 64, w) for w in kernels.TUNER_WG_PER_CU}
        assert swept <= set(launched), (swept, launched)
    # The plugin reads the written row back with its knob.
    table = tuning.parse((tmp_path / "t.csv").read_text(), "reference", "t.csv")
    assert table.choice(1, 4, 1, 32, 128, 64) == ("flydsl", 4, 2, None)


@pytest.mark.slow
def test_tune_writes_a_gluon_row_with_stocks_knobs_when_stock_wins(monkeypatch, tmp_path):
    rows, _, rc = tune_with_fake_times(monkeypatch, tmp_path, {"gluon": 1.0, 1: 5.0, 2: 3.0, 3: 4.0, 4: 2.5})
    assert rc == 0
    for r in rows:
        assert (r["backend"], r["ChunkK"], r["WavePerEU"], r["wg_per_cu"]) == ("gluon", "256", "2", "0")
        assert (float(r["us"]), float(r["gluon_us"]), float(r["flydsl_us"])) == (1.0, 1.0, 2.5)


def test_tune_refuses_to_merge_into_a_malformed_table_before_any_work(tmp_path, monkeypatch, capsys):
    from vllm_flydsl_indexer.tools import cli, tune

    path = tmp_path / "t.csv"
    path.write_text(table_text(row(batch=1), row(batch="abc")))
    before = path.read_bytes()
    monkeypatch.setattr(tune, "tune_rows", lambda *a, **k: pytest.fail("timed before refusing"))
    argv = ["tune", "--out", str(path), "--reference", "--device", "cpu", *TUNE_ARGS]
    with pytest.raises(SystemExit) as refused:
        cli.main(argv)
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("vllm-flydsl-indexer tune: error: argument --out: ")
    assert f"{path}: line 3, column batch_size: 'abc' is not an integer" in err[0]
    assert path.read_bytes() == before


def test_tune_replaces_rows_of_the_same_key_and_keeps_the_rest_as_read(tmp_path, capsys):
    """Older tables held one row per context length: the new row replaces all of them."""
    from vllm_flydsl_indexer.tools import cli

    path = tmp_path / "t.csv"
    kept = row(gfx="gfx950", cu=256, batch=64).replace(
        ",1,4096,", ",True,4096,"
    )  # as written, not normalised
    old = [row(gfx="reference", cu=1, batch=1, ctx=ctx, backend="gluon") for ctx in (512, 1024)]
    path.write_text(table_text(kept, *old))
    argv = ["tune", "--out", str(path), "--reference", "--device", "cpu", "--heads", "32", "--batch", "1"]
    small = ["--block-size", "64", "--next-n", "1", "--repeats", "1", "--warmup", "0"]
    assert cli.main([*argv, *small]) == 0
    assert "wrote 1 rows" in capsys.readouterr().out
    lines = path.read_text().splitlines()
    assert lines[:2] == [HEADER, kept] and len(lines) == 3
    assert lines[2].startswith("reference,1,1,1,32,128,64,1,1024,")


# ---------------------------------------------------------------- one table format, read and written

SMALL_TUNE = ["--heads", "32", "--batch", "1", "--block-size", "64", "--next-n", "1", "--repeats", "1"]


def reference_tune(path, *extra: str) -> int:
    from vllm_flydsl_indexer.tools import cli

    argv = ["tune", "--out", str(path), "--reference", "--device", "cpu", *SMALL_TUNE, "--warmup", "0"]
    return cli.main([*argv, *extra])


@pytest.mark.parametrize("bom", [False, True], ids=["plain", "bom"])
@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
@pytest.mark.slow_except("lf-plain")
def test_tune_merges_into_a_copy_of_the_builtin_table_keeping_its_comments(tmp_path, capsys, bom, crlf):
    """The package's own table (``#`` provenance lines first) is a table tune --out merges into,
    whatever a spreadsheet did to it (a byte-order mark, CRLF); it writes LF, comments kept in place."""
    builtin = open(tuning.BUILTIN_PATH, newline="").read()
    assert builtin.startswith("#") and "\r" not in builtin
    text = builtin.replace("\n", "\r\n") if crlf else builtin
    path = tmp_path / "mine.csv"
    path.write_bytes(("\ufeff" if bom else "").encode() + text.encode())
    assert usable(tuning.read(str(path), "gfx950")) == 72  # the plugin reads it
    assert reference_tune(path) == 0, capsys.readouterr().err
    assert "kept 72 earlier rows" in capsys.readouterr().out
    written = path.read_bytes().decode()
    assert "\r" not in written and not written.startswith("\ufeff")
    new_line = written.splitlines()[-1]
    assert new_line.startswith("reference,") and written == builtin + new_line + "\n"
    assert usable(tuning.read(str(path), "gfx950")) == 72


def test_a_comment_between_rows_stays_in_place_and_a_replaced_row_goes(tmp_path, capsys):
    path = tmp_path / "t.csv"
    old = row(gfx="reference", cu=1, batch=1, ctx=1024, backend="gluon")
    lines = [
        "# node 7, 2026-12",
        HEADER,
        row(cu=256, batch=1),
        "  # tuned again below",
        old,
        row(cu=256, batch=8),
    ]
    path.write_text("\n".join(lines) + "\n")
    assert reference_tune(path) == 0, capsys.readouterr().err
    got = path.read_text().splitlines()
    assert got[:4] == lines[:4] and got[4] == lines[5] and got[5].startswith("reference,1,1,1,32,128,64,1,")
    assert len(got) == 6


def test_bench_csv_and_tune_tables_have_lf_line_endings(tmp_path, capsys):
    from vllm_flydsl_indexer.tools import cli

    out = tmp_path / "out.csv"
    argv = ["bench", "--device", "cpu", "--reference", *SMALL_TUNE, "--context-len", "64", "--warmup", "0"]
    assert cli.main([*argv, "--csv", str(out)]) == 0
    assert b"\r" not in out.read_bytes() and out.read_bytes().count(b"\n") >= 2
    table = tmp_path / "t.csv"
    assert reference_tune(table) == 0
    assert b"\r" not in table.read_bytes() and table.read_bytes().count(b"\n") == 2


def test_a_bom_in_a_table_or_a_config_json_is_not_text(tmp_path):
    from vllm_flydsl_indexer.tools import reach

    path = tmp_path / "t.csv"
    path.write_bytes(b"\xef\xbb\xbf" + table_text(row()).encode())
    assert usable(tuning.read(str(path), "gfx950")) == 1  # the plugin's reader
    assert len(validator.read_rows(io.StringIO(path.read_text(encoding="utf-8-sig")), "t.csv")) == 1
    assert usable(validator.read(str(path), "gfx950")) == 1  # the validator's
    (tmp_path / "config.json").write_bytes(b"\xef\xbb\xbf" + b'{"model_type": "glm_moe_dsa"}')
    assert reach.resolve(str(tmp_path)) == ("glm_moe_dsa", {"model_type": "glm_moe_dsa"})


@pytest.mark.parametrize(
    ("make", "line"),
    [
        (lambda: table_text(row(ctx="4096;" * 40000)), "line 2: field larger than field limit"),
        (lambda: "\x00" * 4096, "line 1: missing column(s) gfx"),
        (lambda: "# c\n\n" + "\x00" * 64 + "\n", "line 3: missing column(s) gfx"),
        (
            lambda: table_text(row().replace(",flydsl,", ',"flydsl,'), *[row(batch=b) for b in range(2, 80)]),
            "line 2 (a quoted field runs to line 80), ",
        ),
        (lambda: table_text(row(), row(batch=2), row(batch="x")), "line 4, column batch_size"),
        (
            lambda: HEADER + "\n" + row() + "\n" + row(batch=2).replace("gfx950", "gfx\udcff950") + "\n",
            "line 3: not UTF-8",
        ),
    ],
    ids=["huge-field", "nul-file", "nul-after-comments", "unclosed-quote", "bad-cell", "not-utf8"],
)
def test_every_table_error_names_the_line_it_starts_on(tmp_path, make, line):
    path = tmp_path / "t.csv"
    path.write_bytes(make().encode("utf-8", "surrogateescape"))
    with pytest.raises(validator.TableError) as refused:
        validator.read(str(path), "gfx950")
    assert str(refused.value).startswith(f"{path}: {line}"), str(refused.value)
