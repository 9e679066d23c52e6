# SPDX-License-Identifier: Apache-2.0
"""doctor, check, bench and tune, on three simulated machines."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_flydsl_indexer
from conftest import DOUBLES, simulation_env
from vllm_flydsl_indexer import envs

CLI = [sys.executable, "-m", "vllm_flydsl_indexer"]
# The package under test, also in subprocesses (whatever copy the venv has installed).
PACKAGE_ROOT = str(Path(vllm_flydsl_indexer.__file__).resolve().parents[1])


def cli(args, env, timeout=300, cwd=None):
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [env.get("PYTHONPATH"), PACKAGE_ROOT]))}
    return subprocess.run(CLI + args, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def no_vllm_env(**extra):
    env = simulation_env(rocm=False, aiter=False, **extra)
    env["PYTHONPATH"] = str(DOUBLES / "hide_vllm")
    return env


STOCK_COPY = "stock:   this package's stock copy of vLLM's gfx950 branches"
GATE_NAMES = ["switch", "in-tree", "vllm", "rocm", "gfx950", "aiter", "kernel", "target"]


def test_doctor_on_simulated_gfx950_reports_flydsl_and_strict_passes():
    env = simulation_env(**{envs.SWITCH: "1"})
    # --strict prints the same report (two doctor runs, not three: each imports vLLM, ~15 s on 2 cores).
    text = cli(["doctor", "--strict"], env)
    assert text.returncode == 0, text.stderr[-2000:]
    assert "arm:      FlyDSL" in text.stdout
    assert "FlyDSL paged MQA logits ACTIVE" in text.stdout
    data = json.loads(cli(["doctor", "--json"], env).stdout)
    assert [g["name"] for g in data["gates"]] == GATE_NAMES
    assert all(g["ok"] for g in data["gates"])
    assert data["arm"] == "flydsl" and data["platform"]["gcn_arch"] == "gfx950"
    assert data["versions"]["vllm"] == f"{importlib.metadata.version('vllm')} (vllm)"


@pytest.mark.slow
def test_doctor_switch_off_on_gfx950_reports_every_gate_and_strict_fails():
    env = simulation_env(**{envs.SWITCH: "maybe"})
    data = json.loads(cli(["doctor", "--json"], env).stdout)
    assert data["arm"] == "stock"
    assert data["switch"] == {
        "name": envs.SWITCH,
        "value": "maybe",
        "parsed": False,
        "enabled": False,
        "error": data["switch"]["error"],
    }
    assert "1/0/true/false" in data["switch"]["error"]
    assert [g["ok"] for g in data["gates"]] == [False, True, True, True, True, True, True, True]
    strict = cli(["doctor", "--strict"], env)
    assert strict.returncode == 1 and "would not be active" in strict.stderr
    text = cli(["doctor"], env).stdout
    # Once on gate 1, and once in the log line, printed exactly as the plugin logs it; the rest points there.
    assert text.count(data["switch"]["error"]) == 2, text
    assert text.count("'maybe'") == 2, text
    assert f"\nlog line: {data['log_line']}\n" in text and data["switch"]["error"] in data["log_line"]
    assert "<gate" not in text
    # The answer first: the arm and its one reason, then the log line; the details follow.
    assert text.startswith(
        f"arm:      stock (Gluon)  (gate 1, switch, below)\nlog line: {data['log_line']}\n"
    )


@pytest.mark.slow
def test_doctor_names_the_aiter_gate_and_imports_no_aiter():
    env = simulation_env(**{envs.SWITCH: "1", "VLLM_ROCM_USE_AITER": "0"})
    data = json.loads(cli(["doctor", "--json"], env).stdout)
    gates = {g["name"]: g for g in data["gates"]}
    assert not gates["aiter"]["ok"] and not gates["aiter"]["skipped"]
    assert (
        data["reason"]
        == gates["aiter"]["detail"]
        == "VLLM_ROCM_USE_AITER is not 1, so vLLM does not use aiter"
    )
    assert (
        gates["kernel"]["skipped"]
        and gates["kernel"]["detail"] == "aiter not imported (the aiter gate failed)"
    )
    assert data["arm"] == "stock"


@pytest.mark.slow
def test_doctor_with_vllm_but_not_rocm():
    env = simulation_env(rocm=False, aiter=False, **{envs.SWITCH: "1"})
    data = json.loads(cli(["doctor", "--json"], env).stdout)
    assert data["arm"] == "stock"
    assert data["reason"].startswith("not ROCm")
    assert data["platform"]["gcn_arch"] is None
    skipped = {g["name"]: g["detail"] for g in data["gates"] if g["skipped"]}
    # aiter is not imported where vLLM would not import it: each skipped gate names the gate that stopped it.
    assert skipped == {
        "gfx950": "the rocm gate failed",
        "aiter": "the rocm gate failed",
        "kernel": "aiter not imported (the rocm gate failed)",
    }
    assert not any(g["ok"] for g in data["gates"] if g["skipped"])
    text = cli(["doctor"], env)
    assert text.returncode == 0
    assert "  5. gfx950  skipped (the rocm gate failed)" in text.stdout
    assert "FAIL not checked" not in text.stdout
    # Stock here is vLLM's path for this platform, not Gluon.
    assert data["stock"].startswith("not a ROCm gfx950 GPU")
    assert text.stdout.startswith(
        "arm:      stock (not a ROCm gfx950 GPU: vLLM's own path for this platform, not Gluon)  ("
    )
    assert "stock (Gluon)" not in text.stdout
    assert cli(["doctor", "--strict"], env).returncode == 1


@pytest.mark.slow
def test_doctor_without_vllm():
    env = no_vllm_env(**{envs.SWITCH: "1"})
    text = cli(["doctor"], env)
    assert text.returncode == 0, text.stderr[-2000:]
    assert text.stdout.startswith("arm:      stock (vLLM not installed)  (gate 3, vllm, below)\n")
    assert "(FlyDSL inactive: vLLM is not installed)" in text.stdout and "Gluon" not in text.stdout
    data = json.loads(cli(["doctor", "--json"], env).stdout)
    assert data["versions"]["vllm"] == "not installed"
    assert data["versions"]["aiter"] == "not installed"
    assert data["platform"]["vllm_platform"] == "vLLM not installed"
    assert data["reason"] == "vLLM is not installed"
    assert cli(["doctor", "--strict"], env).returncode == 1


@pytest.mark.parametrize("machine", ["gfx950-sim", "no-rocm", "no-vllm"])
@pytest.mark.slow_except("no-vllm")
def test_check_passes_with_reference_arms_and_says_so(machine):
    env = {"gfx950-sim": simulation_env(), "no-rocm": simulation_env(rocm=False), "no-vllm": no_vllm_env()}[
        machine
    ]
    proc = cli(["check", "--batch", "2", "--context-len", "512"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "reference contracts (pure torch; NOT the real kernels)" in proc.stdout
    stock = {
        "gfx950-sim": "stock:   vLLM's own vllm.v1.attention.ops.rocm_aiter_mla_sparse.rocm_fp8_paged_mqa",
        "no-rocm": f"{STOCK_COPY} (vLLM does not report gfx950",
        "no-vllm": f"{STOCK_COPY} (vLLM unavailable",
    }[machine]
    assert stock in proc.stdout
    assert proc.stdout.splitlines()[-1] == "60 passed, 0 failed (reference contracts, not the real kernels)"
    assert proc.stdout.count("PASS") == 60
    assert "router behaviour, a fresh router per case and API" in proc.stdout
    assert "even where real kernels exist" in proc.stdout
    assert "check [" in proc.stderr  # progress bar
    if machine == "no-vllm":  # a fresh venv's, as the README's example is: each of its lines is real output
        example = readme_check_example()
        assert example[-1] == proc.stdout.splitlines()[-1], example[-1]
        assert [line for line in example if line not in proc.stdout.splitlines()] == []


def readme_check_example() -> list[str]:
    """The lines of the README's example of ``check`` in a fresh venv, but its ``...``."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("### check:", 1)[1].split("```\n", 2)[1]
    return [line for line in block.splitlines() if line != "..."]


@pytest.mark.slow
def test_check_fails_on_disagreement(monkeypatch, capsys):
    """A FlyDSL arm that is wrong must turn check red."""
    from vllm_flydsl_indexer.tools import arms, check
    from vllm_flydsl_indexer.tools import cli as cli_mod

    real_detect = arms.detect_arms

    def wrong(*a, **k):
        out = arms.flydsl_contract_reference(*a, **k)
        out.add_(1.0)
        return out

    def detect(device, force_reference=False):
        found = real_detect(device, force_reference)
        found.flydsl = wrong
        return found

    monkeypatch.setattr(check, "detect_arms", detect)
    rc = cli_mod.main(
        [
            "check",
            "--batch",
            "2",
            "--context-len",
            "256",
            "--model",
            "glm-5",
            "--next-n",
            "2",
            "--block-size",
            "64",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr()
    assert rc == 1
    assert "FAIL GLM-5.x/DSV4.1 KVB=64 preshuffle next_n=2" in out.out


def test_bench_cpu_reference_arms_json_csv(tmp_path):
    j, c = tmp_path / "b.json", tmp_path / "b.csv"
    proc = cli(
        [
            "bench",
            "--batch",
            "2",
            "--context-len",
            "1024",
            "--heads",
            "32",
            "--next-n",
            "2",
            "--block-size",
            "64",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--json",
            str(j),
            "--csv",
            str(c),
        ],
        no_vllm_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(j.read_text())
    arms_run = {r["arm"]: r for r in data["results"]}
    assert set(arms_run) == {"stock-call[ref]", "patched-call[ref]", "reference"}
    for r in arms_run.values():
        assert r["status"] == "timed"
        assert 0 < r["min_us"] <= r["median_us"] <= r["max_us"]
        assert r["kv_mb"] == pytest.approx(2 * 1024 * 132 / 1e6)
    assert data["meta"]["device"] == "cpu"
    assert c.read_text().count("\n") == 4
    lines = proc.stdout.splitlines()
    assert f"bench: wrote JSON to {j}" in lines and f"bench: wrote CSV to {c}" in lines
    assert "CPU timings show the harness working, not kernel speed" in proc.stdout


def test_bench_names_every_file_it_writes(tmp_path, monkeypatch):
    from argparse import Namespace

    from vllm_flydsl_indexer.tools import bench

    monkeypatch.chdir(tmp_path)
    drawn = []
    monkeypatch.setattr(bench, "plot", lambda results, meta, path: drawn.append(path))
    result = bench.ArmResult(dict(bench.Shape(32, 128, 64, 1, 1, 1024).__dict__), "reference", False, "timed")
    args = Namespace(json_path="r.json", csv_path="r.csv", plot_path="r.png")
    lines, failed = bench.write_outputs([result], {"device": "cpu"}, args)
    assert failed == []
    assert lines == [
        f"bench: wrote JSON to {tmp_path / 'r.json'}",
        f"bench: wrote CSV to {tmp_path / 'r.csv'}",
        f"bench: wrote the plot to {tmp_path / 'r.png'}",
    ]
    assert drawn == ["r.png"] and (tmp_path / "r.json").exists() and (tmp_path / "r.csv").exists()


def test_bench_skips_pools_and_logits_over_two_gib():
    from vllm_flydsl_indexer.tools.bench import Shape

    # Shape(heads, head_dim, block_size, next_n, batch, context_len)
    big = Shape(64, 128, 64, 1, 128, 131072)
    assert big.skipped(None) == "skipped: KV pool >= 2 GiB (FlyDSL i32 offsets)"
    assert Shape(64, 128, 64, 1, 32, 131072).skipped(None) is None
    # A fixed --pool-blocks pool is not the grid's to refuse; a logits buffer over 2 GiB always is.
    assert Shape(64, 128, 64, 1, 128, 131072).skipped(64) is None
    assert Shape(64, 128, 64, 2, 2048, 131072).skipped(64) == "skipped: logits buffer >= 2 GiB"


@pytest.mark.slow
def test_python_m_entry_and_console_script_agree():
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-flydsl-indexer")
    env = no_vllm_env()
    env["PYTHONPATH"] += os.pathsep + PACKAGE_ROOT  # the package under test, as cli() runs it
    a = subprocess.run([exe, "doctor", "--json"], env=env, capture_output=True, text=True)
    b = cli(["doctor", "--json"], no_vllm_env())
    assert a.returncode == b.returncode == 0
    assert json.loads(a.stdout)["reason"] == json.loads(b.stdout)["reason"]


# ---------------------------------------------------------------- bad input: one line, before any work


@pytest.fixture
def no_work(monkeypatch):
    """The commands' main functions replaced: records the arguments that reached them."""
    from vllm_flydsl_indexer.tools import bench, check, tune

    reached = []

    def record(args):
        reached.append(args)
        return 0

    monkeypatch.setattr(check, "main", record)
    monkeypatch.setattr(bench, "main", record)
    monkeypatch.setattr(tune, "main", record)
    return reached


def no_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def rejected(argv, capsys) -> str:
    """Run the CLI on ``argv``; assert exit 2 with one stderr line and return that line."""
    from vllm_flydsl_indexer.tools import cli as cli_mod

    with pytest.raises(SystemExit) as exit_info:
        cli_mod.main(argv)
    out = capsys.readouterr()
    assert exit_info.value.code == 2
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    assert "Traceback" not in out.err
    return lines[0]


BAD_INPUT = [
    # (argv, the argument named, a piece of the accepted values)
    (["check", "--batch", "-3"], "--batch", "positive integer"),
    (["check", "--batch", "0"], "--batch", "positive integer"),
    (["check", "--context-len", "0"], "--context-len", "positive integer"),
    (["check", "--context-len", "1.5"], "--context-len", "positive integer"),
    (["check", "--topk", "-1"], "--topk", "positive integer"),
    (["check", "--next-n", "1,x"], "--next-n", "comma list of positive integers"),
    (["check", "--next-n", ""], "--next-n", "comma list of positive integers"),
    (["check", "--next-n", "0"], "--next-n", "comma list of positive integers"),
    (["check", "--block-size", "8"], "--block-size", "each 1 or a multiple of 16"),
    (["check", "--block-size", "64,"], None, None),  # a trailing comma is fine
    (["check", "--block-size", "64,x"], "--block-size", "each 1 or a multiple of 16"),
    (["check", "--device", "gpu"], "--device", "cpu, cuda or cuda:N"),
    (["check", "--device", "cuda"], "--device", "accepted here: cpu"),
    (
        ["check", "--model", "llama"],
        "--model",
        "deepseek_v32, glm_moe_dsa, deepseek_v4, deepseek_v41, glm5_next (or deepseek-v3.2, glm-5) (or all)",
    ),
    (["check", "--seed", "-1"], "--seed", "[0, 2**32)"),
    (["bench", "--seed", str(2**64)], "--seed", "[0, 2**32)"),
    (["check", "--next-n", "4", "--context-len", "2"], "--next-n", "<= --context-len"),
    (["bench", "--batch", "0,1"], "--batch", "comma list of positive integers"),
    (["bench", "--heads", "x"], "--heads", "comma list of positive integers"),
    (["bench", "--context-len", "4096,-1"], "--context-len", "comma list of positive integers"),
    (["bench", "--next-n", "1,,x"], "--next-n", "comma list of positive integers"),
    (["bench", "--block-size", "0"], "--block-size", "each 1 or a multiple of 16"),
    (["bench", "--head-dim", "100"], "--head-dim", "multiple of 16"),
    (["bench", "--repeats", "0"], "--repeats", "must be an integer from 1 to"),
    (["bench", "--warmup", "-1"], "--warmup", "must be an integer from 0 to"),
    (["bench", "--input-sets", "0"], "--input-sets", "must be an integer from 1 to"),
    (["bench", "--pool-blocks", "-5"], "--pool-blocks", "positive integer"),
    (["bench", "--arms", "gluon,fast"], "--arms", "patched-call[ref]"),
    (["bench", "--device", "cuda:1"], "--device", "accepted here: cpu"),
    (["bench", "--plot", "/nonexistent/dir/x.png"], "--plot", "does not exist"),
    (["bench", "--json", "/nonexistent/dir/x.json"], "--json", "does not exist"),
    (["bench", "--csv", "/nonexistent/dir/x.csv"], "--csv", "does not exist"),
    (["bench", "--tune", "/nonexistent/dir/t.csv"], "--tune", "does not exist"),
    (["tune", "--out", "/nonexistent/dir/t.csv"], "--out", "does not exist"),
    (["bench", "--batch", "1", "--context-len", "64,1", "--next-n", "2"], "--next-n", "<= --context-len"),
    # Limits over two options, checked with the default of the one not given (no GPU here).
    (["check", "--next-n", "4096"], "--next-n", "<= --context-len 2048 (the default on CPU), got 4096"),
    (["check", "--context-len", "1"], "--context-len", ">= 2, the largest of --next-n 1,2 (the default)"),
    (["check", "--context-len", "1", "--next-n", "2"], "--next-n", "<= --context-len 1, got 2"),
    (["bench", "--next-n", "5000"], "--next-n", "<= --context-len (4096, the default), got 5000"),
    (["bench", "--tune", "t.csv", "--reference", "--next-n", "2000"], "--next-n", "(1024, the default)"),
    (["tune", "--out", "t.csv", "--reference", "--next-n", "1025"], "--next-n", "(1024, the default)"),
    (["tune", "--out", "t.csv", "--next-n", "8193"], "--next-n", "(8192, the default)"),
    # What the tool can run: 2 GiB of KV pool and of logits, said in the message.
    (
        ["check", "--batch", "1000000000"],
        "--batch",
        "at most 7943 at --context-len 2048 (the default on CPU)",
    ),
    (["check", "--context-len", "1000000000"], "--context-len", "at most 4067136 at --batch 4 (the default"),
    (["check", "--batch", "64", "--context-len", "300000"], "--batch", "at most 54 at --context-len 300000"),
    (["check", "--batch", "1", "--context-len", "99999999"], "--context-len", "under 2 GiB (FlyDSL's i32"),
    (["check", "--next-n", "4096", "--context-len", "65536"], "--next-n", "at most 2047 at --batch 4 (the"),
    (["check", "--topk", "1000000000"], "--topk", "<= --context-len 2048 (the default on CPU), the longest"),
    (["check", "--topk", "513", "--context-len", "512"], "--topk", "<= --context-len 512, the longest row"),
    (
        ["bench", "--batch", "1000000000"],
        "--batch",
        "at most 3971 at --next-n 1 (the smallest of --next-n 1,2",
    ),
    (["bench", "--batch", "1,2", "--context-len", "1000000000"], "--context-len", "at most 16268815 at"),
    (["bench", "--batch", "1,,2"], "--batch", "comma list of positive integers"),
    (["bench", "--arms", "gluon,,flydsl"], "--arms", "comma list of gluon"),
    (["check", "--block-size", "64,,1"], "--block-size", "comma list of KVBlockSize"),
    # A kernel interface (root passes os.access on /proc): refused before the run.
    (["bench", "--csv", "/proc/out.csv"], "--csv", "/proc/out.csv is under /proc, a kernel interface"),
    (["bench", "--json", "/proc/out.json"], "--json", "/proc/out.json is under /proc, a kernel interface"),
    (["bench", "--tune", "/proc/t.csv", "--reference"], "--tune", "/proc/t.csv is under /proc, a kernel"),
    (["tune", "--out", "/proc/t.csv", "--reference"], "--out", "/proc/t.csv is under /proc, a kernel"),
    # One tuning command: tune --out (a table) or tune --model (the node cache), never both, never neither,
    # and neither takes the other's options; bench --tune, the old spelling, refuses what tune --out does.
    (["tune"], "--model", None),
    (["tune", "--model", "deepseek_v32", "--out", "t.csv"], "--out", "not allowed with argument --model"),
    (["tune", "--out", "t.csv", "--max-batch", "4"], "--max-batch", "not used with --out (it bounds the"),
    (["bench", "--tune", "t.csv", "--reference", "--csv", "b.csv"], "--csv", "not used with --tune"),
    (["bench", "--tune", "t.csv", "--reference", "--plot", "b.png"], "--plot", "not used with --tune"),
    (["bench", "--tune", "t.csv", "--reference", "--arms", "gluon"], "--arms", "not used with --tune"),
    (["bench", "--tune", "t.csv", "--reference", "--vary-lengths"], "--vary-lengths", "not used with"),
    (["bench", "--tune", "t.csv", "--reference", "--pool-blocks", "8"], "--pool-blocks", "not used with"),
    # Controls: accepted, each reaches its command.
    (["check", "--context-len", "1", "--next-n", "1"], None, None),
    (["check", "--topk", "2048"], None, None),
    (["check", "--batch", "7943"], None, None),
    (["bench", "--next-n", "4096"], None, None),
    (["bench", "--batch", "3971"], None, None),
    (["bench", "--tune", "t.csv", "--reference", "--json", "j.json"], None, None),
    (["tune", "--out", "t.csv", "--reference", "--json", "j.json", "--next-n", "1024"], None, None),
    (["tune", "--out", "t.csv", "--next-n", "8192", "--seed", "7"], None, None),
]


@pytest.mark.parametrize("argv,argument,accepted", BAD_INPUT, ids=[" ".join(c[0]) for c in BAD_INPUT])
def test_bad_input_is_one_line_naming_the_argument_before_any_work(
    argv, argument, accepted, no_work, monkeypatch, capsys, tmp_path
):
    no_gpu(monkeypatch)
    monkeypatch.chdir(tmp_path)  # relative output files land here; none is left behind
    if argument is None:  # the control: accepted input reaches the command
        from vllm_flydsl_indexer.tools import cli as cli_mod

        assert cli_mod.main(argv) == 0 and len(no_work) == 1
        return
    line = rejected(argv, capsys)
    if accepted is None:  # tune given neither --model nor --out: argparse's words for the pair
        assert line == "vllm-flydsl-indexer tune: error: one of the arguments --model --out is required"
    else:
        assert line.startswith(f"vllm-flydsl-indexer {argv[0]}: error: argument {argument}: "), line
        assert accepted in line, line
    assert no_work == []
    assert list(tmp_path.iterdir()) == []


def test_output_directory_must_be_writable(tmp_path, no_work, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access  # root writes anywhere, so the directory's mode alone cannot show it
    monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and str(p) != str(locked))
    line = rejected(["bench", "--csv", str(locked / "b.csv")], capsys)
    assert "argument --csv: directory" in line and "is not writable" in line
    assert rejected(["bench", "--json", str(tmp_path)], capsys).startswith(
        "vllm-flydsl-indexer bench: error: argument --json: must be a file path"
    )
    assert no_work == []


def test_plot_needs_matplotlib_before_any_work(tmp_path, no_work, monkeypatch, capsys):
    import types

    path = str(tmp_path / "p.png")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not importable
    line = rejected(["bench", "--device", "cpu", "--plot", path], capsys)
    assert "argument --plot: needs matplotlib" in line and "pip install matplotlib" in line
    assert no_work == []
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    canvas = types.SimpleNamespace(get_supported_filetypes=lambda: {"png": "Portable Network Graphics"})
    monkeypatch.setitem(
        sys.modules, "matplotlib.backend_bases", types.SimpleNamespace(FigureCanvasBase=canvas)
    )
    from vllm_flydsl_indexer.tools import cli as cli_mod

    assert cli_mod.main(["bench", "--device", "cpu", "--plot", path]) == 0
    assert [a.plot_path for a in no_work] == [path]


def test_present_devices_are_accepted_and_absent_ones_named(no_work, monkeypatch, capsys):
    import torch

    from vllm_flydsl_indexer.tools import cli as cli_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("cpu", "cuda", "cuda:0", "cuda:1"):
        assert cli_mod.main(["check", "--device", device]) == 0
    assert [a.device for a in no_work] == ["cpu", "cuda", "cuda:0", "cuda:1"]
    line = rejected(["check", "--device", "cuda:2"], capsys)
    assert line.endswith("accepted here: cpu, cuda, cuda:0, cuda:1"), line


def test_valid_values_reach_the_commands_parsed(no_work, monkeypatch):
    from vllm_flydsl_indexer.tools import cli as cli_mod

    no_gpu(monkeypatch)
    argv = ["check", "--batch", "3", "--next-n", "1,2", "--block-size", "1,64", "--context-len", "256"]
    assert cli_mod.main(argv) == 0
    args = no_work[-1]
    assert (args.batch, args.next_n, args.block_size, args.context_len) == (3, (1, 2), (1, 64), 256)
    assert cli_mod.main(["bench", "--batch", "1,4", "--arms", "reference, stock-call[ref]"]) == 0
    assert no_work[-1].batch == (1, 4) and no_work[-1].arms == "reference,stock-call[ref]"


def test_limits_use_the_gpu_defaults_on_a_gpu(no_work, monkeypatch, capsys):
    """Without --context-len, --next-n is checked against the default of the device that will run."""
    import torch

    from vllm_flydsl_indexer.tools import cli as cli_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli_mod.main(["check", "--next-n", "511"]) == 0  # the GPU default context is 32768
    assert cli_mod.main(["check", "--next-n", "511", "--device", "cuda"]) == 0
    line = rejected(["check", "--next-n", "4096"], capsys)  # 17 GB of logits at the GPU defaults
    assert line.endswith(
        "--next-n: must be at most 511 at --batch 32 (the default on GPU) and --context-len 32768 "
        "(the default on GPU): each case's KV pool and logits buffer must stay under 2 GiB "
        "(FlyDSL's i32 offsets), got 4096"
    )
    line = rejected(["check", "--next-n", "40000"], capsys)
    assert line.endswith(
        "--next-n: each value must be <= --context-len 32768 (the default on GPU), got 40000"
    )
    line = rejected(["check", "--next-n", "4096", "--device", "cpu"], capsys)
    assert "<= --context-len 2048 (the default on CPU)" in line
    line = rejected(["check", "--batch", "1000"], capsys)
    assert "--batch: must be at most 496 at --context-len 32768 (the default on GPU)" in line
    assert len(no_work) == 2


@pytest.mark.parametrize("command", ["check", "bench"])
def test_running_out_of_memory_is_one_line_not_a_traceback(command, monkeypatch, capsys):
    """The limits are what the tool can run; a machine with less memory gets one line, exit 1."""
    from vllm_flydsl_indexer.tools import bench, check
    from vllm_flydsl_indexer.tools import cli as cli_mod

    def out_of_memory(args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes.")

    monkeypatch.setattr({"check": check, "bench": bench}[command], "main", out_of_memory)
    assert cli_mod.main([command, "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"vllm-flydsl-indexer {command}: error: out of memory (DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 9 bytes.); try a smaller --batch, --context-len or --next-n"
    ]
    monkeypatch.setattr(check, "main", lambda args: 1 / 0)  # any other error is a bug: it propagates
    with pytest.raises(ZeroDivisionError):
        cli_mod.main(["check", "--device", "cpu"])


def test_missing_command_is_one_line_naming_the_commands(capsys):
    """The usage line names every subcommand the parser has (issue 50: it once left out tune)."""
    import argparse

    from vllm_flydsl_indexer.tools import cli as cli_mod

    parser = cli_mod.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == ["doctor", "check", "bench", "tune"]
    line = rejected([], capsys)
    assert (
        line == "vllm-flydsl-indexer: error: the following arguments are required: {doctor,check,bench,tune}"
    )
    assert parser.format_usage().startswith("usage: vllm-flydsl-indexer [-h] {doctor,check,bench,tune} ...")


@pytest.mark.parametrize(
    "argv, unknown",
    [
        (["tune", "--model", "deepseek_v32", "--maxbatch", "2"], "--maxbatch 2"),
        (["doctor", "--jsn"], "--jsn"),
    ],
)
def test_an_unknown_flag_is_named_with_the_subcommand_it_follows(argv, unknown, capsys):
    line = rejected(argv, capsys)
    assert line == f"vllm-flydsl-indexer {argv[0]}: error: unrecognized arguments: {unknown}"


CONSOLE_BAD_INPUT = [
    ["check", "--batch", "-3"],
    ["bench", "--plot", "/nonexistent/dir/x.png"],
    # Each of these once ended in a traceback, a hang, or a late error after the whole run.
    ["check", "--next-n", "4096", "--device", "cpu"],
    ["check", "--context-len", "1", "--device", "cpu"],
    ["check", "--batch", "1000000000"],
    ["check", "--context-len", "1000000000"],
    ["check", "--topk", "1000000000", "--device", "cpu"],
    ["bench", "--next-n", "5000"],
    ["bench", "--batch", "1,,2"],
    ["bench", "--csv", "/proc/out.csv"],
    ["bench", "--tune", "/proc/t.csv", "--reference"],
    ["tune", "--out", "/proc/t.csv", "--reference"],
    ["tune", "--repeats", "5", "--model", "deepseek_v32"],
]


@pytest.mark.parametrize("argv", CONSOLE_BAD_INPUT, ids=" ".join)
def test_console_bad_input_exits_2_with_one_line_and_no_traceback(argv):
    if "/proc/" in " ".join(argv) and not os.path.isdir("/proc"):
        pytest.skip("no /proc on this machine")
    proc = cli(argv, no_vllm_env(), timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"argument {argv[1]}:" in proc.stderr


# ---------------------------------------------------------------- fast --help


def test_parser_and_help_import_no_torch():
    code = (
        "import sys\n"
        "import vllm_flydsl_indexer.tools.cli as c\n"
        "c.build_parser()\n"
        "for argv in (['--help'], ['doctor', '--help'], ['check', '--help'], ['bench', '--help'], "
        "['tune', '--help']):\n"
        "    try:\n"
        "        c.main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'building the parser imported torch'\n"
        "print('ok')\n"
    )
    env = no_vllm_env()
    env["PYTHONPATH"] += os.pathsep + PACKAGE_ROOT
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), proc.stderr[-2000:]


def test_numpy_is_a_dependency():
    """torch warns "Failed to initialize NumPy" on every command without it."""
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert "numpy" in [d.split(">")[0].split("=")[0].strip() for d in project["project"]["dependencies"]]


# ---------------------------------------------------------------- progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_progress(stream) -> str:
    from vllm_flydsl_indexer.tools.progress import Progress

    with Progress(3, "check", stream) as progress:
        for name in ("case a", "case b", "case c"):
            progress.step(name)
    return stream.getvalue()


def test_progress_on_a_terminal_is_tqdm():
    pytest.importorskip("tqdm")
    text = run_progress(Terminal())
    assert "check: 100%" in text and "3/3" in text and "case b" in text
    assert "check [" not in text  # not the hand-drawn bar


def test_progress_without_tqdm_draws_its_own_bar(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    text = run_progress(Terminal())
    assert text.startswith("\r\033[Kcheck [........................] 1/3 case a")
    assert "check [########################] 3/3 done in" in text


def test_progress_in_a_log_is_one_plain_line_per_step():
    lines = run_progress(io.StringIO()).splitlines()
    assert lines[:3] == [
        "check [........................] 1/3 case a",
        "check [########................] 2/3 case b",
        "check [################........] 3/3 case c",
    ]
    assert lines[3].startswith("check [########################] 3/3 done in") and len(lines) == 4


# ---------------------------------------------------------------- does what it says


@pytest.mark.slow
def test_check_next_n_1_runs_no_next_n_2_case_and_says_which_it_left_out(capsys):
    from vllm_flydsl_indexer.tools import cli as cli_mod

    argv = ["check", "--next-n", "1", "--context-len", "1", "--batch", "1", "--device", "cpu"]
    rc = cli_mod.main([*argv, "--model", "glm-5", "--block-size", "64"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.endswith(("PASS", "FAIL"))]
    # 9 cases, then the 17 router-behaviour cases of each of 2 APIs, then 3 agreement self-tests.
    assert len(rows) == 9 + 34 + 3 and all(r.endswith("PASS") for r in rows), out
    assert "next_n=2" not in "\n".join(rows) and "(B, 2)" not in "\n".join(rows)
    notes = [line for line in out.splitlines() if line.startswith("note: --next-n 1")]
    assert len(notes) == 1 and "the 7 bounds cases of MTP (next_n > 1) were not run" in notes[0]
    assert out.splitlines()[-1] == "46 passed, 0 failed (reference contracts, not the real kernels)"


def test_bounds_cases_of_mtp_run_at_the_largest_next_n_given():
    from vllm_flydsl_indexer.tools.check import build_cases, not_run_note

    default = build_cases(["glm-5"], (64,), (1, 2), 2, 64)
    assert len(default) == 17 and not_run_note((1, 2)) is None
    assert {c.next_n for c in default} == {1, 2}
    assert "DSV4.1 ratio 2 next_n=2 (same shapes)" in [c.label for c in default]
    only_one = build_cases(["glm-5"], (64,), (1,), 2, 64)
    assert {c.next_n for c in only_one} == {1} and len(only_one) == 9
    three = build_cases(["glm-5"], (64,), (1, 3), 2, 64)
    assert {c.next_n for c in three} == {1, 3} and len(three) == 17
    same = [c for c in three if c.same_shapes_as]
    assert [c.same_shapes_as for c in same] == ["DSV4.1 ratio 1 next_n=3"] * 2
    assert [c.flattened for c in three if c.kind == "flattened"] == [3]


def test_tune_with_json_writes_it_and_takes_an_empty_csv_as_new(tmp_path, capsys):
    from vllm_flydsl_indexer import tuning
    from vllm_flydsl_indexer.tools import cli as cli_mod

    table, report = tmp_path / "t.csv", tmp_path / "j.json"
    table.touch()  # an existing, empty file: a new table
    argv = ["tune", "--out", str(table), "--reference", "--json", str(report), "--device", "cpu"]
    small = ["--heads", "32", "--block-size", "64", "--next-n", "1", "--batch", "1", "--repeats", "1"]
    assert cli_mod.main([*argv, *small, "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "wrote 1 rows" in out and "kept 0 earlier rows" in out
    assert f"tune --out: wrote JSON to {report}" in out
    data = json.loads(report.read_text())
    assert data["meta"]["gfx"] == "reference" and data["meta"]["device"] == "cpu"
    assert len(data["rows"]) == 1 and list(data["rows"][0]) == list(tuning.COLUMNS)
    lines = table.read_text().splitlines()
    assert lines[0] == ",".join(tuning.COLUMNS) and len(lines) == 2
    assert lines[1].split(",")[:3] == ["reference", "1", "1"]


def tune_twice(tmp_path, monkeypatch, capsys, first: str, second: str):
    """The same sweep spelled ``first`` then ``second`` (``tune --out`` or ``bench --tune``), each into its
    own table over the same earlier row, each candidate's time a fresh random number of this run (the same
    numbers for both spellings): what each printed and wrote, and which command reached ``tune.main``."""
    import random

    from vllm_flydsl_indexer import tuning
    from vllm_flydsl_indexer.tools import cli as cli_mod
    from vllm_flydsl_indexer.tools import tune

    times = iter([random.uniform(1.0, 100.0) for _ in range(5)] * 2)
    monkeypatch.setattr(tune, "_time", lambda *a, **k: next(times))
    ran = []
    real_main = tune.main
    monkeypatch.setattr(tune, "main", lambda args: ran.append(args.command) or real_main(args))
    earlier = f"reference,1,8,1,32,128,64,1,1024,gluon,256,2,0,{random.uniform(1, 9):.3f},1.0,"
    results = []
    for spelling in (first, second):
        table = tmp_path / f"{spelling.split()[0]}.csv"
        table.write_text(f"# mine\n{','.join(tuning.COLUMNS)}\n{earlier}\n")
        command, flag = spelling.split()
        argv = [command, flag, str(table), "--reference", "--device", "cpu", "--heads", "32", "--batch", "1"]
        status = cli_mod.main([*argv, "--block-size", "64", "--next-n", "1", "--context-len", "64"])
        out = capsys.readouterr()
        results.append((status, out.out, out.err.splitlines(), table.read_text()))
    return results, ran


def test_bench_tune_is_tune_out_said_in_one_line_through_the_same_code(tmp_path, monkeypatch, capsys):
    from vllm_flydsl_indexer.tools import settings

    (new, old), ran = tune_twice(tmp_path, monkeypatch, capsys, "tune --out", "bench --tune")
    assert ran == ["tune", "bench"] and new[0] == old[0] == 0
    assert new[3] == old[3]  # the same table, byte for byte: the earlier row and comment kept, one row added
    assert new[3].startswith("# mine\n") and new[3].count("\nreference,1,") == 2
    alias = f"vllm-flydsl-indexer bench --tune: {settings.TUNE_ALIAS}"
    assert "`vllm-flydsl-indexer tune --out FILE`" in alias
    assert old[2][0] == alias and old[2][1:] == new[2]  # one line more, first; the progress lines the same
    assert alias not in "\n".join(new[2])
    for (_, out, _, _), spelling in ((new, "tune --out"), (old, "bench --tune")):
        table = tmp_path / f"{spelling.split()[0]}.csv"
        what = "REFERENCE timings, not kernel timings (gfx=reference)"
        assert out == f"{spelling}: wrote 1 rows ({what}) to {table}, kept 1 earlier rows\n"


def test_tune_out_refuses_a_machine_without_kernel_timings_before_any_work(tmp_path, monkeypatch, capsys):
    """Without a gfx950 GPU and both kernels (here: no GPU) and without --reference, one line naming the
    option as typed, exit 2, before anything is timed or any file written; the alias adds no line to it."""
    from vllm_flydsl_indexer.tools import tune

    monkeypatch.setattr(tune, "tune_rows", lambda *a, **k: pytest.fail("timed before refusing"))
    no_gpu(monkeypatch)
    for argv, flag in (
        (["tune", "--out"], "--out"),
        (["bench", "--tune"], "--tune"),
        (["tune", "--device", "cpu", "--out"], "--out"),
    ):
        table = tmp_path / f"{os.urandom(4).hex()}.csv"
        line = rejected([*argv, str(table), "--batch", "1"], capsys)
        assert line.startswith(f"vllm-flydsl-indexer {argv[0]}: error: argument {flag}: needs a gfx950 GPU")
        assert "(device cpu is not a gfx950 GPU); add --reference for a dry run" in line
        assert not table.exists()
    assert list(tmp_path.iterdir()) == []


def test_tune_help_documents_both_forms_and_every_output_rule(capsys):
    from vllm_flydsl_indexer.tools import cli as cli_mod
    from vllm_flydsl_indexer.tools import outputs, settings

    with pytest.raises(SystemExit):
        cli_mod.main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(--model M | --out FILE)" in text and "--out FILE sweep the grid below into an aiter" in text
    for words in (outputs.OUTPUT_RULE, settings.STOP_TUNE, "with --out FILE only: --heads HEADS"):
        assert " ".join(words.split()) in text, words
    with pytest.raises(SystemExit):
        cli_mod.main(["bench", "--help"])
    assert "the old spelling of `vllm-flydsl-indexer tune --out OUT.csv`" in " ".join(
        capsys.readouterr().out.split()
    )


def test_bench_keeps_the_results_when_a_late_write_fails(tmp_path, monkeypatch, capsys):
    """The outputs were opened before the run; should a write still fail, the results go to stdout."""
    import shutil

    from vllm_flydsl_indexer.tools import bench
    from vllm_flydsl_indexer.tools import cli as cli_mod

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    shape = bench.Shape(32, 128, 64, 1, 1, 1024)
    result = bench.ArmResult(dict(shape.__dict__), "reference", False, "timed", median_us=12.5)

    def run(args, stop=None):
        shutil.rmtree(out_dir)  # the directory goes away during the run
        return [result], {
            "device": "cpu",
            "arms": "a",
            "arms_why": "",
            "stock": "s",
            "repeats": 1,
            "input_sets": 1,
            "copy_bw_gbps": None,
        }

    monkeypatch.setattr(bench, "run", run)
    rc = cli_mod.main(
        ["bench", "--device", "cpu", "--csv", str(out_dir / "b.csv"), "--json", str(out_dir / "b.json")]
    )
    out = capsys.readouterr()
    assert rc == 1
    assert "Traceback" not in out.err
    errors = out.err.splitlines()
    assert len(errors) == 2 and all(e.startswith("bench: could not write ") for e in errors), out.err
    assert "median_us" in out.out and "12.5" in out.out  # the CSV and the JSON, on stdout
    printed = out.out.split("--- the JSON that could not be written")[1].split("\n", 1)[1]
    assert json.loads(printed.split("--- end ---")[0])["results"][0]["median_us"] == 12.5


def test_tune_keeps_the_rows_when_the_late_write_fails(tmp_path, monkeypatch, capsys):
    import shutil

    from vllm_flydsl_indexer.tools import cli as cli_mod
    from vllm_flydsl_indexer.tools import tune

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = tune.tune_rows

    def rows_then_lose_the_directory(*a, **k):
        rows = real(*a, **k)
        shutil.rmtree(out_dir)
        return rows

    monkeypatch.setattr(tune, "tune_rows", rows_then_lose_the_directory)
    argv = ["tune", "--out", str(out_dir / "t.csv"), "--reference", "--device", "cpu", "--heads", "32"]
    small = ["--block-size", "64", "--next-n", "1", "--batch", "1", "--repeats", "1", "--warmup", "0"]
    rc = cli_mod.main([*argv, *small])
    out = capsys.readouterr()
    assert rc == 1 and "Traceback" not in out.err
    assert out.err.splitlines()[-1].startswith("tune --out: could not write ")
    assert "gfx,cu_num,batch_size" in out.out and "\nreference,1,1,1,32,128,64,1,1024," in out.out


# ---------------------------------------------------------------- doctor wording


def test_doctor_names_an_unset_or_off_switch_and_what_turns_it_on():
    from vllm_flydsl_indexer.tools import doctor

    for environ, switch_line, gate_text in (
        (
            {},
            f"{envs.SWITCH} is not set: off (1/true enables it)",
            f"{envs.SWITCH} is not set (1/true enables it)",
        ),
        ({envs.SWITCH: "0"}, f"{envs.SWITCH}='0' (parsed, off)", f"{envs.SWITCH}=0 (off; 1/true enables it)"),
    ):
        data = doctor.report(environ)
        text = doctor.render(data)
        assert f"\nswitch:   {switch_line}\n" in text
        assert f"  1. switch  FAIL {gate_text}\n" in text
        assert f"log line: vllm-flydsl-indexer: stock paged MQA logits (FlyDSL inactive: {gate_text})" in text
        assert "is not set to 1" not in text and "unset (parsed" not in text and "<gate" not in text
        assert text.startswith(f"arm:      stock ({data['stock']})  (gate 1, switch, below)\nlog line: ")


def test_doctor_says_what_stock_runs_gluon_only_on_a_rocm_gfx950_vllm():
    from vllm_flydsl_indexer.tools import doctor

    assert (
        doctor.stock_report({"vllm_platform": "vLLM not installed", "gcn_arch": None}) == "vLLM not installed"
    )
    for platform in (
        {"vllm_platform": "CpuPlatform", "gcn_arch": None},
        {"vllm_platform": "R", "gcn_arch": "gfx942"},
    ):
        assert (
            doctor.stock_report(platform)
            == "not a ROCm gfx950 GPU: vLLM's own path for this platform, not Gluon"
        )
    # This process simulates gfx950 with aiter on: there, and only there, stock is Gluon.
    assert doctor.stock_report({"vllm_platform": "RocmPlatform", "gcn_arch": "gfx950:sramecc+"}) == "Gluon"


def test_doctor_notes_the_retired_verify_variable_only_where_it_is_set():
    """Issue 43: the canary is gone; a set VLLM_FLYDSL_INDEXER_VERIFY gets one note in doctor (text and
    JSON) pointing to check --device and bench, and changes nothing else."""
    from vllm_flydsl_indexer.tools import doctor

    env = {envs.SWITCH: "1"}
    plain = doctor.report(env)
    assert plain["verify"] is None and "VERIFY" not in doctor.render(plain)
    for value in ("1", "0", "bogus"):
        data = doctor.report({**env, doctor.VERIFY: value})
        note = data["verify"]
        assert (
            note.startswith(f"{doctor.VERIFY} is retired and ignored") and "check --device and bench" in note
        )
        assert f"note:     {note}" in doctor.render(data).splitlines()
        assert (data["arm"], data["log_line"], data["gates"]) == (
            plain["arm"],
            plain["log_line"],
            plain["gates"],
        )
