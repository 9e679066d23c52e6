# SPDX-License-Identifier: Apache-2.0
"""No vLLM import can silence doctor, check or bench (issue 45 items 4, 5, 7).

A vLLM stand-in on the path whose ``__init__`` (or ``vllm.platforms``) raises what no probe catches:
each command still reports, names what was raised, and exits with its own verdict.
"""

from __future__ import annotations

import json
import signal
import sys

import pytest
import vllm

from conftest import simulation_env
from test_cli import cli
from vllm_flydsl_indexer import envs
from vllm_flydsl_indexer.tools import vllm_import

CUSTOM = "class Custom(BaseException):\n    pass\n\n\n"
RAISES = {
    "SystemExit(3)": "raise SystemExit(3)\n",
    "SystemExit(0)": "import sys\nsys.exit(0)\n",
    "GeneratorExit()": "raise GeneratorExit\n",
    "Custom('x')": CUSTOM + "raise Custom('x')\n",
    "KeyboardInterrupt()": "raise KeyboardInterrupt\n",  # raised by the code, not a Ctrl-C
}


def stand_in(tmp_path, body: str, where: str = "vllm") -> dict:
    """An environment whose ``vllm`` (or ``vllm.platforms``) runs ``body`` on import."""
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text(body if where == "vllm" else "")
    if where == "vllm.platforms":
        (package / "platforms").mkdir()
        (package / "platforms" / "__init__.py").write_text(body)
    env = simulation_env(**{envs.SWITCH: "1"})
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    return env


@pytest.mark.parametrize("where", ["vllm", "vllm.platforms"])
@pytest.mark.parametrize("named", list(RAISES))
@pytest.mark.slow_except("SystemExit(3)-vllm", "GeneratorExit()-vllm", "Custom('x')-vllm.platforms")
def test_doctor_names_what_the_vllm_import_raised(tmp_path, named, where):
    done = cli(["doctor", "--json"], stand_in(tmp_path, RAISES[named], where))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    data = json.loads(done.stdout)
    rocm = next(g for g in data["gates"] if g["name"] == "rocm")
    assert f"importing {where} raised {named}" in rocm["detail"], rocm
    assert not rocm["ok"] and data["arm"] == "stock"


def test_doctor_strict_fails_when_vllm_exits_0_on_import(tmp_path):
    """``doctor --strict && serve``: a vLLM whose import calls ``sys.exit(0)`` must not pass."""
    done = cli(["doctor", "--strict"], stand_in(tmp_path, RAISES["SystemExit(0)"]))
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "importing vllm raised SystemExit(0)" in done.stdout
    assert done.stderr.splitlines()[-1].startswith("doctor --strict: the FlyDSL arm would not be active (")


@pytest.mark.parametrize(
    "argv",
    [
        [
            "check",
            "--device",
            "cpu",
            "--model",
            "glm-5",
            "--block-size",
            "64",
            "--next-n",
            "1",
            "--batch",
            "1",
        ],
        ["bench", "--device", "cpu", "--heads", "32", "--block-size", "64", "--next-n", "1", "--batch", "1"],
        ["doctor", "--model", "glm5_next"],
    ],
    ids=["check", "bench", "doctor-model"],
)
def test_check_bench_and_doctor_model_report_a_vllm_that_exits_3(tmp_path, argv):
    small = {"check": ["--context-len", "64"], "bench": ["--context-len", "64", "--repeats", "1"]}
    done = cli([*argv, *small.get(argv[0], [])], stand_in(tmp_path, RAISES["SystemExit(3)"]))
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr
    assert "SystemExit(3)" in " ".join(done.stdout.split()), done.stdout[-3000:]


# ---------------------------------------------------------------- the net itself, in this process


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write ``vllm.<name>`` modules into a directory on vllm's package path; yields the writer."""
    monkeypatch.setattr(vllm, "__path__", [*vllm.__path__, str(tmp_path)])
    written = []

    def write(name: str, body: str) -> str:
        (tmp_path / f"{name}.py").write_text(body)
        written.append(f"vllm.{name}")
        return f"vllm.{name}"

    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_a_raise_inside_vllms_own_imports_travels_as_vllm_raised_it(modules):
    """Only the outermost vLLM module converts: vLLM's own ``except ImportError`` never sees a change."""
    modules("standin_inner", "raise SystemExit(3)\n")
    outer = modules(
        "standin_outer",
        "try:\n    import vllm.standin_inner\nexcept ImportError:\n    CAUGHT = True\n",
    )
    with (
        vllm_import.net(),
        pytest.raises(ImportError, match=r"importing vllm.standin_outer raised SystemExit\(3\)"),
    ):
        __import__(outer)


def test_a_real_ctrl_c_stays_a_keyboard_interrupt(modules):
    name = modules("standin_sigint", "import signal\nsignal.raise_signal(signal.SIGINT)\n")
    before = signal.getsignal(signal.SIGINT)
    with vllm_import.net(), pytest.raises(KeyboardInterrupt):
        __import__(name)
    assert signal.getsignal(signal.SIGINT) is before
    fake = modules("standin_fake_sigint", "raise KeyboardInterrupt\n")
    with vllm_import.net(), pytest.raises(ImportError, match="raised KeyboardInterrupt"):
        __import__(fake)


def test_the_net_changes_nothing_for_a_module_that_imports(modules):
    name = modules("standin_fine", "VALUE = 7\n")
    with vllm_import.net():
        module = __import__(name, fromlist=["VALUE"])
        assert module.VALUE == 7 and module.__spec__.origin.endswith("standin_fine.py")
    assert not any(isinstance(f, vllm_import._Finder) for f in sys.meta_path)
