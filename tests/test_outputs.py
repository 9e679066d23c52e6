# SPDX-License-Identifier: Apache-2.0
"""Writers that share a file keep every row (issue 45): ``bench --tune`` merges under a lock."""

from __future__ import annotations

import threading
import time
from argparse import Namespace

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
        args = Namespace(device="cpu", reference=True, tune_path=str(table), json_path=None, batch=(batch,))
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
