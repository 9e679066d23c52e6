# SPDX-License-Identifier: Apache-2.0
"""The benchmarks still run (a benchmark that no longer runs is a defect): each, briefly, as a user runs it,
its figures read back. Their numbers are not asserted (a 2-core CI machine is not a measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Each runs a benchmark in a fresh interpreter (torch, and vLLM where asked, imported again): the slow set.
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
HOST_PATHS = {"taken", "stock-bound", "stock-bound cache"}


# Runs a script with vLLM unimportable, as on a lent GPU (torch and Triton, no vLLM).
WITHOUT_VLLM = "import runpy, sys; sys.modules['vllm'] = None; sys.argv[:] = sys.argv[1:]; runpy.run_path("
WITHOUT_VLLM += "sys.argv[0], run_name='__main__')"


def run(script: str, *args: str, vllm: bool = True) -> str:
    done = subprocess.run(
        [sys.executable, *([] if vllm else ["-c", WITHOUT_VLLM]), str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("mode", ["--standalone", "--standalone without vLLM", "with vLLM"])
def test_host_overhead_reports_every_path(tmp_path, mode):
    if mode == "with vLLM":
        pytest.importorskip("vllm")
    out = tmp_path / "host.json"
    flags = ["--standalone"] if mode.startswith("--") else []
    timing = ("--calls", "20", "--rounds", "3", "--json", str(out))
    stdout = run("host_overhead.py", *flags, *timing, vllm="without" not in mode)
    result = json.loads(out.read_text())
    assert HOST_PATHS <= set(result) and result["rounds"] == 3
    for path in HOST_PATHS:
        figures = result[path]
        assert figures["stock_us"] > 0 and figures["patched_us"] > 0, figures
        assert f"  {path} " in stdout
    assert len(result["samples_us"]) == 2 * len(HOST_PATHS)


@pytest.mark.parametrize("vllm", [True, False])
def test_router_overhead_reports_both_paths_for_both_next_n(vllm):
    lines = run("router_overhead.py", "--rounds", "3", "--calls", "20", vllm=vllm).splitlines()
    assert [line.split(":")[0] for line in lines] == ["next_n=1", "next_n=2"], lines
    assert all("router taken" in line and "stock-bound" in line for line in lines), lines


def test_hot_path_lines_times_each_line():
    lines = run("hot_path_lines.py", "--calls", "100").splitlines()
    assert lines[0].startswith("cpu:")
    timed = [line for line in lines[1:] if line.split()[1] == "ns"]
    assert len(timed) == len(lines) - 1 >= 10, lines
    assert any("memo key built" in line for line in timed) and any("the facts" in line for line in timed)
