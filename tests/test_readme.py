# SPDX-License-Identifier: Apache-2.0
"""The README's two fresh-machine commands stay true."""

from __future__ import annotations

import re
from pathlib import Path

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
