# SPDX-License-Identifier: Apache-2.0
"""The README's two fresh-machine commands stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README must open with a bash block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_main_job_then_tests():
    main_job, tests = readme_commands()
    assert main_job.endswith("pip install . && vllm-flydsl-indexer check")
    assert tests.endswith("pip install -e '.[test]' && python -m pytest")
    head = (ROOT / "README.md").read_text().split("```bash", 1)[0]
    assert head.count("\n") < 6, "the commands must come first"


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = readme_commands()
    command = tests.split(" && ", 2)[-1]  # after creating and activating the venv
    ci = (ROOT / ".ci" / "run").read_text()
    assert any(line.startswith(command) for line in ci.splitlines()), command
    assert "python3 -m venv" in tests and '"$PYTHON" -m venv' in ci


def test_console_script_and_entry_point_are_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["vllm-flydsl-indexer"] == "vllm_flydsl_indexer.tools.cli:main"
    assert project["entry-points"]["vllm.general_plugins"] == {
        "flydsl_indexer": "vllm_flydsl_indexer:register"
    }
    deps = " ".join(project["dependencies"]).lower()
    assert "vllm" not in deps and "aiter" not in deps and "flydsl" not in deps
    assert any(d.startswith("vllm==") for d in project["optional-dependencies"]["test"])


def test_no_command_overrides_vllms_cudagraph_warmup():
    """vLLM warms up before graph capture on a GPU by itself (pinned in test_drift.py).

    No documented command may pass ``cudagraph_num_of_warmups`` as if FlyDSL needed it.
    """
    docs = [
        ROOT / "README.md",
        *sorted((ROOT / "examples").glob("*.md")),
        *sorted((ROOT / "examples").glob("*.sh")),
    ]
    for path in docs:
        text = path.read_text()
        assert '"cudagraph_num_of_warmups"' not in text, f"{path.name} passes cudagraph_num_of_warmups"
    # The README says why instead.
    assert "No compilation flag is needed." in (ROOT / "README.md").read_text()


def test_readme_is_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def _first_paragraph() -> str:
    return " ".join((ROOT / "README.md").read_text().split("```bash", 1)[0].split())


def test_the_first_sentence_scopes_amds_measurements_to_what_they_measured():
    """AMD's measurements are claimed only where the built-in table has rows; everywhere else (issue 44)
    the first paragraph says the plugin measures the user's GPU and stays stock until then."""
    import csv

    from vllm_flydsl_indexer import tuning

    with open(tuning.BUILTIN_PATH) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith(tuning.COMMENT)))
    (heads,) = {r["heads"] for r in rows}
    (cus,) = {r["cu_num"] for r in rows}
    head = _first_paragraph()
    assert f"AMD measured aiter's {tuning.BUILTIN_VARIANT} kernel at {heads} heads on {cus} CUs" in head, head
    assert "64 heads, DeepSeek-V3.2 included" in head and "PR #4221" in head
    assert "measures your GPU once per shape bucket" in head and "until then that bucket stays stock" in head
    assert "FlyDSL takes every eligible call" not in head


# doctor under vLLM in a subprocess (~14 s on 2 cores): the slow set, which CI runs.
@pytest.mark.slow
def test_the_readmes_active_line_is_what_the_plugin_logs():
    """The example ACTIVE line (general kernel, no table) is doctor's log line, word for word."""
    import json
    import subprocess
    import sys

    from conftest import simulation_env

    env = simulation_env(VLLM_ROCM_USE_AITER_FLYDSL_PAGED_MQA_LOGITS="1", AITER_DOUBLE_FLYDSL="general")
    done = subprocess.run(
        [sys.executable, "-m", "vllm_flydsl_indexer", "doctor", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout)["log_line"]
    assert "; per shape: " in line
    readme = (ROOT / "README.md").read_text().splitlines()
    active = [x for x in readme if x.startswith("vllm-flydsl-indexer: FlyDSL paged MQA logits ACTIVE")]
    assert active == [line]


def test_every_plot_command_in_the_readme_says_it_needs_matplotlib():
    paragraphs = (ROOT / "README.md").read_text().split("\n\n")
    for paragraph in paragraphs:
        if "--plot" in paragraph:
            assert "matplotlib" in paragraph and "pip install '.[plot]'" in paragraph, paragraph


def test_the_speed_grid_legend_says_bold_is_above_1_before_rounding():
    """A 1.00 cell is bold where the ratio was above 1: the legend must say so (the grid's own test)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "in bold: FlyDSL faster, a ratio above 1 before rounding" in readme
    assert "**1.00**" in readme


def test_the_readme_says_what_the_lean_runtime_does_and_no_longer_does():
    """Issue 43: the canary (VERIFY) is retired and doctor notes it; a failed shape stays stock until
    restart (the router's ERROR); an unaudited target (a fingerprint per release) stays stock naming the
    audited releases, with no opt-in; no run-time MXFP4 line (doctor --model says it)."""
    from vllm_flydsl_indexer import envs, gates, router, target
    from vllm_flydsl_indexer.tools import doctor

    readme = " ".join((ROOT / "README.md").read_text().split())
    hint = doctor.verify_hint({doctor.VERIFY: "1"})
    assert doctor.verify_hint({}) is None and "check --device and bench compare the two arms" in hint
    assert (
        f"`{doctor.VERIFY}` (the canary) is retired and ignored: `doctor` notes it where it is set, and "
        "`check --device` and `bench` compare the two arms on your GPU." in readme
    )
    assert readme.count("VERIFY") == 1 and readme.count("canary") == 1
    assert "use the stock path until vLLM restarts" in router.STAYS_STOCK
    assert "stays stock until vLLM restarts, and its one ERROR says so" in readme
    assert "this shape uses the stock path until vLLM restarts" in readme
    assert len({r for r, _ in target.AUDITED.values()}) >= 3 and not hasattr(gates, "OPT_IN")
    assert (
        "a vLLM whose target function is not an audited release's code (a fingerprint per release) stays "
        "stock, with one WARNING naming the audited releases; a release is supported once audited, and there "
        "is no opt-in." in readme
    )
    assert "ALLOW_UNTESTED" not in readme and "ALLOW_UNTESTED" not in " ".join(envs.ALL_VARIABLES)
    assert len(envs.ALL_VARIABLES) == 4 and "those of its four runtime variables" in readme
    for gone in ("FlyDSL never runs for this model", "DISAGREE", "gfx950-early", "content audit"):
        assert gone not in readme, gone
