# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer tune --model M`` (issue 44 item 5): the plugin's own measurement, ahead of serving.

Under the suite's gfx950 simulation (the aiter and amdsmi doubles; CPU, wall-clock timing), with vLLM and
without it: every bucket the model uses is measured once into the node cache, one row per bucket, and a
second run measures nothing. Each run's cache root and Hugging Face cache are the test's own.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DOUBLES, run_python, simulation_env
from vllm_flydsl_indexer.tools.tune_model import CACHED, MEASURED

HIDE_VLLM = str(DOUBLES / "hide_vllm")
HEADER = "heads  next_n  KVBlockSize  batch  winner"


def env_for(tmp_path: Path, vllm: bool = True, **extra) -> dict:
    env = simulation_env(VLLM_CACHE_ROOT=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"), **extra)
    if not vllm:
        env["PYTHONPATH"] = os.pathsep.join([HIDE_VLLM, env["PYTHONPATH"]])
    return env


def tune(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    code = f"import sys\nfrom vllm_flydsl_indexer.tools.cli import main\nsys.exit(main({argv!r}))\n"
    return run_python(code, env)


def table_rows(stdout: str) -> list[list[str]]:
    """The report's table: heads, next_n, KVBlockSize, batch, winner, speedup, source."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER)) + 2
    rows = []
    for line in lines[start:]:
        if line.startswith("node cache:"):
            break
        cells = line.split()
        speed = next(i for i, c in enumerate(cells) if c.endswith("x") or c == "-")
        rows.append([*cells[:4], " ".join(cells[4:speed]), cells[speed], " ".join(cells[speed + 1 :])])
    return rows


def cache_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "flydsl_indexer").glob("*.csv"))


def cache_rows(path: Path) -> dict[tuple, dict]:
    with open(path, newline="") as f:
        assert f.readline().startswith("# vllm-flydsl-indexer node cache keyed on: format=3 device=cpu")
        return {
            tuple(int(r[c]) for c in ("batch_size", "next_n", "heads", "head_dim", "kv_block_size")): r
            for r in csv.DictReader(f)
        }


WINNERS = {"flydsl": "FlyDSL", "gluon": "stock (Gluon)"}


def assert_rows_are_the_cache(rows: list[list[str]], cached: dict[tuple, dict]) -> None:
    """Each table row is its cache row: the winner the cache names, the speedup its times give."""
    assert len(rows) == len(cached)
    for heads, next_n, block, batch, winner, speedup, _ in rows:
        row = cached[int(batch), int(next_n), int(heads), 128, int(block)]
        assert row["gfx"] == "gfx950" and row["cu_num"] == "1" and row["preshuffle"] == "True"
        assert winner == WINNERS[row["backend"]], (winner, row)
        assert speedup == f"{float(row['gluon_us']) / float(row['us']):.2f}x", (speedup, row)


# Two tune runs under vLLM (~30 s on 2 cores): the slow set; the fast suite runs tune without vLLM.
@pytest.mark.slow
def test_tune_with_vllm_measures_each_bucket_once_then_reads_the_cache(tmp_path):
    env = env_for(tmp_path)
    first = tune(["tune", "--model", "deepseek-ai/DeepSeek-V3.2", "--max-batch", "5"], env)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    assert "model:   DeepSeek-V3.2 (deepseek_v32): heads=64 head_dim=128 (this package's model table)" in out
    assert "next_n:  1 (no MTP layers in its config" in out
    assert "stock:   vLLM's own vllm.v1.attention.ops.rocm_aiter_mla_sparse.rocm_fp8_paged_mqa_logits" in out
    rows = table_rows(out)
    # vLLM's capture sizes up to 5 sequences: 1, 2, 4, floored to powers of two.
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("64", "1", "64", b) for b in ("1", "2", "4")]
    assert {r[6] for r in rows} == {MEASURED}
    (path,) = cache_files(tmp_path)
    assert f"node cache: {path} (3 bucket(s) measured now)" in out
    assert_rows_are_the_cache(rows, cache_rows(path))
    assert "tune [########################] 3/3 done in" in first.stderr
    written = path.read_bytes()

    second = tune(["tune", "--model", "deepseek-ai/DeepSeek-V3.2", "--max-batch", "5"], env)
    assert second.returncode == 0, second.stderr[-3000:]
    again = table_rows(second.stdout)
    assert {r[6] for r in again} == {CACHED}
    assert [r[:6] for r in again] == [r[:6] for r in rows]  # the same verdicts, read back
    assert f"node cache: {path} (0 bucket(s) measured now)" in second.stdout
    assert path.read_bytes() == written


def test_tune_without_vllm_reads_the_config_and_measures_mtp_too(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "deepseek_v32", "index_n_heads": 32, "index_head_dim": 128}
    (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    env = env_for(tmp_path, vllm=False)
    done = tune(["tune", "--model", str(model), "--max-batch", "2"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "heads=32 head_dim=128 (config.json)" in done.stdout
    assert "next_n:  1, 2 (2 for MTP: num_nextn_predict_layers 1)" in done.stdout
    assert "stock:   this package's stock copy of vLLM's gfx950 branches (vLLM unavailable" in done.stdout
    assert "the arch amdsmi reports" in done.stdout
    rows = table_rows(done.stdout)
    assert [(r[0], r[1], r[3]) for r in rows] == [("32", n, b) for n in "12" for b in "12"]
    assert {r[6] for r in rows} == {MEASURED}
    (path,) = cache_files(tmp_path)
    assert_rows_are_the_cache(rows, cache_rows(path))
    second = tune(["tune", "--model", str(model), "--max-batch", "2"], env)
    assert second.returncode == 0 and {r[6] for r in table_rows(second.stdout)} == {CACHED}


def test_a_planted_cache_row_is_read_not_measured(tmp_path, monkeypatch):
    """A row the cache already holds (a planted, recognisable one) decides its bucket; only the others are
    timed, and the planted row is left as it was."""
    from vllm_flydsl_indexer import measure, tuning

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    # The key of the command's own stack (no vLLM there): one subprocess asks it.
    code = "import torch\nfrom vllm_flydsl_indexer import measure\n"
    code += "print(measure.cache_key(torch.device('cpu'), 'gfx950', 1))\n"
    key = run_python(code, env_for(tmp_path, vllm=False)).stdout.strip()
    assert "vllm=unknown" in key
    path = measure.cache_path("gfx950", 1, key)
    from vllm_flydsl_indexer.tools.settings import TUNE_MODEL_CPU_MAX_MODEL_LEN

    context = measure.contexts_of(TUNE_MODEL_CPU_MAX_MODEL_LEN)  # a row applies at its own context only
    values = ("gfx950", 1, 2, 1, 64, 128, 64, True, context, "flydsl", 0, 0, 0, 10.0, 37.0, 10.0)
    planted = dict(zip(tuning.COLUMNS, values, strict=True))
    assert measure.write_cache(path, key, [planted]) is None
    done = tune(["tune", "--model", "deepseek_v32", "--max-batch", "2"], env_for(tmp_path, vllm=False))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = table_rows(done.stdout)
    assert rows[0][6] == MEASURED
    assert rows[1] == ["64", "1", "64", "2", "FlyDSL", "3.70x", CACHED]
    kept = cache_rows(path)
    assert set(kept) == {(1, 1, 64, 128, 64), (2, 1, 64, 128, 64)}
    assert kept[2, 1, 64, 128, 64]["us"] == "10.0" and kept[2, 1, 64, 128, 64]["gluon_us"] == "37.0"


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "one of the arguments --model --out is required"),
        (
            ["--model", "deepseek_v32", "--batch", "4"],
            "argument --batch: only with --out FILE (a swept table)",
        ),
        (["--reference", "--model", "deepseek_v32"], "argument --reference: only with --out FILE"),
        (["--model", "llama"], "--model llama: not a directory or a known model type"),
        (["--model", "someorg/unknown"], "nor a Hugging Face model id with its config.json"),
        (["--model", "deepseek_v4"], "indexer cache is block-outer (BLHNC"),
        (["--model", "deepseek_v32", "--next-n", "0"], "argument --next-n: must be a comma list"),
        (["--model", "deepseek_v32", "--next-n", "5000"], "--next-n: each value must be at most 4095"),
        (["--model", "deepseek_v32", "--max-batch", "0"], "argument --max-batch: must be a positive integer"),
    ],
)
def test_bad_arguments_are_one_line_exit_2_before_any_work(tmp_path, argv, words):
    done = tune(["tune", *argv], env_for(tmp_path, vllm=False))
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("vllm-flydsl-indexer tune: error: ") and words in line, line
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "where, words",
    [
        ({"gfx950": False}, "the device is gfx942"),
        ({"aiter": False}, "aiter has no usable FlyDSL kernel"),
    ],
)
def test_nothing_measurable_is_one_line_exit_1(tmp_path, where, words):
    env = simulation_env(VLLM_CACHE_ROOT=str(tmp_path / "cache"), **where)
    done = tune(["tune", "--model", "deepseek_v32", "--max-batch", "1"], env)
    assert done.returncode == 1 and done.stdout == ""
    ours = [line for line in done.stderr.splitlines() if "vllm-flydsl-indexer tune" in line]
    assert len(ours) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert ours[0].startswith("vllm-flydsl-indexer tune: nothing can be measured here: ") and words in ours[0]
    assert not (tmp_path / "cache").exists()


# A tune run under vLLM (~13 s on 2 cores): the slow set; test_interrupt keeps Ctrl-C in the fast suite.
@pytest.mark.slow
def test_ctrl_c_keeps_the_finished_buckets_and_exits_130(tmp_path):
    env = env_for(tmp_path, vllm=False)
    code = "import sys\nfrom vllm_flydsl_indexer.tools.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "tune", "--model", "deepseek_v32"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("tune [") and " 2/10 " in line:
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=240)
    err = "".join(seen) + err
    assert proc.returncode == 130, err[-3000:]
    rows = table_rows(out)
    assert 2 <= len(rows) < 10 and {r[6] for r in rows} == {MEASURED}
    assert f"interrupted after {len(rows)}/10" in err and "stopping after the current bucket" in err
    (path,) = cache_files(tmp_path)
    assert_rows_are_the_cache(rows, cache_rows(path))


def test_tune_help_imports_no_torch():
    code = (
        "import sys\n"
        "from vllm_flydsl_indexer.tools.cli import main\n"
        "try:\n"
        "    main(['tune', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = run_python(code, simulation_env())
    assert done.returncode == 0, done.stderr[-2000:]
    text = " ".join(done.stdout.split())
    assert "--max-batch B" in text and "CUDA-graph capture sizes" in text
    assert "(--model M | --out FILE)" in text and "with --out FILE only:" in text


def test_a_model_id_reads_its_config_from_the_local_hugging_face_cache(tmp_path):
    """No download: the config.json of a cached snapshot, the same fields a model directory's gives."""
    snapshot = tmp_path / "hub" / "models--someorg--glm-like" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "index_n_heads": 32}))
    (tmp_path / "hub" / "models--someorg--glm-like" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--glm-like" / "refs" / "main").write_text("abc123")
    code = "from vllm_flydsl_indexer.tools import reach\nprint(reach.resolve('someorg/glm-like'))\n"
    env = {**simulation_env(), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = run_python(code, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "('glm_moe_dsa', {'model_type': 'glm_moe_dsa', 'index_n_heads': 32})"


# ---------------------------------------------------------------- issue 50: never a cache it did not write
# In this process (the suite's gfx950 simulation with vLLM): each run takes about a second, none a subprocess.


def tune_here(argv: list[str], capsys) -> tuple[int, str, list[str]]:
    """``tune`` in this process: its status, its stdout and its own stderr lines (no progress bar)."""
    from vllm_flydsl_indexer.tools import cli

    try:
        status = cli.main(["tune", *argv])
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return status, out.out, [line for line in out.err.splitlines() if line.startswith("vllm-flydsl-indexer")]


@pytest.fixture
def here(tmp_path, monkeypatch):
    """This process's cache root (the test's own), no table, and a record of each bucket's problem built."""
    from vllm_flydsl_indexer.tools import tune_model

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_FLYDSL_INDEXER_TUNED_CSV", raising=False)
    built = []
    real = tune_model.make_paged_problem

    def recorded(*args, **kwargs):
        built.append(kwargs["next_n"])
        return real(*args, **kwargs)

    monkeypatch.setattr(tune_model, "make_paged_problem", recorded)
    return built


def cache_file_here() -> Path:
    """The node cache file this process's plugin reads and writes (the simulation: 1 CU, device cpu)."""
    import torch

    from vllm_flydsl_indexer import measure

    return measure.cache_path("gfx950", 1, measure.cache_key(torch.device("cpu"), "gfx950", 1))


def temporaries(tmp_path: Path) -> list[Path]:
    return [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


LONG = "x" * 300  # a path component longer than any filesystem's 255


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda root: root.write_text("a file"), "NotADirectoryError"),
        (lambda root: root.symlink_to(root.parent / "nowhere"), "FileExistsError"),
        (lambda root: root.symlink_to(root), "Too many levels of symbolic links"),
        (lambda root: root.mkdir(mode=0o777) or root.chmod(0o777), None),  # made below: open to others
        (lambda root: None, "File name too long"),
    ],
    ids=["a regular file", "a dangling link", "a link loop", "a directory others can write", "a long name"],
)
def test_a_cache_root_that_cannot_be_written_is_one_line_exit_1_before_anything_is_measured(
    make, says, tmp_path, here, monkeypatch, capsys
):
    root = tmp_path / (LONG if says == "File name too long" else "root")
    make(root)
    if says is None:  # the cache's own directory is there, writable by everyone: the writer refuses it
        (root / "flydsl_indexer").mkdir(mode=0o777)
        (root / "flydsl_indexer").chmod(0o777)
        says = "is not a directory of this user's that only it can write"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    status, out, err = tune_here(["--model", "deepseek_v32", "--max-batch", "2"], capsys)
    assert (status, out) == (1, "")
    (line,) = err
    assert line.startswith("vllm-flydsl-indexer tune: nothing measured, since nothing could be cached: ")
    assert says in line and "VLLM_CACHE_ROOT=" in line, line
    assert here == [] and temporaries(tmp_path) == []


def test_an_unknown_user_in_the_cache_root_is_one_line_naming_it(here, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_CACHE_ROOT", "~no-such-user-here/cache")
    status, out, err = tune_here(["--model", "deepseek_v32", "--max-batch", "1"], capsys)
    assert (status, out, here) == (1, "", [])
    assert err == [
        "vllm-flydsl-indexer tune: nothing measured, since nothing could be cached: "
        "VLLM_CACHE_ROOT='~no-such-user-here/cache': RuntimeError: Could not determine home directory."
    ]


def test_a_directory_in_the_cache_files_place_is_refused_before_any_work(tmp_path, here, capsys):
    cache_file_here().mkdir(parents=True)
    status, out, err = tune_here(["--model", "deepseek_v32", "--max-batch", "2"], capsys)
    assert (status, out, here) == (1, "", [])
    assert err == [
        "vllm-flydsl-indexer tune: nothing measured, since nothing could be cached: "
        f"{cache_file_here()} is a directory, which the cache file cannot replace"
    ]
    assert temporaries(tmp_path) == []


def test_a_stack_whose_versions_cannot_be_read_is_refused_before_any_work(here, monkeypatch, capsys):
    """On a GPU a version that cannot be read keys no cache: every bucket would be measured for nothing."""
    from vllm_flydsl_indexer import measure

    monkeypatch.setattr(measure, "cache_key", lambda device, gfx, cus: None)
    versions = {"torch": "2.9", "aiter": "unknown", "flydsl": "unknown", "vllm": "0.33.0", "triton": "3.4"}
    monkeypatch.setattr(measure, "stack_versions", lambda: versions)
    status, out, err = tune_here(["--model", "deepseek_v32", "--max-batch", "1"], capsys)
    assert (status, out, here) == (1, "", [])
    assert err == [
        "vllm-flydsl-indexer tune: nothing measured, since nothing could be cached: the cache is keyed on "
        "the stack's versions, and aiter, flydsl cannot be read here"
    ]


def test_rows_the_cache_lost_during_the_run_are_reported_not_cached_and_exit_1(
    tmp_path, here, monkeypatch, capsys
):
    """A directory takes the cache file's place after the first bucket was written: neither bucket is in the
    cache at the end, each says so, the last line says why (the plugin's writer's reason), exit 1, and no
    temporary file is left."""
    from vllm_flydsl_indexer.tools import tune_model

    recorded = tune_model.make_paged_problem

    def then_a_directory(*args, **kwargs):
        if len(here) == 1:  # the first bucket is measured and written by now
            assert cache_file_here().is_file()
            cache_file_here().unlink()
            cache_file_here().mkdir()
        return recorded(*args, **kwargs)

    monkeypatch.setattr(tune_model, "make_paged_problem", then_a_directory)
    status, out, err = tune_here(["--model", "deepseek_v32", "--max-batch", "2"], capsys)
    assert status == 1 and len(here) == 2, err
    rows = table_rows(out)
    assert [r[6] for r in rows] == [tune_model.NOT_CACHED] * 2
    last = out.splitlines()[-1]
    assert last.startswith(f"node cache: {cache_file_here()}: NOT written: IsADirectoryError: "), last
    assert last.endswith("2 of the 2 bucket(s) measured now are not cached, so serving measures them again")
    assert temporaries(tmp_path) == []


def test_a_row_another_writer_merged_away_is_written_again(tmp_path, here, monkeypatch, capsys):
    """The cache has no lock: a concurrent run's merge can drop this run's row. tune reads every row back
    and writes the missing ones again, so the file ends with each bucket it measured."""
    from vllm_flydsl_indexer import tuning
    from vllm_flydsl_indexer.tools import tune_model

    recorded = tune_model.make_paged_problem

    def merged_away(*args, **kwargs):
        if len(here) == 1:  # the first bucket's row, gone as a racing merge would leave the file
            key = cache_file_here().read_text().partition("\n")[0]
            cache_file_here().write_text(f"{key}\n{','.join(tuning.COLUMNS)}\n")
        return recorded(*args, **kwargs)

    monkeypatch.setattr(tune_model, "make_paged_problem", merged_away)
    status, out, _ = tune_here(["--model", "deepseek_v32", "--max-batch", "2"], capsys)
    assert status == 0
    rows = table_rows(out)
    assert [r[6] for r in rows] == [MEASURED] * 2
    with open(cache_file_here(), newline="") as f:
        f.readline()
        assert sorted(int(r["batch_size"]) for r in csv.DictReader(f)) == [1, 2]


def test_a_second_tune_waits_for_the_one_filling_the_cache_then_reads_its_rows(here, monkeypatch, capsys):
    """One lock for every file a tool merges into (``outputs.locked``): while another tune holds the node
    cache's, this one says it waits and measures nothing; once that one has written its row (fresh random
    figures) and let go, this one reads it as cached and measures only the other bucket."""
    import fcntl
    import random
    import threading

    import torch

    from vllm_flydsl_indexer import measure, tuning
    from vllm_flydsl_indexer.tools import outputs
    from vllm_flydsl_indexer.tools.settings import TUNE_MODEL_CPU_MAX_MODEL_LEN

    path, key = cache_file_here(), measure.cache_key(torch.device("cpu"), "gfx950", 1)
    path.parent.mkdir(mode=0o700, parents=True)
    flydsl, gluon = random.uniform(5.0, 10.0), random.uniform(20.0, 50.0)
    context = measure.contexts_of(TUNE_MODEL_CPU_MAX_MODEL_LEN)
    values = ("gfx950", 1, 2, 1, 64, 128, 64, True, context, "flydsl", 0, 0, 0, flydsl, gluon, flydsl)
    held, blocked = threading.Event(), threading.Event()
    real_flock = fcntl.flock

    def flock(fd, operation):  # this thread's blocking wait for the lock, seen by the holder
        if operation == fcntl.LOCK_EX and threading.current_thread() is threading.main_thread():
            assert here == [], "a bucket was built before the lock was held"
            blocked.set()
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)

    def first_tune():
        with outputs.locked(str(path)):
            held.set()
            assert blocked.wait(60), "the second tune never waited for the lock"
            assert measure.write_cache(path, key, [dict(zip(tuning.COLUMNS, values, strict=True))]) is None

    thread = threading.Thread(target=first_tune)
    thread.start()
    assert held.wait(10)
    from vllm_flydsl_indexer.tools import cli

    status = cli.main(["tune", "--model", "deepseek_v32", "--max-batch", "2"])
    thread.join(10)
    out = capsys.readouterr()
    assert status == 0, out.err
    assert (
        f"vllm-flydsl-indexer tune: waiting for another tune that is filling {path}" in out.err.splitlines()
    )
    rows = table_rows(out.out)
    assert rows[0][3] == "1" and rows[0][6] == MEASURED and here == [1, 1]
    assert rows[1] == ["64", "1", "64", "2", "FlyDSL", f"{gluon / flydsl:.2f}x", CACHED]
    assert os.path.exists(outputs.lock_path(str(path)))  # the one lock file, beside the cache it guards


@pytest.mark.parametrize(
    "heads, head_dim, max_batch, says",
    [
        (4096, 16384, None, "--model {model}: heads=4096 head_dim=16384: batch 1 at next_n 1 needs 64 MiB"),
        (1024, 4096, "64", "argument --max-batch: must be at most 8 for heads=1024 head_dim=4096: batch 16"),
    ],
    ids=["nothing fits", "larger batches do not"],
)
def test_a_config_too_large_to_measure_is_refused_before_any_work(
    heads, head_dim, max_batch, says, tmp_path, here, monkeypatch, capsys
):
    """Refused before anything is allocated: a run that got as far as its cache pool or a problem would hold
    gigabytes (issue 50: 19.5 GB, then the OOM killer)."""
    from vllm_flydsl_indexer.tools import tune_model

    for name in ("_pool", "make_paged_problem"):
        monkeypatch.setattr(tune_model, name, lambda *a, name=name, **k: pytest.fail(f"{name} was reached"))
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "deepseek_v32", "index_n_heads": heads, "index_head_dim": head_dim}
    (model / "config.json").write_text(json.dumps(config))
    status, out, err = tune_here(
        ["--model", str(model), *(["--max-batch", max_batch] if max_batch else [])], capsys
    )
    assert (status, out) == (2, "")
    (line,) = err
    assert line.startswith("vllm-flydsl-indexer tune: error: " + says.format(model=model)), line
    assert "over the measurement's 64 MiB" in line
    assert not (tmp_path / "cache").exists()


def test_an_allocation_failure_is_one_line_exit_1(here, monkeypatch, capsys):
    from vllm_flydsl_indexer.tools import tune_model

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 17179869184 bytes."
        )

    monkeypatch.setattr(tune_model, "make_paged_problem", out_of_memory)
    status, _, err = tune_here(["--model", "deepseek_v32", "--max-batch", "1"], capsys)
    assert status == 1
    assert err == [
        "vllm-flydsl-indexer tune: error: out of memory (DefaultCPUAllocator: can't allocate memory: you "
        "tried to allocate 17179869184 bytes.); try a smaller --max-batch or --next-n"
    ]


# -------------------------------------------------------------- issue 50: doctor tells the node cache's state


def doctor_text(environ: dict) -> tuple[dict, list[str]]:
    from vllm_flydsl_indexer.tools import doctor

    data = doctor.report(environ)
    return data, doctor.render(data).split("\n")


def cache_lines(lines: list[str]) -> list[str]:
    """The node cache's lines of doctor's text: from ``uncovered shapes:`` to the blank line after it."""
    start = next(i for i, line in enumerate(lines) if line.startswith("uncovered shapes:"))
    return lines[start : lines.index("", start)]


def test_doctor_tells_each_cache_files_usable_rows_or_the_plugins_reason_to_ignore_it(tmp_path, monkeypatch):
    """Every kind of file the plugin ignores, named with the WARNING text the plugin logs for it (measure.py's
    words), a header-only cache as empty (not ignored), and a good file with its usable rows beside the one
    row the plugin skips."""
    import torch

    from vllm_flydsl_indexer import measure, tuning
    from vllm_flydsl_indexer.tools.settings import TUNE_MODEL_CPU_MAX_MODEL_LEN

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    key = measure.cache_key(torch.device("cpu"), "gfx950", 1)
    good = measure.cache_path("gfx950", 1, key)
    context = measure.contexts_of(TUNE_MODEL_CPU_MAX_MODEL_LEN)
    rows = [
        dict(zip(tuning.COLUMNS, (*head, context, "flydsl", 0, 0, 0, 10.0, 37.0, 10.0), strict=True))
        for head in (("gfx950", 1, 2, 1, 64, 128, 64, True), ("gfx950", 1, 4, 1, 64, 128, 64, True))
    ]
    assert measure.write_cache(good, key, rows) is None
    with open(good, "a") as f:  # a row for a 256-CU GPU in this 1-CU file
        f.write(f"gfx950,256,8,1,64,128,64,True,{context},flydsl,0,0,0,10.0,37.0,10.0\n")
    directory = good.parent

    def named(cus: int, text: str) -> Path:
        import hashlib

        return (
            directory
            / f"paged_mqa_logits_gfx950_{cus}cu_{hashlib.sha256(text.encode()).hexdigest()[:16]}.csv"
        )

    (named(1, "garbage")).write_text("not a key line\nx,y\n")
    (named(2, "empty")).write_bytes(b"")
    (named(3, "binary")).write_bytes(b"\xff\xfe\x00\x01" * 64)
    (named(4, "a directory")).mkdir()
    os.mkfifo(named(5, "a fifo"))
    header_only = named(6, key.replace("cus=1", "cus=6"))
    header_only.write_text(f"{key.replace('cus=1', 'cus=6')}\n{','.join(tuning.COLUMNS)}\n")
    data, lines = doctor_text({"VLLM_CACHE_ROOT": str(tmp_path / "cache")})
    lines = cache_lines(lines)
    assert lines[1] == f"node cache: {directory} (7 file(s); writable)"
    said = {line.split(":", 1)[0].strip(): line for line in lines[2:] if line.startswith("  paged")}
    ignored = [line.removeprefix("    ignored by the plugin: ") for line in lines if line.startswith("    ")]
    assert (
        said[good.name] == f"  {good.name}: 2 usable row(s); keyed on: {key.removeprefix(measure.KEY_PREFIX)}"
    )
    assert f"{good} line 5: a row the lookup cannot use, or for another GPU" in ignored
    assert f"{named(1, 'garbage')} is keyed on another stack ('not a key line')" in ignored
    assert f"{named(2, 'empty')} is keyed on another stack ('')" in ignored
    assert any(w.startswith(f"{named(3, 'binary')}: UnicodeDecodeError: ") for w in ignored), ignored
    assert (
        f"{named(4, 'a directory')}: OSError: {named(4, 'a directory')} is a directory, not a regular file"
        in ignored
    )
    assert any(w.startswith(f"{named(5, 'a fifo')}: OSError: ") for w in ignored), ignored
    assert said[header_only.name] == f"  {header_only.name}: no rows yet"
    assert len(ignored) == 6
    files = {Path(f["path"]).name: f for f in data["node_cache"]["files"]}
    assert files[good.name]["usable_rows"] == 2 and len(files[good.name]["problems"]) == 1


@pytest.mark.parametrize(
    "root, says",
    [
        (lambda tmp: tmp / "a-file", "NotADirectoryError: [Errno 20] Not a directory"),
        (lambda tmp: tmp / ("y" * 300), "File name too long"),
        (lambda tmp: tmp / "loop", "Too many levels of symbolic links"),
        (lambda tmp: "~no-such-user-here", "RuntimeError: Could not determine home directory."),
    ],
    ids=["a regular file", "a long name", "a link loop", "an unknown user"],
)
def test_a_cache_root_that_cannot_be_used_is_one_doctor_line_naming_it_exit_0_strict_1(
    root, says, tmp_path, monkeypatch, capsys
):
    from vllm_flydsl_indexer import envs
    from vllm_flydsl_indexer.tools import doctor

    (tmp_path / "a-file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root(tmp_path)))
    monkeypatch.setenv(envs.SWITCH, "1")  # FlyDSL active in the simulation: only the cache fails --strict
    monkeypatch.delenv(envs.TUNED_CSV, raising=False)
    assert doctor.main(as_json=False, strict=False) == 0
    out = capsys.readouterr()
    (line,) = [line for line in cache_lines(out.out.splitlines()) if line.startswith("node cache:")]
    assert says in line and "VLLM_CACHE_ROOT='" in line and "Traceback" not in out.err, line
    assert doctor.main(as_json=True, strict=True) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["arm"] == "flydsl"
    (strict,) = out.err.splitlines()
    assert strict.startswith("doctor --strict: this node's cache cannot be written (") and says in strict


def test_doctor_judges_a_missing_cache_without_making_it(tmp_path):
    _, lines = doctor_text({"VLLM_CACHE_ROOT": str(tmp_path / "new")})
    assert cache_lines(lines)[1] == f"node cache: {tmp_path}/new/flydsl_indexer (0 file(s); writable)"
    assert not (tmp_path / "new").exists()
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "flydsl_indexer").mkdir(mode=0o777)
    (tmp_path / "new" / "flydsl_indexer").chmod(0o777)
    _, lines = doctor_text({"VLLM_CACHE_ROOT": str(tmp_path / "new")})
    assert cache_lines(lines)[1].endswith(
        f"NOT writable: {tmp_path}/new/flydsl_indexer is not a directory of this user's that only it can "
        f"write (VLLM_CACHE_ROOT='{tmp_path}/new'))"
    )
    assert list((tmp_path / "new" / "flydsl_indexer").iterdir()) == []  # its probe left nothing


def test_an_echoed_newline_stays_inside_its_line_in_doctor_and_tune(tmp_path, here, monkeypatch, capsys):
    from vllm_flydsl_indexer.tools import doctor

    root = tmp_path / "a\nb"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    assert doctor.main(as_json=False, strict=False) == 0
    lines = capsys.readouterr().out.splitlines()
    assert cache_lines(lines)[1] == f"node cache: {tmp_path}/a\\nb/flydsl_indexer (0 file(s); writable)"
    status, out, err = tune_here(["--model", "deepseek_v32", "--max-batch", "1"], capsys)
    assert status == 0, (out, err)
    assert out.splitlines()[-1].startswith(f"node cache: {tmp_path}/a\\nb/flydsl_indexer/"), out


def test_an_empty_cache_root_is_named_as_read(tmp_path):
    """vLLM reads an empty VLLM_CACHE_ROOT as the current directory; the plugin as unset: doctor says so."""
    _, lines = doctor_text({"VLLM_CACHE_ROOT": "", "XDG_CACHE_HOME": str(tmp_path)})
    assert (
        "  note: VLLM_CACHE_ROOT is empty (vLLM reads that as the current directory; the plugin as unset)"
        in (cache_lines(lines))
    )
    assert f"node cache: {tmp_path}/vllm/flydsl_indexer (0 file(s); writable)" in lines


TUNE_VARIABLE, SELFTEST_VARIABLE = "VLLM_FLYDSL_INDEXER_TUNE", "VLLM_FLYDSL_INDEXER_SELFTEST"


@pytest.mark.parametrize(
    "bad",
    [{TUNE_VARIABLE: "on"}, {TUNE_VARIABLE: "2"}, {SELFTEST_VARIABLE: "maybe", TUNE_VARIABLE: "enabled"}],
)
def test_doctors_log_line_is_the_line_register_logs(bad, monkeypatch, target, fresh_register, plugin_log):
    """A malformed VLLM_FLYDSL_INDEXER_TUNE or _SELFTEST: register() adds its warning to its line; doctor's
    "log line" is that line, word for word, and its text shows the note."""
    from vllm_flydsl_indexer import envs

    monkeypatch.setenv(envs.SWITCH, "1")
    monkeypatch.delenv(envs.TUNED_CSV, raising=False)
    for name, value in bad.items():
        monkeypatch.setenv(name, value)
    fresh_register()
    (logged,) = [r.getMessage() for r in plugin_log if r.getMessage().startswith(envs.ACTIVE_LINE)]
    data, lines = doctor_text(dict(os.environ))
    assert data["log_line"] == logged and f"log line: {logged}" in lines
    for name, value in bad.items():
        assert f"{name}={value!r} is not one of" in logged
    assert f"  note: {TUNE_VARIABLE}={bad[TUNE_VARIABLE]!r} is not one of 1/0/true/false" in " ".join(lines)


def test_doctors_text_shows_a_bad_tune_variable_where_register_reads_none(monkeypatch):
    """Switch off: register() logs the bare line, and doctor's text still shows the note --json has."""
    data, lines = doctor_text({TUNE_VARIABLE: "yes please"})
    assert data["node_cache"]["error"] and "[" not in data["log_line"]
    assert f"  note: {data['node_cache']['error']}" in lines


def test_doctor_names_unset_and_off_values_as_they_are(tmp_path):
    _, lines = doctor_text({"VLLM_FLYDSL_INDEXER_TUNED_CSV": "OFF"})
    text = "\n".join(lines)
    assert f"({SELFTEST_VARIABLE} is not set)" in text and "=None" not in text
    assert "no table (VLLM_FLYDSL_INDEXER_TUNED_CSV=OFF)" in text and "TUNED_CSV=none" not in text
