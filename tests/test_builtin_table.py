# SPDX-License-Identifier: Apache-2.0
"""The built-in tuned table: aiter's published MI355X measurements, for the gfx950 kernel only.

The CU count is a host-side property; these tests stub it to the table's 256 so the simulated
gfx950 GPU is the one AMD measured on. Every call goes through vLLM's real
``rocm_fp8_paged_mqa_logits`` from its defining module, and each patched result is compared with
stock's on the same fresh problem (``run_batch``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from test_tuning import (
    NOT_MEASURED,
    UNCOVERED,
    batch_problem,
    last_reason,
    row,
    run_batch,
    run_problem,
    table_text,
    uncovered_label,
)
from vllm_flydsl_indexer import envs, kernels, patch, tuning
from vllm_flydsl_indexer.kernels import explicit_split_kv
from vllm_flydsl_indexer.tools import tuned as validator

ROOT = Path(__file__).resolve().parents[1]
BUILTIN_CSV = Path(tuning.BUILTIN_PATH)
BUILTIN_CHECKSUM = BUILTIN_CSV.with_name(BUILTIN_CSV.name + ".sha256")
REVISION = "39029932"
# The data rows of aiter's table at 39029932, read side by side (tests/test_builtin_table.py pins them).
SOURCE_ROWS = 72


def builtin_rows() -> list[dict[str, str]]:
    lines = [line for line in BUILTIN_CSV.read_text().splitlines(keepends=True) if not line.startswith("#")]
    return list(csv.DictReader(lines))


def test_the_builtin_table_is_aiters_rows_unchanged_with_its_provenance():
    text = BUILTIN_CSV.read_text()
    comments = [line for line in text.splitlines() if line.startswith("#")]
    data = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))
    checksum = BUILTIN_CHECKSUM.read_text().strip()
    assert hashlib.sha256(data.encode()).hexdigest() == checksum
    header = "\n".join(comments)
    assert REVISION in header and "MI355X" in header and "AMD's measurements" in header
    assert REVISION in tuning.BUILTIN_LABEL and "aiter/configs/paged_mqa_logits_tuned.csv" in header
    # The validator reads it whole: every row valid, all of gfx950 and 256 CUs.
    assert validator.row_problems(str(BUILTIN_CSV)) == []
    assert len(validator.read_rows(open(BUILTIN_CSV, newline=""), str(BUILTIN_CSV))) == SOURCE_ROWS
    # The plugin's reader (its ``#`` provenance lines first) skips none of them.
    table = tuning.read(str(BUILTIN_CSV), "gfx950", "built-in")
    assert isinstance(table, tuning.TunedTable), table
    assert table.skipped == 0 and table.cu_counts() == {256}
    assert sum(len(rows) for buckets in table.shapes.values() for rows in buckets.values()) == SOURCE_ROWS


def test_the_plugins_reader_picks_every_builtin_row_as_amd_measured_it():
    """Each of the 72 rows is its own bucket: the lookup gives its backend and wg_per_cu, at its batch and
    up to the next tuned batch (the picks the strict reader gave before the lenient one)."""
    table = tuning.read(str(BUILTIN_CSV), "gfx950", "built-in")
    rows = builtin_rows()
    batches = sorted({int(r["batch_size"]) for r in rows})
    for r in rows:
        batch, next_n = int(r["batch_size"]), int(r["next_n"])
        wg = int(r["wg_per_cu"]) if r["backend"] == "flydsl" else 0
        assert table.choice(256, batch, next_n, 32, 128, 64) == (r["backend"], batch, wg, None), r
        above = [b for b in batches if b > batch]
        last = above[0] - 1 if above else batch * 4
        assert table.choice(256, last, next_n, 32, 128, 64) == (r["backend"], batch, wg, None), r
    assert table.choice(256, 1, 9, 32, 128, 64) is None  # next_n 9: not measured
    assert table.choice(256, 8, 1, 64, 128, 64) is None  # 64 heads: not measured
    assert table.choice(304, 8, 1, 32, 128, 64) is None  # another CU count
    assert {r["backend"] for r in rows} == {"flydsl", "gluon"}


@pytest.mark.slow
def test_the_builtin_table_is_in_the_wheel(tmp_path):
    """``pip install .`` (a wheel), not only an editable install, carries the table and its checksum."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("vllm_flydsl_indexer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for resource in (BUILTIN_CSV.name, BUILTIN_CHECKSUM.name):
        assert f"vllm_flydsl_indexer/data/{resource}" in names, names


@pytest.fixture
def gfx950_at(target, workspace, aiter_as, monkeypatch, fresh_register, plugin_log, tmp_path):
    """Register on the simulated gfx950 GPU of ``cus`` CUs with aiter's ``flydsl`` kernel found. ``tune``:
    ``VLLM_FLYDSL_INDEXER_TUNE`` (``None``: unset, the default, on); off unless asked, so that shapes no table
    covers stay stock deterministically (tests/test_measure.py times them). This node's cache: the test's."""

    def install(flydsl: str = "gfx950", cus: int = 256, tuned_csv: str | None = None, tune: str | None = "0"):
        aiter_as(flydsl=flydsl)
        monkeypatch.setattr(kernels, "_cu_count", lambda device_type, index: cus)
        monkeypatch.setenv(envs.SWITCH, "1")
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
        if tune is None:
            monkeypatch.delenv(envs.TUNE, raising=False)
        else:
            monkeypatch.setenv(envs.TUNE, tune)
        if tuned_csv is None:
            monkeypatch.delenv(envs.TUNED_CSV, raising=False)
        else:
            monkeypatch.setenv(envs.TUNED_CSV, tuned_csv)
        fresh_register()
        installed = patch.installed()
        assert installed is not None, [r.getMessage() for r in plugin_log]
        assert installed.router.variant.name == flydsl
        return installed

    return install


def test_the_arch_a_real_mi355x_reports_gets_the_builtin_table(target, gfx950_at, monkeypatch, plugin_log):
    """vLLM reports ``gfx950:sramecc+:xnack-`` on an MI355X; the table's rows say ``gfx950``."""
    import vllm.platforms.rocm as rocm

    monkeypatch.setattr(rocm, "_GCN_ARCH", "gfx950:sramecc+:xnack-")
    installed = gfx950_at()
    assert installed.router.table is not None and installed.router.table.origin == "built-in"
    assert installed.router.table.gfx == tuning.arch_of(rocm._GCN_ARCH) == "gfx950"
    (line,) = [r.getMessage() for r in plugin_log]
    assert "ACTIVE" in line and "per shape: built-in table (aiter 39029932" in line, line


def split_kv(batch: int, max_model_len: int, wg_per_cu: int) -> int:
    return explicit_split_kv(256, batch, max_model_len, 64, wg_per_cu)


def test_builtin_table_routes_each_batch_as_amd_measured(target, gfx950_at, aiter_calls, plugin_log):
    installed = gfx950_at(tune=None)  # the measurement on, as by default: a covered shape is never timed
    assert installed.router.table.origin == "built-in"
    active = [r.getMessage() for r in plugin_log if "ACTIVE" in r.getMessage()]
    assert len(active) == 1 and "per shape: built-in table (aiter 39029932" in active[0], active

    # Batch 1, next_n 1: AMD measured Gluon faster (3.80 us against 4.68 us): stock, naming the table.
    assert run_batch(target, installed, aiter_calls, 1) == ["gluon"]
    reasons = [r.getMessage() for r in plugin_log if "stock path for this call" in r.getMessage()]
    where = "built-in table (aiter 39029932, AMD's MI355X measurements) on gfx950 with 256 CUs"
    assert reasons == [
        f"vllm-flydsl-indexer: stock path for this call: {where} measured stock (Gluon) faster at batch 1 "
        "of heads=32 head_dim=128 KVBlockSize=64 next_n=1"
    ], reasons

    # Batch 64, next_n 1: FlyDSL with wg_per_cu 3; batch 100 follows the batch-64 row.
    for batch in (64, 100):
        assert launched(target, installed, aiter_calls, batch, 1, wg_per_cu=3, other=2)

    # Batch 256, next_n 8: FlyDSL with wg_per_cu 2.
    assert launched(target, installed, aiter_calls, 256, 8, wg_per_cu=2, other=3)

    # Batch 16, next_n 8: Gluon measured faster.
    assert run_batch(target, installed, aiter_calls, 16, next_n=8) == ["gluon"]
    assert last_reason(installed) == (
        f"{where} measured stock (Gluon) faster at batch 16 of heads=32 head_dim=128 KVBlockSize=64 next_n=8"
    )
    # Every call was covered: the table decided each, this node measured none and cached nothing.
    assert installed.router.node is None and installed.router.spent == 0
    taken = [r.getMessage() for r in plugin_log if "FlyDSL taken for" in r.getMessage()]
    assert len(taken) == 2 and all(f"; {where}; " in m for m in taken), taken  # next_n 1 and 8


def launched(target, installed, calls, batch, next_n, wg_per_cu, other) -> bool:
    """The call took FlyDSL with the SplitKV of ``wg_per_cu``, which differs from ``other``'s here."""
    p = batch_problem(batch, next_n, min_len=600 if next_n == 1 else 150)
    arms = run_problem(target, installed, calls, p)
    assert arms == ["flydsl-gfx950"], arms
    (_, kwargs), *_ = calls
    expected = split_kv(batch, p.max_model_len, wg_per_cu)
    assert expected != split_kv(batch, p.max_model_len, other), "the problem cannot tell the knobs apart"
    return kwargs["SplitKV"] == expected


def test_other_kernels_get_no_builtin_table(target, gfx950_at, aiter_calls, plugin_log):
    """Measured on the gfx950 kernel only: elsewhere this node's measurement decides, else stock (never
    FlyDSL blind), and the log says so. With the measurement off, batch 1 (Gluon in the built-in table too)
    and batch 64 (FlyDSL there) both stay stock: the built-in rows decide nothing for this kernel."""
    installed = gfx950_at(flydsl="general")
    assert installed.router.table is None and installed.router.tune is False
    active = [r.getMessage() for r in plugin_log if "ACTIVE" in r.getMessage()]
    assert len(active) == 1 and f"per shape: {UNCOVERED}" in active[0], active
    assert "(vllm-flydsl-indexer tune)" in active[0]
    for batch in (1, 64):
        assert run_batch(target, installed, aiter_calls, batch) == ["gluon"], batch
        assert last_reason(installed) == NOT_MEASURED, batch


@pytest.mark.parametrize("value", ["None", " none ", "OFF", "0", "false", "\tFalse\n"])
def test_none_and_its_spellings_turn_every_table_off(target, gfx950_at, aiter_calls, plugin_log, value):
    installed = gfx950_at(tuned_csv=value)
    assert installed.router.table is None
    assert run_batch(target, installed, aiter_calls, 1) == ["flydsl-gfx950"]
    active = [r.getMessage() for r in plugin_log if "ACTIVE" in r.getMessage()]
    assert f"({envs.TUNED_CSV}={value.strip().lower()}): FlyDSL wherever eligible" in active[0]
    assert not [r for r in plugin_log if r.levelno >= logging.WARNING]


def test_a_path_with_whitespace_around_it_names_the_file(
    target, gfx950_at, aiter_calls, plugin_log, tmp_path
):
    path = tmp_path / "mine.csv"
    path.write_text(table_text(row(cu=256, batch=1, next_n=1, backend="flydsl", wg=1)))
    installed = gfx950_at(tuned_csv=f"  {path}\n")
    assert installed.router.table.origin == "env" and installed.router.table.name == str(path)
    assert not [r for r in plugin_log if r.levelno >= logging.WARNING]
    assert run_batch(target, installed, aiter_calls, 1) == ["flydsl-gfx950"]  # the built-in table: Gluon


def test_an_explicit_table_replaces_the_builtin_one_never_merged(target, gfx950_at, aiter_calls, tmp_path):
    path = tmp_path / "mine.csv"
    # Mine: FlyDSL at batch 1, next_n 1 (the built-in table says Gluon there); nothing for next_n 2.
    path.write_text(table_text(row(cu=256, batch=1, next_n=1, backend="flydsl", wg=1)))
    installed = gfx950_at(tuned_csv=str(path))
    assert installed.router.table.origin == "env" and installed.router.table.name == str(path)
    assert run_batch(target, installed, aiter_calls, 1) == ["flydsl-gfx950"]
    # Next_n 2: mine does not cover it, so this node's measurement decides (off here: stock, for that
    # reason), never the built-in table's rows: Gluon at batch 4, FlyDSL at batch 256.
    for batch in (4, 256):
        assert run_batch(target, installed, aiter_calls, batch, next_n=2) == ["gluon"], batch
        assert last_reason(installed) == NOT_MEASURED, batch


@pytest.mark.parametrize("bad", ["bad row", "fullwidth batch", "absent", "no rows for gfx950"])
def test_a_bad_explicit_table_falls_back_to_the_next_source_with_one_warning(
    target, gfx950_at, aiter_calls, plugin_log, tmp_path, bad
):
    """An explicit table with no usable row is not merged: the next source decides (here the built-in
    table, which sends batch 1 to Gluon), and one WARNING names the file and says the next is tried."""
    path = tmp_path / "bad.csv"
    if bad == "bad row":
        path.write_text(table_text(row(cu=256, batch=1, backend="nope")))
    elif bad == "fullwidth batch":
        path.write_text(table_text(row(cu=256, batch="\uff11", backend="flydsl")))
    elif bad == "no rows for gfx950":
        path.write_text(table_text(row(gfx="gfx942", cu=256, batch=1)))
    installed = gfx950_at(tuned_csv=str(path))
    assert installed.router.table.origin == "built-in"
    assert run_batch(target, installed, aiter_calls, 1) == ["gluon"]
    warnings = [r.getMessage() for r in plugin_log if r.levelno == logging.WARNING]
    (warning,) = warnings
    assert warning.startswith(f"vllm-flydsl-indexer: tuned table ignored: {path}: ") and warning.endswith(
        "; trying the next source"
    ), warning
    active = [r.getMessage() for r in plugin_log if "ACTIVE" in r.getMessage()]
    assert f"per shape: {tuning.BUILTIN_LABEL}" in active[0], active


def test_another_cu_count_drops_the_builtin_table_with_one_info(target, gfx950_at, aiter_calls, plugin_log):
    """The built-in rows are for 256 CUs: on 304 they cover nothing, so this node's measurement decides
    (off here: stock), and the table is dropped with one INFO, not a WARNING."""
    installed = gfx950_at(cus=304)
    for batch in (1, 64):  # the built-in table: Gluon at batch 1, FlyDSL at 64
        assert run_batch(target, installed, aiter_calls, batch) == ["gluon"], batch
        assert last_reason(installed) == NOT_MEASURED, batch
    assert installed.router.table is None
    dropped = [r for r in plugin_log if "none for this GPU's 304 CUs" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelno == logging.INFO
    assert "built-in table" in dropped[0].getMessage()


def test_precedence_variable_then_builtin_then_none():
    """No table aiter ships is read any more (issue 44): the variable's, then the built-in one for its
    kernel, then none (this node's measurement, else stock); an off value leaves no table at all."""

    def origins(env, variant):
        return [(path, origin) for path, origin, _ in tuning.sources(env, variant)]

    builtin = (tuning.BUILTIN_PATH, "built-in")
    assert origins("/mine.csv", "gfx950") == [("/mine.csv", "env"), builtin, (None, "none")]
    assert origins(" /mine.csv\t", "general") == [("/mine.csv", "env"), (None, "none")]
    for off in tuning.OFF_VALUES:
        assert origins(f" {off.upper()} ", "gfx950") == [(None, "off")]
    assert origins(None, "gfx950") == origins("", "gfx950") == [builtin, (None, "none")]
    for variant in ("general", "dispatcher", None):
        assert origins(None, variant) == [(None, "none")]
        (label,) = [label for _, origin, label in tuning.sources(None, variant) if origin == "none"]
        assert uncovered_label(label), label
    (_, _, off), *_ = tuning.sources("off", "gfx950")
    assert off == f"no tuned table ({envs.TUNED_CSV}=off): FlyDSL wherever eligible"


def test_a_gfx_cell_with_target_features_matches_its_arch():
    """torch reports ``gfx950:sramecc+:xnack-``; such a row is a gfx950 row."""
    text = table_text(row(gfx="gfx950:sramecc+:xnack-", cu=256, batch=8, backend="gluon"))
    table = tuning.parse(text, "gfx950", "t.csv")
    assert table.skipped == 0 and table.choice(256, 8, 1, 32, 128, 64) == ("gluon", 8, 0, None)
    assert validator.read_rows(io.StringIO(text), "t.csv")[0].gfx == "gfx950"


def doctor_json(**env: str) -> dict:
    import json

    from conftest import simulation_env

    proc = subprocess.run(
        [sys.executable, "-m", "vllm_flydsl_indexer", "doctor", "--json"],
        env=simulation_env(**{envs.SWITCH: "1", **env}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_doctor_reports_the_builtin_table_and_its_arm_for_all_72_rows():
    data = doctor_json(AITER_DOUBLE_FLYDSL="gfx950")
    table = data["tuned_table"]
    assert table["origin"] == "built-in" and table["source"] == tuning.BUILTIN_LABEL
    assert "no GPU here" in table["applies"] and "256" in table["applies"]
    assert "per shape: built-in table (aiter 39029932" in data["log_line"]
    arms = {
        (shape["cu_num"], shape["next_n"], bucket["batch_at_least"]): bucket["arm"]
        for shape in table["shapes"]
        for bucket in shape["buckets"]
    }
    expected = {
        (int(r["cu_num"]), int(r["next_n"]), int(r["batch_size"])): "flydsl"
        if r["backend"] == "flydsl"
        else "stock"
        for r in builtin_rows()
    }
    assert len(expected) == SOURCE_ROWS and arms == expected


@pytest.mark.parametrize(
    ("flydsl", "variable", "origin", "words"),
    [
        ("general", None, "none", UNCOVERED),
        ("gfx950", "none", "off", f"({envs.TUNED_CSV}=none)"),
    ],
)
def test_doctor_names_why_no_table_is_in_use(aiter_as, monkeypatch, flydsl, variable, origin, words):
    from vllm_flydsl_indexer.tools import doctor

    aiter_as(flydsl=flydsl)
    environ = {
        envs.SWITCH: "1",
        "VLLM_ROCM_USE_AITER": "1",
        **({envs.TUNED_CSV: variable} if variable else {}),
    }
    data = doctor.report(environ)
    assert data["kernel"]["variant"] == flydsl and data["arm"] == "flydsl"
    table = data["tuned_table"]
    assert table["origin"] == origin and table["source"] is None and words in table["note"]
    assert words in data["log_line"] and words in doctor.render(data)
    if origin == "none":
        assert uncovered_label(table["note"]) and "(vllm-flydsl-indexer tune)" in table["note"]


@pytest.mark.slow
def test_the_committed_routing_result_is_what_this_code_routes(tmp_path):
    """benchmarks/table_routing.py replayed now equals its committed result, which beats both policies."""
    import json

    from conftest import simulation_env

    committed = json.loads(
        (ROOT / "benchmarks/results/2026-12-05-table-routing/builtin_table_routing.json").read_text()
    )
    out = tmp_path / "now.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "table_routing.py"), "--json", str(out)],
        env=simulation_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    now = json.loads(out.read_text())
    assert now == committed
    summary = now["summary"]
    assert summary["router+table"]["geomean"] >= 1.03 and summary["router+table"]["worst"] >= 1.0
    assert summary["flydsl-everywhere"]["geomean"] == pytest.approx(0.959, abs=5e-4)
    assert summary["stock"]["geomean"] == 1.0
    # The router with the table takes FlyDSL exactly where AMD's row says flydsl.
    assert all((s["router+table"]["arm"] == "flydsl") == (s["backend"] == "flydsl") for s in now["shapes"])
    assert all(s["flydsl-everywhere"]["arm"] == "flydsl" for s in now["shapes"])


def test_the_readmes_speed_grid_and_summary_are_the_builtin_tables():
    import json
    import re

    readme = (ROOT / "README.md").read_text()
    grid = {}
    header = re.search(r"^\| next_n \\\\? batch \|(.*)\|$", readme, re.M)
    assert header, "the README's speed grid is missing"
    batches = [int(b) for b in header.group(1).split("|")]
    for line in re.findall(r"^\| (\d) \|(.*)\|$", readme, re.M):
        next_n, cells = int(line[0]), [c.strip() for c in line[1].split("|")]
        for batch, cell in zip(batches, cells, strict=True):
            grid[(next_n, batch)] = cell
    expected = {}
    for r in builtin_rows():
        ratio = float(r["gluon_us"]) / float(r["flydsl_us"])
        text = f"{ratio:.2f}"
        expected[(int(r["next_n"]), int(r["batch_size"]))] = f"**{text}**" if ratio > 1 else text
    assert grid == expected
    summary = json.loads(
        (ROOT / "benchmarks/results/2026-12-05-table-routing/builtin_table_routing.json").read_text()
    )["summary"]
    assert f"{summary['router+table']['geomean']:.3f}x of Gluon's speed" in readme
    assert f"would give {summary['flydsl-everywhere']['geomean']:.3f}x" in readme
    assert (
        f"FlyDSL only where AMD measured it faster ({summary['router+table']['flydsl_shapes']} of the 72"
        in readme
    )


@pytest.mark.slow
def test_doctor_shows_the_bad_explicit_table_and_the_source_used_instead(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text(table_text(row(cu=256, batch=1, backend="nope")))
    data = doctor_json(AITER_DOUBLE_FLYDSL="gfx950", **{envs.TUNED_CSV: f" {bad} "})
    table = data["tuned_table"]
    assert table["origin"] == "built-in" and table["rows"] == SOURCE_ROWS
    (ignored,) = table["ignored"]
    assert ignored["source"] == str(bad) and ignored["origin"] == "env"
    assert ignored["note"] == f"IGNORED: {bad}: 1 rows, 1 unusable, none usable for gfx950; next source tried"
    assert "per shape: built-in table (aiter 39029932" in data["log_line"]
    off = doctor_json(AITER_DOUBLE_FLYDSL="gfx950", **{envs.TUNED_CSV: " Off "})["tuned_table"]
    assert off["origin"] == "off" and off["source"] is None and not off["ignored"]


@pytest.mark.slow
def test_doctor_off_rocm_calls_a_valid_table_valid(tmp_path):
    """No ROCm arch here: a valid table has no row for this machine, and doctor says so."""
    from conftest import simulation_env

    path = tmp_path / "mine.csv"
    path.write_text(table_text(row(cu=256, batch=1), row(cu=256, batch=8)))
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_flydsl_indexer", "doctor"],
        env=simulation_env(rocm=False, **{envs.SWITCH: "1", envs.TUNED_CSV: str(path)}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(f"tuned table: {path}")]
    assert f"IGNORED: {path}: 2 rows, 0 unusable, none usable for this machine (no ROCm arch)" in line, line
