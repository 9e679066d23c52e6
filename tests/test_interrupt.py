# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C and SIGTERM keep what was measured (issue 23): real CLI runs, signalled mid-run."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import types
from unittest import mock

import pytest

from test_cli import CLI, PACKAGE_ROOT, cli, no_vllm_env
from vllm_flydsl_indexer.tools import interrupt
from vllm_flydsl_indexer.tools.progress import Progress

# Four small shapes, each a fraction of a second of timing on CPU: the signal lands mid-run.
SMALL_BENCH = [
    "bench",
    "--device",
    "cpu",
    "--batch",
    "1",
    "--context-len",
    "256,512,768,1024",
    "--next-n",
    "1",
    "--heads",
    "32",
    "--block-size",
    "1",
    "--repeats",
    "200",
]
DEADLINE_S = 120


def signal_run(args: list[str], marker: str, signals: list[tuple[int, str | None]]) -> tuple[int, str, str]:
    """Run the CLI; once a stderr line contains ``marker``, send each signal in turn.

    Each signal is sent, then the next waits for its own marker (``None``: none):
    two signals sent back to back could reach Python's handler as one.
    Returns (exit status, stdout, stderr).
    """
    env = no_vllm_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], PACKAGE_ROOT])
    proc = subprocess.Popen(CLI + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(DEADLINE_S, proc.kill)
    watchdog.start()
    seen = []
    try:
        pending = list(signals)
        waiting_for: str | None = marker
        for line in proc.stderr:
            seen.append(line)
            if waiting_for is not None and waiting_for in line:
                signum, waiting_for = pending.pop(0)
                os.kill(proc.pid, signum)
                while pending and waiting_for is None:
                    signum, waiting_for = pending.pop(0)
                    os.kill(proc.pid, signum)
                if not pending:
                    break
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, "".join(seen) + err


def shapes_in(results: list[dict]) -> set[tuple]:
    return {tuple(sorted(r["shape"].items())) for r in results}


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.slow
def test_bench_sigint_keeps_the_finished_shapes(tmp_path):
    """First Ctrl-C: the shape under way is dropped at its next call, then every requested file is written
    with what finished."""
    j, c = tmp_path / "out.json", tmp_path / "out.csv"
    rc, out, err = signal_run(
        [*SMALL_BENCH, "--json", str(j), "--csv", str(c)],
        " 2/4 ",  # the second shape started: the first one finished
        [(signal.SIGINT, None)],
    )
    assert rc == interrupt.EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in err
    lines = err.splitlines()
    assert (
        lines.count(
            "vllm-flydsl-indexer: SIGINT: stopping after the current call; the shape under way is dropped "
            "(again to stop now)"
        )
        == 1
    ), err
    match = re.fullmatch(r"interrupted after (\d+)/(\d+)", lines[-1])
    assert match, err
    done, total = map(int, match.groups())
    assert total == 4 and 1 <= done < total
    # The progress bar does not claim the run finished.
    assert "done in" not in err and "bench [" in err and f"{done}/4 interrupted after" in err
    data = json.loads(j.read_text())
    assert data["meta"]["interrupted"] is True
    assert (data["meta"]["completed"], data["meta"]["planned"]) == (done, total)
    assert len(shapes_in(data["results"])) == done
    assert all(r["status"] == "timed" for r in data["results"])
    assert len(c.read_text().splitlines()) == 1 + len(data["results"])
    assert out.startswith(f"INTERRUPTED: {done}/4 shapes finished")
    assert f"bench: wrote JSON to {j}" in out.splitlines()
    assert leftovers(tmp_path) == []


def test_bench_second_sigint_stops_now_without_a_traceback_or_a_partial_file(tmp_path):
    j = tmp_path / "out.json"
    rc, out, err = signal_run(
        [*SMALL_BENCH, "--json", str(j)],
        " 1/4 ",
        [(signal.SIGINT, "stopping after the current call"), (signal.SIGINT, None)],
    )
    assert rc == interrupt.EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "vllm-flydsl-indexer bench: interrupted", err
    # Stopped inside the first shape: nothing finished, so no file, and no temporary file either.
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_check_sigterm_reports_the_cases_that_ran(tmp_path):
    args = ["check", "--device", "cpu", "--model", "glm-5", "--block-size", "64", "--next-n", "1"]
    small = ["--batch", "1", "--context-len", "64"]
    rc, out, err = signal_run([*args, *small], "] 2/", [(signal.SIGTERM, None)])
    assert rc == interrupt.EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in err
    assert "vllm-flydsl-indexer: SIGTERM: stopping after the current case (again to stop now)" in err
    match = re.fullmatch(r"interrupted after (\d+)/(\d+)", err.splitlines()[-1])
    assert match, err
    done, total = map(int, match.groups())
    assert 1 <= done < 9 < total  # stopped among the 9 model cases, not after them
    rows = [line for line in out.splitlines() if line.endswith(("PASS", "FAIL"))]
    assert len(rows) == done
    assert out.splitlines()[-1] == (
        f"{done} passed, 0 failed, {total - done} not run (interrupted after {done}/{total}) "
        "(reference contracts, not the real kernels)"
    )
    assert "done in" not in err


def test_bench_names_the_shapes_where_the_flydsl_arm_runs_stock(tmp_path):
    """heads=7: no FlyDSL variant takes it, so the patched call times stock; one line says so."""
    j = tmp_path / "b.json"
    argv = ["bench", "--device", "cpu", "--heads", "7,32", "--block-size", "1", "--next-n", "1"]
    small = ["--batch", "1", "--context-len", "64,128", "--repeats", "1", "--warmup", "0"]
    out = cli([*argv, *small, "--pool-blocks", "64", "--json", str(j)], no_vllm_env())
    assert out.returncode == 0, out.stderr[-3000:]
    notes = [line for line in out.stderr.splitlines() if line.startswith("bench: no FlyDSL variant takes ")]
    assert len(notes) == 1, out.stderr
    assert "H7 D128 KVB1plain n1 B1 ctx64, H7 D128 KVB1plain n1 B1 ctx128 (heads=7 is not" in notes[0]
    assert "H32" not in notes[0] and notes[0].endswith("arm runs stock there")
    data = json.loads(j.read_text())
    routed = {
        (r["shape"]["heads"], r["shape"]["context_len"]): r["extra"]["router"]
        for r in data["results"]
        if r["extra"]
    }
    assert routed[32, 64] == "FlyDSL" and routed[7, 64].startswith("stock: heads=7")
    # --pool-blocks is part of what was measured: in the header and the meta.
    assert "pool blocks: 64 shared physical blocks" in out.stdout
    assert data["meta"]["pool_blocks"] == 64 and data["meta"]["interrupted"] is False
    assert (data["meta"]["completed"], data["meta"]["planned"]) == (4, 4)


# ---------------------------------------------------------------- units


def test_write_atomic_failing_midway_leaves_the_target_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("old")
    target.chmod(0o600)

    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        interrupt.write_atomic(str(target), "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]

    monkeypatch.undo()

    def interrupted(fd):
        raise interrupt.StopNow("SIGINT")

    monkeypatch.setattr(os, "fsync", interrupted)  # a second Ctrl-C mid-write
    with pytest.raises(interrupt.StopNow):
        interrupt.write_atomic(str(target), "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_bench_replaces_its_files_atomically(tmp_path, monkeypatch, capsys):
    """Every bench output goes through a temporary file: a failed rename leaves the old file whole."""
    from argparse import Namespace

    from vllm_flydsl_indexer.tools import bench

    paths = {kind: tmp_path / f"r.{kind}" for kind in ("json", "csv", "png")}
    for path in paths.values():
        path.write_text("old")
    result = bench.ArmResult(dict(bench.Shape(32, 128, 64, 1, 1, 1024).__dict__), "reference", False, "timed")
    result.median_us, result.speedup_vs_baseline = 1.0, 1.0

    def boom(*args):
        raise OSError("rename refused")

    monkeypatch.setattr(os, "replace", boom)
    args = Namespace(json_path=str(paths["json"]), csv_path=str(paths["csv"]), plot_path=None)
    written, failed = bench.write_outputs([result], {"device": "cpu"}, args)
    assert written == [] and len(failed) == 2 and "median_us" in capsys.readouterr().out
    # matplotlib (an extra) as a stand-in whose figure saves a few bytes wherever it is told.
    fig = mock.MagicMock()
    fig.savefig.side_effect = lambda target, **kw: (
        target.write(b"PNG") if hasattr(target, "write") else open(target, "wb").write(b"PNG")
    )
    pyplot = types.SimpleNamespace(subplots=lambda **kw: (fig, mock.MagicMock()), close=lambda f: None)
    matplotlib = types.SimpleNamespace(use=lambda name: None, pyplot=pyplot)
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    with pytest.raises(OSError, match="rename refused"):
        bench.plot([result], {"device": "cpu", "arms": "a"}, str(paths["png"]))
    assert fig.savefig.called
    assert all(path.read_text() == "old" for path in paths.values())
    assert leftovers(tmp_path) == []


def test_write_atomic_writes_keeps_the_mode_and_translates_newlines_as_asked(tmp_path):
    target = tmp_path / "out.csv"
    target.write_text("old")
    target.chmod(0o600)
    interrupt.write_atomic(str(target), "a,b\n1,2\n", newline="")
    assert target.read_bytes() == b"a,b\n1,2\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    fresh = tmp_path / "new.json"
    umask = os.umask(0o022)
    try:
        interrupt.write_atomic(str(fresh), "x\n", newline="\r\n")
    finally:
        os.umask(umask)
    assert fresh.read_bytes() == b"x\r\n" and stat.S_IMODE(fresh.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "out.csv"]


def test_stop_signal_first_asks_second_stops_now_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stream = io.StringIO()
    with pytest.raises(interrupt.StopNow), interrupt.StopSignal(stream=stream) as stop:
        assert not stop.requested
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        assert stream.getvalue() == (
            "vllm-flydsl-indexer: SIGTERM: stopping after the current shape (again to stop now)\n"
        )
        signal.raise_signal(signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert not issubclass(interrupt.StopNow, (Exception, KeyboardInterrupt))
    assert interrupt.interrupted_note(3, 8) == "interrupted after 3/8"


def test_stop_signal_outside_the_main_thread_installs_nothing():
    before = signal.getsignal(signal.SIGINT)
    seen = []

    def worker():
        with interrupt.StopSignal():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [before]


@pytest.mark.parametrize(
    ("stopped", "error", "last"),
    [
        (False, None, "check [########################] 3/3 done in"),
        (True, None, "check [################........] 2/3 interrupted after"),
        (False, KeyboardInterrupt, "check [########................] 1/3 interrupted after"),
        (False, ValueError, "check [########................] 1/3 failed after"),
    ],
)
def test_progress_says_done_only_when_every_step_finished(stopped, error, last):
    stream = io.StringIO()
    steps = 3 if not stopped else 2
    try:
        with Progress(3, "check", stream) as progress:
            for name in ("case a", "case b", "case c")[:steps]:
                progress.step(name)
                if error is not None and name == "case b":
                    raise error
            progress.stopped = stopped
    except (KeyboardInterrupt, ValueError):
        pass
    assert last in stream.getvalue().splitlines()[-1]


@pytest.mark.slow
def test_tune_sigint_merges_the_finished_rows_and_says_so(tmp_path):
    """bench --tune: the rows measured before a Ctrl-C are merged and written, earlier rows kept."""
    from vllm_flydsl_indexer import tuning
    from vllm_flydsl_indexer.tools import tuned as validator

    table, report = tmp_path / "t.csv", tmp_path / "t.json"
    header = ",".join(tuning.COLUMNS)
    earlier = "gfx950,256,64,1,32,128,64,True,8192;32768,flydsl,0,0,3,30.19,31.04,30.19"
    table.write_text(f"{header}\n{earlier}\n")
    args = ["bench", "--tune", str(table), "--reference", "--device", "cpu", "--heads", "32"]
    shapes = ["--block-size", "64,1", "--next-n", "1", "--batch", "1,2", "--context-len", "512"]
    timing = ["--repeats", "40", "--warmup", "0", "--json", str(report)]
    rc, out, err = signal_run([*args, *shapes, *timing], "] H32 KVB64 n1 B1 ctx", [(signal.SIGINT, None)])
    assert rc == interrupt.EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in err
    match = re.fullmatch(r"interrupted after (\d+)/4", err.splitlines()[-1])
    assert match, err
    done = int(match.group(1))
    assert 1 <= done < 4
    lines = table.read_text().splitlines()
    assert lines[:2] == [header, earlier] and len(lines) == 2 + done
    assert all(line.startswith("reference,1,") for line in lines[2:])
    # Every written row is valid: the validator refuses none, the plugin skips none.
    assert len(validator.read_rows(iter(lines), str(table))) == 1 + done
    parsed = tuning.parse(table.read_text(), "reference", str(table))
    assert parsed.skipped == 0 and sum(len(r) for b in parsed.shapes.values() for r in b.values()) == done
    data = json.loads(report.read_text())
    assert data["meta"]["interrupted"] is True
    assert (data["meta"]["completed"], data["meta"]["planned"]) == (done, 4)
    assert len(data["rows"]) == done
    assert f"bench --tune: wrote {done} rows" in out and "kept 1 earlier rows" in out
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------- the stop is bounded in time


@pytest.mark.parametrize("command", ["bench", "tune"])
@pytest.mark.slow_except("tune")
def test_a_stop_waits_for_one_timed_call_not_for_the_repeats(tmp_path, monkeypatch, capsys, command):
    """A signal during a long --repeats ends the run at the next call: the shape under way is dropped,
    what finished is written, exit 130. A loop that checked only between shapes would run on."""
    from vllm_flydsl_indexer.tools import cli, harness

    real = harness.Timer.time_us
    calls = []

    def counting(self, fn, warmup, repeats):
        def once(i):
            calls.append(i)
            if len(calls) == 5:
                signal.raise_signal(signal.SIGTERM)
            if len(calls) > 200:
                raise RuntimeError("the stop was not taken between timed calls")
            return fn(i)

        return real(self, once, warmup, repeats)

    monkeypatch.setattr(harness.Timer, "time_us", counting)
    j = tmp_path / "out.json"
    small = ["--device", "cpu", "--batch", "1", "--next-n", "1", "--heads", "32", "--block-size", "1"]
    argv = ["bench", *small, "--context-len", "64,128", "--repeats", "100000", "--json", str(j)]
    if command == "tune":
        argv += ["--tune", str(tmp_path / "t.csv"), "--reference"]
    assert cli.main(argv) == interrupt.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "SIGTERM: stopping after the current call; the shape under way is dropped" in err, err
    assert err.splitlines()[-1] == "interrupted after 0/" + ("1" if command == "tune" else "2"), err
    assert len(calls) == 5
    meta = json.loads(j.read_text())["meta"]
    assert meta["interrupted"] is True and meta["completed"] == 0


def test_a_sigterm_outside_the_graceful_stop_exits_130_as_sigint_does(tmp_path):
    """A signal after a tool's own handlers are gone (its graceful stop finished, say): 130, never 143."""
    code = (
        "import os, signal, sys, time\n"
        "from vllm_flydsl_indexer.tools import cli, doctor\n"
        "def late(**kw):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "    return 0\n"
        "doctor.main = late\n"
        "sys.exit(cli.main(['doctor']))\n"
    )
    env = no_vllm_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], PACKAGE_ROOT])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == interrupt.EXIT_INTERRUPTED, (done.returncode, done.stderr[-2000:])
    assert done.stderr.splitlines() == ["vllm-flydsl-indexer doctor: interrupted"]


def test_help_says_how_soon_a_signal_stops_each_tool(capsys):
    from vllm_flydsl_indexer.tools import cli, settings

    for command, text in (("check", settings.STOP_CHECK), ("bench", settings.STOP_BENCH)):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert " ".join(text.split()) in " ".join(capsys.readouterr().out.split())
