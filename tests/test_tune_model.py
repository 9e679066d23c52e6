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
        assert f.readline().startswith("# vllm-flydsl-indexer node cache keyed on: format=2 device=cpu")
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
        ([], "the following arguments are required: --model"),
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
    assert "--max-batch B" in done.stdout and "CUDA-graph capture sizes" in done.stdout


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
