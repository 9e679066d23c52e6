# SPDX-License-Identifier: Apache-2.0
"""Issue 31: first contact is safe. The one file layer (no FIFO hangs, no /dev/zero balloon, no device
clobbered, no two outputs on one file), config.json types, repeated list values, a closed pipe, and
``doctor --model`` without vLLM."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading

import pytest

from conftest import simulation_env
from test_cli import CLI, PACKAGE_ROOT, cli, no_gpu, no_vllm_env, rejected
from test_reach import FIRST_REASON, VLLM
from test_tuning import uncovered_label
from vllm_flydsl_indexer import envs, tuning
from vllm_flydsl_indexer.envs import TABLE_IGNORED_LINE
from vllm_flydsl_indexer.tools import files, outputs, reach, tune
from vllm_flydsl_indexer.tools import tuned as validator

ONE_ROW = {
    "gfx": "gfx950",
    "cu_num": 256,
    "batch_size": 1,
    "next_n": 1,
    "heads": 64,
    "head_dim": 128,
    "kv_block_size": 64,
    "preshuffle": 1,
    "context_len": "1024",
    "backend": "flydsl",
    "ChunkK": 0,
    "WavePerEU": 0,
    "wg_per_cu": 0,
    "us": 1.5,
    "gluon_us": 2.5,
    "flydsl_us": 1.5,
}


def table_text(rows: list[dict]) -> str:
    lines = [",".join(tuning.COLUMNS)] + [",".join(str(r[c]) for c in tuning.COLUMNS) for r in rows]
    return "\n".join(lines) + "\n"


def within(seconds: float, fn, *args):
    """``fn(*args)``'s result or exception, failing the test when it hangs past ``seconds``."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__}{args} hung"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture
def no_work(monkeypatch):
    """The commands' main functions replaced (as in test_cli): records the arguments that reached them."""
    from vllm_flydsl_indexer.tools import bench, check

    reached = []
    for module in (bench, check, tune):
        monkeypatch.setattr(module, "main", lambda args: reached.append(args) or 0)
    return reached


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def assert_dev_null_intact():
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and not os.path.islink("/dev/null")


# ------------------------------------------------------------------ reads


def test_read_refuses_what_is_not_a_regular_file_and_reads_nothing(tmp_path, fifo):
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device"), (tmp_path, "a directory")):
        with pytest.raises(files.FileRefused, match=f"is {kind}, not a regular file"):
            within(10, files.read_text, str(path))
    big = tmp_path / "big.csv"
    big.write_text("x" * 65)
    with pytest.raises(files.FileRefused, match="larger than 64 bytes"):
        files.read_text(str(big), limit=64)
    sparse = tmp_path / "sparse.csv"
    with open(sparse, "wb") as f:
        f.truncate(files.MAX_READ_BYTES + 1)
    with pytest.raises(files.FileRefused, match="larger than"):
        files.read_text(str(sparse))
    link = tmp_path / "link.csv"
    text = f"{os.urandom(8).hex()}\n"
    (tmp_path / "real.csv").write_text(text)
    link.symlink_to(tmp_path / "real.csv")
    assert files.read_text(str(link)) == text
    assert files.read_text(str(big), limit=65) == "x" * 65


@pytest.mark.parametrize("which", ["fifo", "/dev/zero", "oversized", "directory"])
def test_the_plugin_ignores_such_a_table_with_one_warning(which, tmp_path, fifo, caplog, monkeypatch):
    path = {"fifo": str(fifo), "/dev/zero": "/dev/zero", "directory": str(tmp_path)}.get(which)
    if which == "oversized":
        path = str(tmp_path / "big.csv")
        with open(path, "w") as f:
            f.write(table_text([ONE_ROW]))
            f.truncate(files.MAX_READ_BYTES + 1)
    logger = logging.getLogger("test_files.tuning")
    monkeypatch.setenv(envs.TUNED_CSV, path)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        table, label = within(10, tuning.load, "general", "gfx950", logger)  # the plugin's capped read
    assert table is None and uncovered_label(label), label
    (record,) = caplog.records
    assert record.getMessage().startswith(f"{TABLE_IGNORED_LINE} {path}: OSError: ")
    kind = {"fifo": "a FIFO", "/dev/zero": "a character device", "directory": "a directory"}.get(which)
    assert record.getMessage().endswith(
        f"{path} is {kind}, not a regular file; trying the next source"
        if which != "oversized"
        else f"{path} is larger than {files.MAX_READ_BYTES} bytes; trying the next source"
    ), record.getMessage()


def test_a_socket_is_named_in_the_same_words_by_the_plugin_doctor_and_bench(tmp_path, monkeypatch):
    """Issue 45 item 16: a socket named as the table said "No such device or address" to the plugin and
    doctor (a socket cannot be opened) and "is a socket" to bench --tune. One set of words now."""
    import socket

    path = str(tmp_path / "table.csv")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        said = "is a socket, not a regular file"
        from vllm_flydsl_indexer.target import read_capped

        with pytest.raises(OSError, match=said):
            read_capped(path)
        assert said in tuning.read(path, "gfx950")  # the plugin's reader, which doctor reports
        with pytest.raises(files.FileRefused, match=said):
            files.read_text(path)  # the tools' reader
        assert said in (outputs.kind_problem(path) or "")  # bench's up-front check of --tune and outputs


def test_a_regular_table_through_a_link_still_loads(tmp_path):
    real = tmp_path / "t.csv"
    real.write_text(table_text([ONE_ROW]))
    (tmp_path / "link.csv").symlink_to(real)
    table = tuning.read(str(tmp_path / "link.csv"), "gfx950")
    assert table.skipped == 0 and table.choice(256, 1, 1, 64, 128, 64) == ("flydsl", 1, 0, None)


@pytest.mark.slow
def test_doctor_reports_a_fifo_table_and_ray_file_as_ignored_and_exits_0(tmp_path, fifo):
    root = tmp_path / "vllm_config"
    root.mkdir()
    os.mkfifo(root / "ray_non_carry_over_env_vars.json")
    env = simulation_env(**{envs.TUNED_CSV: str(fifo), "VLLM_CONFIG_ROOT": str(root)})
    done = cli(["doctor", "--json"], env, timeout=120)  # a hang fails here
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    # doctor reads the table as the plugin does (one capped read): the plugin's words.
    note = data["tuned_table"]["note"]
    assert note.startswith("IGNORED: ") and f"{fifo} is a FIFO, not a regular file" in note, note
    assert "a FIFO, not a regular file" in data["ray_non_carry_over"]["note"]
    zero = cli(["doctor"], {**env, envs.TUNED_CSV: "/dev/zero"}, timeout=120)
    assert (
        zero.returncode == 0
        and "IGNORED: /dev/zero: OSError: /dev/zero is a character device, not a regular file" in zero.stdout
    )


# ------------------------------------------------------------------ writes


def test_a_device_node_is_refused_as_an_output_and_left_a_device(no_work, monkeypatch, capsys):
    no_gpu(monkeypatch)
    for flag in ("--json", "--csv", "--tune"):
        argv = ["bench", flag, "/dev/null"] + (["--reference"] if flag == "--tune" else [])
        line = rejected(argv, capsys)
        assert line.startswith(f"vllm-flydsl-indexer bench: error: argument {flag}: /dev/null is a character")
        assert_dev_null_intact()
    assert rejected(["bench", "--tune", "/dev/zero", "--reference"], capsys).endswith("give a file path")
    line = rejected(["tune", "--out", "/dev/null", "--reference"], capsys)
    assert line == (
        "vllm-flydsl-indexer tune: error: argument --out: /dev/null is a character device, not a regular "
        "file; give a file path"
    )
    assert no_work == []
    assert_dev_null_intact()


def test_a_fifo_output_is_refused_before_any_work_without_hanging(tmp_path, fifo):
    done = cli(["bench", "--device", "cpu", "--csv", str(fifo)], simulation_env(), timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert (
        line
        == f"vllm-flydsl-indexer bench: error: argument --csv: {fifo} is a FIFO, not a regular file; "
        + ("give a file path")
    )
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_two_outputs_on_one_file_are_refused_under_any_spelling(tmp_path, no_work, monkeypatch, capsys):
    no_gpu(monkeypatch)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    (tmp_path / "t.csv").write_text(table_text([ONE_ROW]))
    (tmp_path / "link.json").symlink_to(tmp_path / "out.json")
    before = (tmp_path / "t.csv").read_text()
    cases = [
        (["--json", "../out.json", "--csv", "./../out.json"], "--csv"),
        (["--json", str(tmp_path / "link.json"), "--csv", "../out.json"], "--csv"),
        (["--tune", "../t.csv", "--reference", "--json", str(tmp_path / "sub" / ".." / "t.csv")], "--tune"),
        (["--out", str(tmp_path / "link.json"), "--reference", "--json", "../out.json"], "--out"),
    ]
    for argv, flag in cases:
        command = "tune" if argv[0] == "--out" else "bench"
        line = rejected([command, *argv], capsys)
        assert line.startswith(f"vllm-flydsl-indexer {command}: error: argument {flag}: "), line
        assert "writes too; give each output its own file" in line
    assert (tmp_path / "t.csv").read_text() == before and not (tmp_path / "out.json").exists()
    assert no_work == []
    from vllm_flydsl_indexer.tools import cli as cli_mod

    assert cli_mod.main(["bench", "--json", "../a.json", "--csv", "../a.csv"]) == 0 and len(no_work) == 1


def test_plot_extension_matplotlib_cannot_write_is_refused(tmp_path, no_work, monkeypatch, capsys):
    import types

    canvas = types.SimpleNamespace(get_supported_filetypes=lambda: {"png": "PNG", "pdf": "PDF", "svg": "SVG"})
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    monkeypatch.setitem(
        sys.modules, "matplotlib.backend_bases", types.SimpleNamespace(FigureCanvasBase=canvas)
    )
    line = rejected(["bench", "--device", "cpu", "--plot", str(tmp_path / "plot.txt")], capsys)
    assert line == (
        "vllm-flydsl-indexer bench: error: argument --plot: matplotlib cannot write .txt files; "
        "accepted: pdf, png, svg"
    )
    from vllm_flydsl_indexer.tools import cli as cli_mod

    for name in ("plot.PDF", "plot"):
        assert cli_mod.main(["bench", "--device", "cpu", "--plot", str(tmp_path / name)]) == 0
    assert [a.plot_path for a in no_work] == [str(tmp_path / "plot.PDF"), str(tmp_path / "plot")]


def test_a_write_goes_through_a_link_and_keeps_it(tmp_path, fifo):
    real = tmp_path / "real.csv"
    real.write_text("old\n")
    real.chmod(0o640)
    link = tmp_path / "link.csv"
    link.symlink_to(real)
    text = f"{os.urandom(8).hex()}\n"
    outputs.write_atomic(str(link), text)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == text and stat.S_IMODE(real.stat().st_mode) == 0o640
    with pytest.raises(files.FileRefused, match="a FIFO"):
        within(10, outputs.write_atomic, str(fifo), text)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.csv", "real.csv"]


def test_an_oversized_tune_file_is_refused_before_any_work(tmp_path, no_work, monkeypatch, capsys):
    no_gpu(monkeypatch)
    big = tmp_path / "t.csv"
    with open(big, "w") as f:
        f.write(table_text([ONE_ROW]))
        f.truncate(files.MAX_READ_BYTES + 1)
    for command, flag in (("bench", "--tune"), ("tune", "--out")):
        line = rejected([command, flag, str(big), "--reference"], capsys)
        assert line.startswith(f"vllm-flydsl-indexer {command}: error: argument {flag}: cannot read ")
        assert "larger than" in line
    assert no_work == [] and big.stat().st_size == files.MAX_READ_BYTES + 1


# ------------------------------------------------------------------ repeated values, one row per key


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["bench", "--tune", "t.csv", "--reference", "--batch", "1,1"], "--batch"),
        (["tune", "--out", "t.csv", "--reference", "--heads", "32,64,32"], "--heads"),
        (["bench", "--heads", "32,64,032"], "--heads"),
        (["bench", "--block-size", "64,1,64"], "--block-size"),
        (["bench", "--arms", "gluon,gluon"], "--arms"),
        (["check", "--next-n", "2,2"], "--next-n"),
    ],
)
def test_a_repeated_list_value_is_refused(argv, flag, tmp_path, no_work, monkeypatch, capsys):
    no_gpu(monkeypatch)
    monkeypatch.chdir(tmp_path)
    line = rejected(argv, capsys)
    assert line.startswith(
        f"vllm-flydsl-indexer {argv[0]}: error: argument {flag}: must list each value once"
    )
    assert no_work == [] and list(tmp_path.iterdir()) == []


def test_a_tuned_table_never_gets_two_rows_of_one_key():
    first = dict(ONE_ROW, us=3.0, flydsl_us=3.0)
    later = dict(ONE_ROW, backend="gluon", ChunkK=16, WavePerEU=2, us=2.0)
    other = dict(ONE_ROW, batch_size=8)
    text, kept = tune.table_text(None, [first, other, later])
    rows = list(validator.read_rows(text.splitlines(keepends=True), "t.csv"))
    # the later measurement of batch 1 replaces the earlier one; batch 8 is another key
    assert kept == 0 and sorted((r.batch, r.backend) for r in rows) == [(1, "gluon"), (8, "flydsl")]


# ------------------------------------------------------------------ a closed pipe


@pytest.mark.slow
def test_a_closed_pipe_exits_quietly():
    env = simulation_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], PACKAGE_ROOT])
    proc = subprocess.Popen(CLI + ["doctor"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader went away before the first line
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err.decode() and "BrokenPipeError" not in err.decode(), err.decode()[-2000:]
    assert proc.returncode == 141


# ------------------------------------------------------------------ config.json and --model names


BAD_CONFIGS = [
    ({"model_type": ["deepseek_v32"]}, "model_type", "one of deepseek_v32"),
    ({"model_type": "deepseek_v32", "index_n_heads": "64"}, "index_n_heads", "an integer in [1, "),
    ({"model_type": "deepseek_v32", "index_n_heads": float("nan")}, "index_n_heads", "an integer"),
    ({"model_type": "deepseek_v32", "index_head_dim": 1e400}, "index_head_dim", "an integer"),
    ({"model_type": "deepseek_v32", "index_head_dim": True}, "index_head_dim", "an integer"),
    ({"model_type": "deepseek_v32", "index_head_dim": 128.0}, "index_head_dim", "an integer"),
    ([1, 2], "", "not a JSON object"),
]


@pytest.mark.parametrize("config, field, accepted", BAD_CONFIGS, ids=[str(c[0]) for c in BAD_CONFIGS])
@pytest.mark.parametrize("command", ["doctor", "check"])
def test_a_config_field_of_the_wrong_type_is_one_line_exit_2(
    config, field, accepted, command, tmp_path, no_work, monkeypatch, capsys
):
    no_gpu(monkeypatch)
    (tmp_path / "config.json").write_text(json.dumps(config).replace("Infinity", "1e400"))
    line = rejected([command, "--model", str(tmp_path)], capsys)
    assert (
        line.startswith(f"vllm-flydsl-indexer {command}: error: ") and str(tmp_path / "config.json") in line
    )
    assert (f"field {field} is " in line if field else True) and accepted in line, line
    assert no_work == []


def test_a_fifo_config_json_is_refused_without_hanging(tmp_path, no_work, monkeypatch, capsys):
    os.mkfifo(tmp_path / "config.json")
    line = within(30, rejected, ["doctor", "--model", str(tmp_path)], capsys)
    assert "no readable config.json" in line and "a FIFO" in line


def test_check_and_doctor_take_the_same_model_names(tmp_path, no_work, monkeypatch):
    from vllm_flydsl_indexer.tools import cli as cli_mod

    no_gpu(monkeypatch)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa"}))
    names = [*reach.MODELS, *reach.SHAPE_MODEL_TYPES, str(tmp_path)]
    for name in names:
        assert cli_mod.main(["check", "--model", name]) == 0
        model_type, _ = reach.resolve(name)  # doctor's
        model = reach.MODELS[model_type]
        shape = {"deepseek-v3.2": (64, 128), "glm-5": (32, 128)}[no_work[-1].model]
        assert shape == (model.heads, model.head_dim), name
    assert [a.model for a in no_work[-3:]] == ["deepseek-v3.2", "glm-5", "glm-5"]


# ------------------------------------------------------------------ doctor --model without vLLM


@pytest.mark.slow
def test_doctor_model_without_vllm_answers_from_the_package(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "index_n_heads": 32}))
    for model in [*reach.MODELS, str(tmp_path)]:
        done = cli(["doctor", "--model", model], no_vllm_env(), timeout=120)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        lines = [line for line in done.stdout.splitlines() if line.startswith("  no vLLM here:")]
        assert len(lines) == 1 and "could not be read from a vLLM" in lines[0], done.stdout
        data = json.loads(cli(["doctor", "--json", "--model", model], no_vllm_env(), timeout=120).stdout)
        model_type = data["model"]["model_type"]
        assert data["model"]["not_read_from_vllm"] and data["versions"]["vllm"] == "not installed"
        expected = FIRST_REASON[model_type]
        assert data["model"]["allows_flydsl"] is (expected is None), model_type
        if expected is not None:
            assert data["model"]["reason"].startswith(expected), data["model"]["reason"]


@pytest.mark.parametrize("model_type", list(reach.MODELS))
def test_the_pinned_answers_are_the_installed_vllms(model_type):
    """What doctor --model says without a vLLM is what vLLM 0.33.0 and 0.34.0 resolve."""
    model = reach.MODELS[model_type]
    assert reach.resolved_layout(model.backends) == (model.layout, model.layout == reach.LAYER_CONTIGUOUS)
    if not VLLM.startswith("0.32."):
        assert reach.mxfp4_default_models() == reach.PINNED_MXFP4_MODELS
    data = reach.assess(model_type, None, type("Off", (), {"active": True, "variant": None, "reason": ""}))
    assert data["not_read_from_vllm"] == []


# ------------------------------------------------------------------ check's tables fit 120 columns


def test_a_wide_table_wraps_its_widest_columns_and_keeps_every_word():
    import random

    from vllm_flydsl_indexer.tools.table import WIDTH, format_table

    rng = random.Random(os.urandom(4))

    def words(n):
        return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))

    rows = [("case", "calls", "expected", "result")] + [
        (f"case {i} {words(10)}", words(rng.randrange(8, 12)), words(rng.randrange(8, 12)), "PASS")
        for i in range(6)
    ]
    lines = format_table(rows)
    assert min(len("  ".join(r)) for r in rows[1:]) > WIDTH == 120  # each row too wide unwrapped
    assert max(map(len, lines)) <= WIDTH
    firsts = [line for line in lines[2:] if line.endswith("PASS")]
    assert [line.split("  ")[0] for line in firsts] == [r[0] for r in rows[1:]]  # the key column never wraps
    assert sorted(" ".join(lines[2:]).split()) == sorted(" ".join(" ".join(r) for r in rows[1:]).split())


# ------------------------------------------------------------------ outputs and the shell


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_an_output_that_is_the_commands_own_stdout_or_stderr_is_refused(tmp_path, stream):
    """``bench --json /dev/stdout > log.txt``: the rename would replace log.txt and lose the report."""
    log = tmp_path / "log.txt"
    log.write_text("earlier\n")
    for flag, path in (("--json", f"/dev/{stream}"), ("--csv", str(log))):
        with open(log, "a") as redirected:
            done = subprocess.run(
                [*CLI, "bench", "--device", "cpu", "--reference", flag, path],
                env={**no_vllm_env(), "PYTHONPATH": f"{no_vllm_env()['PYTHONPATH']}:{PACKAGE_ROOT}"},
                stdout=redirected if stream == "stdout" else subprocess.PIPE,
                stderr=redirected if stream == "stderr" else subprocess.PIPE,
                text=True,
                timeout=120,
            )
        err = log.read_text().removeprefix("earlier\n") if stream == "stderr" else done.stderr
        assert done.returncode == 2, err
        (line,) = err.splitlines()
        name = {"stdout": "standard output", "stderr": "standard error"}[stream]
        assert f"argument {flag}: {path} is this command's {name}" in line, line
        assert log.read_text().startswith("earlier\n")  # still the shell's file, never replaced
        log.write_text("earlier\n")


def test_a_symlink_to_a_new_file_is_one_behaviour_for_every_output(tmp_path, no_work, monkeypatch, capsys):
    """A link whose target does not exist yet is a new file for --json, --csv, --tune and --out alike."""
    from vllm_flydsl_indexer.tools import cli as cli_mod

    no_gpu(monkeypatch)
    link = tmp_path / "out.x"
    link.symlink_to(tmp_path / "target.x")
    for flag in ("--json", "--csv", "--tune"):
        argv = ["bench", "--device", "cpu", flag, str(link)] + (["--reference"] if flag == "--tune" else [])
        assert cli_mod.main(argv) == 0, capsys.readouterr().err
        assert getattr(no_work[-1], {"--json": "json_path", "--csv": "csv_path", "--tune": "tune_path"}[flag])
    assert cli_mod.main(["tune", "--out", str(link), "--reference"]) == 0 and no_work[-1].command == "tune"
    assert len(no_work) == 4 and link.is_symlink() and not (tmp_path / "target.x").exists()
    outputs.write_atomic(str(link), "new\n")
    assert link.is_symlink() and (tmp_path / "target.x").read_text() == "new\n"
    dangling = tmp_path / "d.json"
    dangling.symlink_to(tmp_path / "missing" / "t.json")
    for flag in ("--json", "--tune"):  # a target that cannot be created: one line, whatever the output
        argv = ["bench", "--device", "cpu", flag, str(dangling)] + (
            ["--reference"] if flag == "--tune" else []
        )
        assert f"argument {flag}: cannot open {dangling} for writing" in rejected(argv, capsys)
    line = rejected(["tune", "--out", str(dangling), "--reference"], capsys)
    assert line.startswith(
        f"vllm-flydsl-indexer tune: error: argument --out: cannot open {dangling} for writing"
    )


def test_bench_help_says_what_every_output_accepts(capsys):
    from vllm_flydsl_indexer.tools import cli as cli_mod

    with pytest.raises(SystemExit):
        cli_mod.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert " ".join(outputs.OUTPUT_RULE.split()) in text


def test_a_table_whose_words_alone_are_too_wide_still_fits_by_breaking_them_after_a_slash():
    """check's first table at its default sizes: numbers such as 6197/6197 leave no space to wrap at,
    so they wrap after the '/', and a number itself is never broken (issue 45: ``11640/1164``, ``0``)."""
    import random

    from vllm_flydsl_indexer.tools.table import WIDTH, format_table

    rng = random.Random(os.urandom(4))

    def word(n):
        return "/".join(str(rng.randrange(10**4, 10**5)) for _ in range(n))

    header = ("case", *(f"c{i}" for i in range(8)))
    rows = [header] + [
        (f"key {i} {word(5)}", *(word(rng.randrange(2, 4)) for _ in range(8))) for i in range(5)
    ]
    assert len(rows[1][0]) + sum(max(len(r[c]) for r in rows) for c in range(1, 9)) + 16 > WIDTH
    lines = format_table(rows)
    assert max(map(len, lines)) <= WIDTH, lines
    firsts = [line for line in lines[2:] if line.startswith("key ")]
    assert [line[: len(r[0])] for line, r in zip(firsts, rows[1:], strict=True)] == [r[0] for r in rows[1:]]
    # Every character of every cell is still there, in order, column by column, each line's piece of a
    # cell ending at a '/' or at the cell's end: no number is cut.
    starts = [sum(len(x) + 2 for x in lines[1].split()[:k]) for k in range(9)]
    ends = [*starts[1:], None]
    pieces = {c: [line[starts[c] : ends[c]].strip() for line in lines[2:]] for c in range(1, 9)}
    assert all("".join(pieces[c]) == "".join(r[c] for r in rows[1:]) for c in range(1, 9))
    cells = {r[c] for r in rows[1:] for c in range(1, 9)}
    numbers = {n for cell in cells for n in cell.split("/")}
    for c in range(1, 9):
        for piece in filter(None, pieces[c]):
            assert all(n in numbers for n in piece.strip("/").split("/")), (piece, lines)


def test_checks_read_written_column_never_breaks_a_number():
    """The issue's case: ``11640/11640`` beside a wide key read as ``11640/1164`` and ``0``."""
    from vllm_flydsl_indexer.tools.table import format_table

    rows = [("case", "read/ written", "max rel diff", "result")]
    rows += [("a case label " * 8, "11640/11640", "0.00e+00", "PASS")] * 7
    lines = format_table(rows)
    text = "\n".join(lines)
    assert "11640/1164\n" not in text + "\n" and "1164 " not in text
    body = lines[lines.index(next(line for line in lines if line.startswith("---"))) + 1 :]
    assert text.count("11640/") == 7 and len(body) == 14
    assert body[0::2] == [line for line in body if "11640/ " in line and line.endswith("PASS")], lines
    assert [line.split() for line in body[1::2]] == [["11640"]] * 7, lines


def test_two_outputs_that_are_hard_links_of_one_file_are_refused(tmp_path, no_work, monkeypatch, capsys):
    """Two names of one inode are one file, whatever their paths say (issue 37)."""
    no_gpu(monkeypatch)
    first = tmp_path / "a.json"
    first.write_text("{}\n")
    os.link(first, tmp_path / "b.csv")
    line = rejected(["bench", "--json", str(first), "--csv", str(tmp_path / "b.csv")], capsys)
    assert line.startswith("vllm-flydsl-indexer bench: error: argument --csv: "), line
    assert "writes too; give each output its own file" in line
    assert first.read_text() == "{}\n" and no_work == []


def test_a_huge_file_is_refused_with_bounded_memory(tmp_path):
    """A 1 GiB (sparse) file is refused after reading at most the cap plus one byte (issue 37)."""
    import tracemalloc

    huge = tmp_path / "huge.csv"
    with open(huge, "wb") as f:
        f.truncate(1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(files.FileRefused, match="larger than"):
            files.read_text(str(huge))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 2 * files.MAX_READ_BYTES, peak
