# SPDX-License-Identifier: Apache-2.0
"""Writers that share a file keep every row (issue 45): ``tune --out`` merges a table, and ``tune --model``
fills the node cache, under one lock (``outputs.locked``)."""

from __future__ import annotations

import os
import threading
import time
from argparse import Namespace
from pathlib import Path

import pytest

from vllm_flydsl_indexer import tuning
from vllm_flydsl_indexer.tools import outputs, tune
from vllm_flydsl_indexer.tools.arms import GLUON_KNOBS


def measured_row(batch: int) -> dict[str, object]:
    """A reference row as ``tune_rows`` writes it, for batch size ``batch``."""
    values = ("reference", 1, batch, 1, 32, 128, 64, 1, "1024", "gluon", GLUON_KNOBS["ChunkK"])
    values += (GLUON_KNOBS["WavePerEU"], 0, 10.0 + batch, 10.0 + batch, "")
    return dict(zip(tuning.COLUMNS, values, strict=True))


def test_three_tunes_at_once_into_one_table_keep_all_three_rows(tmp_path, monkeypatch, capsys):
    """Each run measures while the others do, then merges: every row survives (no lost update)."""
    table = tmp_path / "t.csv"
    batches = (1, 4, 16)
    measuring = threading.Barrier(len(batches), timeout=60)

    def rows(args, *rest, **kw):
        measuring.wait()  # all three have started (and read the table) before any merges
        return [measured_row(args.batch[0])]

    real_text = tune.table_text

    def slow_text(*a, **k):
        time.sleep(0.2)  # between reading the table and replacing it: where an unlocked merge loses rows
        return real_text(*a, **k)

    monkeypatch.setattr(tune, "tune_rows", rows)
    monkeypatch.setattr(tune, "table_text", slow_text)
    statuses = {}

    def run(batch):
        args = Namespace(command="tune", device="cpu", reference=True, tune_path=str(table), json_path=None)
        args.batch = (batch,)
        statuses[batch] = tune.main(args)

    threads = [threading.Thread(target=run, args=(b,)) for b in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert statuses == dict.fromkeys(batches, 0), capsys.readouterr()
    lines = table.read_text().splitlines()
    assert lines[0] == ",".join(tuning.COLUMNS)
    assert sorted(int(line.split(",")[2]) for line in lines[1:]) == sorted(batches)
    kept = sorted(int(line.rsplit("kept ", 1)[1].split()[0]) for line in capsys.readouterr().out.splitlines())
    assert kept == [0, 1, 2]  # each merge saw the rows the earlier ones wrote


def test_the_lock_excludes_a_second_holder_until_the_first_is_done(tmp_path):
    path = str(tmp_path / "t.csv")
    order = []
    first_in = threading.Event()

    def second():
        first_in.wait(10)
        with outputs.locked(path):
            order.append("second")

    thread = threading.Thread(target=second)
    thread.start()
    with outputs.locked(path):
        first_in.set()
        time.sleep(0.3)
        order.append("first")
    thread.join(10)
    assert order == ["first", "second"]
    assert outputs.lock_path(path) == str(tmp_path / ".t.csv.lock")


def test_a_wait_for_the_lock_is_said_once_and_a_free_lock_says_nothing(tmp_path, capsys):
    path = str(tmp_path / f"{os.urandom(4).hex()}.csv")
    said = f"waiting {os.urandom(4).hex()}"
    with outputs.locked(path, said):
        pass
    assert capsys.readouterr().err == ""
    held, done = threading.Event(), threading.Event()

    def holder():
        with outputs.locked(path):
            held.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    threading.Timer(0.3, done.set).start()
    with outputs.locked(path, said):
        assert done.is_set()  # entered only once the holder let go
    thread.join(10)
    assert capsys.readouterr().err == f"{said}\n"


def test_a_table_that_turned_bad_during_the_run_is_not_overwritten_and_the_rows_are_printed(tmp_path, capsys):
    table = tmp_path / "t.csv"
    table.write_text("not,a,table\n")
    kept, line = tune.merge(str(table), [measured_row(4)])
    assert kept is None and "not an aiter-format tuned CSV" in line
    assert table.read_text() == "not,a,table\n"
    out = capsys.readouterr().out
    assert "\nreference,1,4,1,32,128,64,1,1024,gluon," in out


@pytest.mark.parametrize("link", [False, True])
def test_links_to_one_table_share_one_lock(tmp_path, link):
    table = tmp_path / "t.csv"
    table.touch()
    name = tmp_path / "alias.csv"
    if link:
        name.symlink_to(table)
        assert outputs.lock_path(str(name)) == outputs.lock_path(str(table))
    else:
        assert outputs.lock_path(str(name)) != outputs.lock_path(str(table))


# ---------------------------------------------------------------- outputs checked for what they are


@pytest.fixture
def bench_reached(monkeypatch):
    """bench and tune replaced: records the arguments that reached them (no work is done)."""
    from vllm_flydsl_indexer.tools import bench

    reached = []
    monkeypatch.setattr(bench, "main", lambda args: reached.append(args) or 0)
    monkeypatch.setattr(tune, "main", lambda args: reached.append(args) or 0)
    return reached


def refused(argv, capsys) -> str:
    from vllm_flydsl_indexer.tools import cli as cli_mod

    with pytest.raises(SystemExit) as exit_info:
        cli_mod.main(argv)
    out = capsys.readouterr()
    assert exit_info.value.code == 2, out
    lines = out.err.splitlines()
    assert len(lines) == 1 and out.out == "", out
    return lines[0]


BENCH = ["bench", "--device", "cpu"]


@pytest.mark.parametrize(
    ("flag", "path", "says"),
    [
        ("--json", "/proc/version", "is under /proc, a kernel interface"),
        ("--json", "/sys/kernel/profiling", "is under /sys, a kernel interface"),
    ],
)
def test_outputs_under_proc_or_sys_are_refused_before_any_work(flag, path, says, bench_reached, capsys):
    line = refused([*BENCH, flag, path], capsys)
    assert line.startswith(f"vllm-flydsl-indexer bench: error: argument {flag}: {path} ") and says in line
    assert bench_reached == []


def test_a_trailing_slash_where_no_directory_exists_is_refused(tmp_path, bench_reached, capsys):
    out = tmp_path / "out"
    line = refused([*BENCH, "--json", f"{out}/"], capsys)
    assert f"argument --json: {out}/ ends in '/' but there is no such directory" in line
    assert not out.exists() and bench_reached == []


def test_the_installed_packages_own_files_are_refused(bench_reached, capsys):
    import vllm_flydsl_indexer

    package = Path(vllm_flydsl_indexer.__file__).resolve().parent
    table = package / "data" / "paged_mqa_logits_tuned.csv"
    before = table.read_bytes()
    for flag in ("--csv", "--json"):
        line = refused([*BENCH, flag, str(table)], capsys)
        assert f"argument {flag}: {table} is a file of the installed vllm_flydsl_indexer package" in line
    line = refused([*BENCH, "--tune", str(table), "--reference"], capsys)
    assert "argument --tune: " in line and "installed vllm_flydsl_indexer package" in line
    line = refused(["tune", "--out", str(table), "--reference"], capsys)
    assert line.startswith("vllm-flydsl-indexer tune: error: argument --out: ")
    assert "installed vllm_flydsl_indexer package" in line
    line = refused([*BENCH, "--json", str(package / "new.json")], capsys)
    assert "installed vllm_flydsl_indexer package" in line
    assert table.read_bytes() == before and not (package / "new.json").exists()
    assert bench_reached == []


def test_the_table_the_plugin_reads_is_refused_but_tune_merges_into_it(
    tmp_path, monkeypatch, bench_reached, capsys
):
    table = tmp_path / "mine.csv"
    table.write_text(",".join(tuning.COLUMNS) + "\n")
    monkeypatch.setenv(outputs.TUNED_CSV_VARIABLE, str(table))
    line = refused([*BENCH, "--csv", str(table)], capsys)
    assert f"argument --csv: {table} is the tuned table {outputs.TUNED_CSV_VARIABLE} names" in line
    link = tmp_path / "link.json"
    link.symlink_to(table)
    assert "is the tuned table" in refused([*BENCH, "--json", str(link)], capsys)
    assert bench_reached == []
    from vllm_flydsl_indexer.tools import cli as cli_mod

    assert cli_mod.main([*BENCH, "--tune", str(table), "--reference"]) == 0
    assert cli_mod.main(["tune", "--out", str(link), "--reference"]) == 0
    assert [(a.command, a.tune_path) for a in bench_reached] == [("bench", str(table)), ("tune", str(link))]


@pytest.mark.parametrize(
    ("option", "value", "bound"),
    [("--input-sets", "100000000", "from 1 to 64"), ("--repeats", "10" * 8, "from 1 to 100000")]
    + [("--warmup", "99999999", "from 0 to 10000"), ("--input-sets", "0", "from 1 to 64")],
)
def test_every_count_option_has_an_upper_bound_and_says_it(option, value, bound, bench_reached, capsys):
    line = refused([*BENCH, option, value], capsys)
    assert line.startswith(f"vllm-flydsl-indexer bench: error: argument {option}: must be an integer {bound}")
    assert line.endswith(f"got '{value}'")
    assert bench_reached == []


def test_the_largest_counts_are_accepted(bench_reached):
    from vllm_flydsl_indexer.tools import cli as cli_mod

    argv = [*BENCH, "--input-sets", "64", "--repeats", "100000", "--warmup", "10000"]
    assert cli_mod.main(argv) == 0
    assert (bench_reached[0].input_sets, bench_reached[0].repeats, bench_reached[0].warmup) == (
        64,
        100000,
        10000,
    )


def test_a_stop_is_heard_while_the_input_sets_are_built(monkeypatch, capsys):
    """SIGTERM while bench builds its input sets: it stops at the next build, not after all of them."""
    import signal

    from vllm_flydsl_indexer.tools import bench
    from vllm_flydsl_indexer.tools import cli as cli_mod

    real = bench.build_problem
    built = []

    def build(*a, **k):
        built.append(1)
        if len(built) == 3:
            signal.raise_signal(signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(bench, "build_problem", build)
    argv = [*BENCH, "--heads", "32", "--block-size", "64", "--next-n", "1", "--batch", "1"]
    status = cli_mod.main([*argv, "--context-len", "64", "--input-sets", "64", "--repeats", "1"])
    assert status == 130
    assert len(built) == 3, len(built)
    assert "SIGTERM: stopping after the current call" in capsys.readouterr().err
