# SPDX-License-Identifier: Apache-2.0
"""Every result survives its terminal (issue 45): a closed, full, narrow or broken stdout, and SIGHUP.

Files first, then the report; a report that cannot be printed costs one line on stderr, never the
exit status (a broken pipe exits 141, as Unix tools do); never a traceback.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from test_cli import CLI, PACKAGE_ROOT, no_vllm_env
from test_interrupt import SMALL_BENCH, signal_run
from vllm_flydsl_indexer.tools import interrupt, streams

META = {
    "device": "cpu",
    "arms": "a",
    "arms_why": "",
    "stock": "s",
    "repeats": 1,
    "input_sets": 1,
    "copy_bw_gbps": None,
}


@pytest.fixture
def measured(monkeypatch):
    """bench's run replaced by one timed result (the measurement is not what these tests are about)."""
    from vllm_flydsl_indexer.tools import bench

    shape = bench.Shape(32, 128, 64, 1, 1, 1024)
    result = bench.ArmResult(dict(shape.__dict__), "reference", False, "timed", median_us=12.5)
    monkeypatch.setattr(bench, "run", lambda args, stop=None: ([result], dict(META)))
    return result


def run_bench_with_stdout(stream, tmp_path, name="r", monkeypatch=None) -> tuple[int, str]:
    """``bench --json --csv`` in this process with ``stream`` as its stdout; (status, stderr)."""
    from vllm_flydsl_indexer.tools import cli as cli_mod

    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", err)
    argv = ["bench", "--device", "cpu", "--json", str(tmp_path / f"{name}.json")]
    status = cli_mod.main([*argv, "--csv", str(tmp_path / f"{name}.csv")])
    monkeypatch.undo()
    return status, err.getvalue()


def assert_written(tmp_path, name="r") -> None:
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["results"][0]["median_us"] == 12.5
    assert "12.5" in (tmp_path / f"{name}.csv").read_text()


def test_closed_stdout_is_one_line_and_the_verdict(tmp_path):
    """``doctor >&-``: the work's own status (0), one stderr line, no AttributeError traceback."""
    done = subprocess.run(
        [*CLI, "doctor"],
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.close(1),
    )
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        "vllm-flydsl-indexer doctor: standard output is closed; nothing was printed"
    )


def test_full_stdout_keeps_the_results(tmp_path, measured, monkeypatch):
    """``bench --json r.json > /dev/full``: the files are written, status 0, one line says why no report."""
    with open("/dev/full", "w") as full:
        status, err = run_bench_with_stdout(full, tmp_path, monkeypatch=monkeypatch)
    assert status == 0, err
    assert_written(tmp_path)
    assert err.splitlines() == [
        "vllm-flydsl-indexer bench: could not print to standard output (No space left on device); "
        "the rest of the report was dropped"
    ]


def test_a_stdout_that_cannot_encode_a_path_prints_it_escaped(tmp_path, measured, monkeypatch):
    """``PYTHONIOENCODING=ascii`` and a non-ASCII file name: written, and named escaped."""
    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii", errors="strict", write_through=True)
    status, err = run_bench_with_stdout(ascii_out, tmp_path, name="r\u00e9sultats", monkeypatch=monkeypatch)
    assert status == 0, err
    assert err == ""
    assert_written(tmp_path, "r\u00e9sultats")
    printed = raw.getvalue().decode("ascii")
    assert "bench: wrote JSON to " in printed and "r\\xe9sultats.json" in printed


def test_a_reader_that_went_away_exits_141_after_the_files(tmp_path, measured, monkeypatch):
    """``bench --json a.json --csv a.csv | head -1``: both files written, then 141, silently."""
    read, write = os.pipe()
    os.close(read)
    with open(write, "w", buffering=1) as pipe:  # each line sent, as a report larger than a pipe's buffer
        status, err = run_bench_with_stdout(pipe, tmp_path, monkeypatch=monkeypatch)
    assert status == 141
    assert err == ""
    assert_written(tmp_path)


def test_a_tune_with_a_full_stdout_keeps_its_table(tmp_path, monkeypatch):
    from vllm_flydsl_indexer import tuning
    from vllm_flydsl_indexer.tools import cli as cli_mod

    table = tmp_path / "t.csv"
    argv = ["bench", "--tune", str(table), "--reference", "--device", "cpu", "--heads", "32"]
    small = ["--block-size", "64", "--next-n", "1", "--batch", "1", "--repeats", "1", "--warmup", "0"]
    err = io.StringIO()
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        monkeypatch.setattr(sys, "stderr", err)
        status = cli_mod.main([*argv, *small])
        monkeypatch.undo()
    assert status == 0, err.getvalue()
    lines = table.read_text().splitlines()
    assert lines[0] == ",".join(tuning.COLUMNS) and lines[1].startswith("reference,")
    assert err.getvalue().splitlines()[-1].startswith("vllm-flydsl-indexer bench: could not print")


def test_a_closed_stdout_with_nothing_to_say_says_nothing(monkeypatch):
    stream = streams.GuardedStream(None)
    assert stream.problem() is None and not stream.isatty()
    stream.write("")
    assert stream.problem() is None
    stream.write("x")
    stream.flush()
    assert stream.problem() == "standard output is closed; nothing was printed"


def test_a_broken_pipe_to_a_real_bench_exits_141_with_both_files(tmp_path):
    """The issue's case end to end: a real bench whose stdout reader is gone before it prints."""
    j, c = tmp_path / "a.json", tmp_path / "a.csv"
    argv = [*SMALL_BENCH[:-1], "2", "--warmup", "0", "--json", str(j), "--csv", str(c)]
    proc = subprocess.Popen(
        [*CLI, *argv], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.close()  # head -1 that read nothing
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == 141, err[-3000:]
    assert "Traceback" not in err
    assert json.loads(j.read_text())["meta"]["completed"] == 4
    assert len(c.read_text().splitlines()) == 1 + len(json.loads(j.read_text())["results"])


def test_sighup_is_handled_as_sigterm(tmp_path):
    """A closed terminal (SIGHUP) mid-bench: what finished is written, exit 130, as for SIGTERM."""
    j = tmp_path / "out.json"
    rc, out, err = signal_run([*SMALL_BENCH, "--json", str(j)], " 2/4 ", [(signal.SIGHUP, None)])
    assert rc == interrupt.EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in err
    assert "vllm-flydsl-indexer: SIGHUP: stopping after the current call" in err
    data = json.loads(j.read_text())
    assert data["meta"]["interrupted"] is True and 1 <= data["meta"]["completed"] < 4


def test_sighup_outside_a_tools_handlers_exits_130(monkeypatch, capsys):
    from vllm_flydsl_indexer.tools import cli as cli_mod
    from vllm_flydsl_indexer.tools import doctor

    def hung_up(**kwargs):
        signal.raise_signal(signal.SIGHUP)
        return 0

    monkeypatch.setattr(doctor, "main", hung_up)
    assert cli_mod.main(["doctor"]) == interrupt.EXIT_INTERRUPTED
    assert capsys.readouterr().err == "vllm-flydsl-indexer doctor: interrupted\n"


def test_an_ignored_sighup_stays_ignored():
    """``nohup``: a SIGHUP the parent ignored does not stop the run."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interrupt.StopSignal(stream=io.StringIO()) as stop:
            signal.raise_signal(signal.SIGHUP)
            assert not stop.requested
        with interrupt.terminate_as_interrupt():
            signal.raise_signal(signal.SIGHUP)  # no StopNow
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_the_help_names_sighup(capsys):
    with pytest.raises(SystemExit):
        from vllm_flydsl_indexer.tools import cli as cli_mod

        cli_mod.main(["bench", "--help"])
    assert "SIGHUP" in capsys.readouterr().out


def test_python_m_doctor_to_dev_full_is_one_line():
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [*CLI, "doctor"], env=_env(), stdout=full, stderr=subprocess.PIPE, text=True, timeout=120
        )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith("vllm-flydsl-indexer doctor: could not print to standard")


def _env(**extra):
    env = no_vllm_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], PACKAGE_ROOT])
    return env


# ---------------------------------------------------------------- echoed values are safe to print

HOSTILE = "\x1b[31mred\x1b]0;title\x07" + "x" * 100_000


def test_doctor_escapes_and_shortens_what_it_echoes():
    """Five 100 KB variables with ANSI escapes made doctor print 902 KB straight to the terminal."""
    from vllm_flydsl_indexer import envs

    values = {envs.SWITCH: HOSTILE, envs.SELFTEST: HOSTILE, envs.TUNED_CSV: "/tmp/" + HOSTILE}
    done = subprocess.run([*CLI, "doctor"], env=_env(**values), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "\\x1b[31mred" in done.stdout
    assert len(done.stdout) < 20_000, len(done.stdout)
    assert "more characters)" in done.stdout


def test_an_error_line_escapes_and_shortens_the_value_it_names(capsys):
    from vllm_flydsl_indexer.tools import cli as cli_mod

    with pytest.raises(SystemExit) as exit_info:
        cli_mod.main(["bench", "--heads", "1," * 50_000 + "\x1b[2J"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    (line,) = err.splitlines()
    assert line.startswith("vllm-flydsl-indexer bench: error: argument --heads: ")
    assert "\x1b" not in line and len(line) < 1000 and "more characters)" in line


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("plain", "'plain'"),
        ("\x1b[31m", "'\\x1b[31m'"),
        ("a\u200bb", "'a\\u200bb'"),  # a zero-width space, invisible on a terminal
        ("y" * 205, "'" + "y" * 200 + "'... (5 more characters)"),
    ],
)
def test_shown_escapes_control_characters_and_counts_what_it_cuts(value, expected):
    assert streams.shown(value) == expected


def test_safe_line_keeps_short_words_and_cuts_long_ones():
    line = "switch: " + "z" * 250 + " ok"
    assert streams.safe_line(line) == "switch: " + "z" * 200 + "... (50 more characters) ok"
    assert streams.safe_line("tab\tand\x1b") == "tab\tand\\x1b"


def test_bench_and_tune_name_their_output_files_escaped(tmp_path, measured, monkeypatch, capsys):
    """``bench --json 'out\\e[31m.json'`` and ``bench --tune``: the files are written under their real
    names; every "wrote ... to" line shows the escape as text, never the raw sequence."""
    from vllm_flydsl_indexer.tools import cli as cli_mod

    ansi = "out\x1b[31m"
    status = cli_mod.main(["bench", "--device", "cpu", "--json", str(tmp_path / f"{ansi}.json")])
    bench_out = capsys.readouterr().out
    table, tuned_json = tmp_path / f"{ansi}.csv", tmp_path / f"{ansi}-tune.json"
    argv = ["bench", "--tune", str(table), "--json", str(tuned_json), "--reference", "--device", "cpu"]
    small = ["--heads", "32", "--block-size", "64", "--next-n", "1", "--batch", "1"]
    tune_status = cli_mod.main([*argv, *small, "--repeats", "1", "--warmup", "0"])
    tune_out = capsys.readouterr().out
    assert (status, tune_status) == (0, 0)
    assert json.loads((tmp_path / f"{ansi}.json").read_text())["results"][0]["median_us"] == 12.5
    assert table.read_text().startswith("gfx,") and json.loads(tuned_json.read_text())["rows"]
    escaped = "out\\x1b[31m"
    assert f"bench: wrote JSON to {tmp_path}/{escaped}.json" in bench_out.splitlines()
    wrote = [line for line in tune_out.splitlines() if line.startswith("bench --tune: wrote")]
    assert len(wrote) == 2 and all(escaped in line for line in wrote), tune_out
    assert "\x1b" not in bench_out + tune_out
