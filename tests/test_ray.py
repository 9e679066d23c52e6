# SPDX-License-Identifier: Apache-2.0
"""The plugin's variables reach Ray actors as vLLM sends them; doctor warns about the file that stops them.

One driver process starts a real local Ray cluster (2 CPUs, no dashboard) while
its environment holds none of vLLM's or the plugin's variables and none of the
doubles, like a node where ``ray start`` ran in a clean shell: Ray's workers
inherit only that. Then, for each case, it sets the variables, re-imports
``vllm.ray.ray_env`` (which reads ``$VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json``
at import, as a fresh driver would) and does what vLLM 0.33.0's
``CoreEngineActorManager`` (``--data-parallel-backend ray``) does:
``get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS)``, those names'
values from ``os.environ``, ``RuntimeEnv(env_vars=...)`` on the actor. The actor
loads plugins with vLLM's ``load_general_plugins()``.

The doubles reach the actor on ``PYTHONPATH``, which vLLM sends only when the
driver lists it in ``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY`` (vLLM's own route for
extra variables), so the actor's whole environment comes from vLLM's selection.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import AITER_DOUBLE, AMDSMI_DOUBLE
from test_tuning import row, table_text
from vllm_flydsl_indexer import envs
from vllm_flydsl_indexer.envs import ACTIVE_LINE, STOCK_LINE
from vllm_flydsl_indexer.tools import doctor

NON_CARRY_OVER = "ray_non_carry_over_env_vars.json"

# argv: Ray temp dir, the switch's name, then one JSON object per case: the variables to set.
DRIVER = r"""
import importlib, json, os, sys
import ray
from ray.runtime_env import RuntimeEnv

ray.init(num_cpus=2, include_dashboard=False, _temp_dir=sys.argv[1], log_to_driver=False)


class Probe:
    def run(self):
        import logging
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        plugin_logger = logging.getLogger("vllm.plugins.flydsl_indexer")
        plugin_logger.addHandler(Keep())
        plugin_logger.setLevel(logging.DEBUG)
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        import vllm.v1.attention.ops.rocm_aiter_mla_sparse as target
        from vllm_flydsl_indexer import patch
        from vllm_flydsl_indexer.target import MARKER

        installed = patch.installed()
        fn = target.rocm_fp8_paged_mqa_logits
        table = installed.router.table if installed else None
        return {
            "lines": records,
            "marked": bool(getattr(fn, MARKER, False)),
            "is_wrapper": installed is not None and fn is installed.wrapper,
            "table": table.name if table else None,
            "environ": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        }


runs = []
for case in sys.argv[3:]:
    os.environ.update(json.loads(case))
    import vllm.ray.ray_env as ray_env
    import vllm.v1.executor.ray_env_utils as ray_env_utils
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    importlib.reload(ray_env)  # this case's config root, as a fresh driver reads it
    importlib.reload(ray_env_utils)
    # As vllm/v1/engine/utils.py CoreEngineActorManager builds its actors' runtime env.
    names = ray_env.get_env_vars_to_copy(destination="Probe", exclude_vars=WORKER_SPECIFIC_ENV_VARS)
    env_vars = {name: os.environ[name] for name in names if name in os.environ}
    actor = ray.remote(Probe).options(num_cpus=0, runtime_env=RuntimeEnv(env_vars=env_vars)).remote()
    # RayExecutorV2's own selection (applied in the worker with setdefault), for the same driver.
    executor_sends_switch = sys.argv[2] in ray_env_utils.get_driver_env_vars(WORKER_SPECIFIC_ENV_VARS)
    extra = {"sent": sorted(env_vars), "executor_sends_switch": executor_sends_switch}
    runs.append((actor.run.remote(), extra))
results = [ray.get(ref, timeout=240) | extra for ref, extra in runs]
print("RESULT" + json.dumps(results), flush=True)
ray.shutdown()
"""


def _clean_env() -> dict[str, str]:
    """This process's environment without vLLM's, the plugin's or the doubles' variables."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "AMDSMI_DOUBLE", "AITER_DOUBLE")) and k != "PYTHONPATH"
    }


def _case(root: Path, non_carry_over: list[str]) -> dict[str, str]:
    """The driver's variables for one case: the plugin's, and ``non_carry_over`` in its config root."""
    root.mkdir(parents=True)
    (root / NON_CARRY_OVER).write_text(json.dumps(non_carry_over))
    table = root / "tuned.csv"
    table.write_text(table_text(row()))
    return {
        envs.SWITCH: "1",
        "VLLM_ROCM_USE_AITER": "1",
        envs.TUNED_CSV: str(table),
        "VLLM_CONFIG_ROOT": str(root),
        "PYTHONPATH": os.pathsep.join([str(AITER_DOUBLE), str(AMDSMI_DOUBLE)]),
        "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "PYTHONPATH",
    }


@pytest.fixture(scope="module")
def ray_results(tmp_path_factory) -> list[dict]:
    """Both cases on one local cluster: [nothing listed, the switch listed in the non-carry-over file]."""
    pytest.importorskip("ray", reason="ray is not installed (it is in the `test` extra only)")
    base = tmp_path_factory.mktemp("ray")
    cases = [_case(base / "carried", []), _case(base / "listed", [envs.SWITCH])]
    # A short directory: Ray's socket paths must stay under the OS limit.
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", DRIVER, temp_dir, envs.SWITCH, *map(json.dumps, cases)],
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    results = json.loads(line[len("RESULT") :])
    for result, case in zip(results, cases, strict=True):
        result["table_path"] = case[envs.TUNED_CSV]
    return results


@pytest.mark.slow
def test_ray_actor_gets_the_plugins_variables_and_is_active(ray_results):
    result = ray_results[0]
    assert {envs.SWITCH, "VLLM_ROCM_USE_AITER", envs.TUNED_CSV, "PYTHONPATH"} <= set(result["sent"])
    assert result["environ"][envs.SWITCH] == "1"
    assert result["executor_sends_switch"] is True
    assert [line for line in result["lines"] if line.startswith(ACTIVE_LINE)], result["lines"]
    assert result["marked"] and result["is_wrapper"]
    assert result["table"] == result["table_path"]


@pytest.mark.slow
def test_switch_in_the_non_carry_over_file_leaves_the_actor_stock(ray_results):
    result = ray_results[1]
    assert envs.SWITCH not in result["sent"] and envs.SWITCH not in result["environ"]
    assert result["executor_sends_switch"] is False
    assert result["lines"] == [f"{STOCK_LINE} {envs.SWITCH} is not set (1/true enables it))"]
    assert not result["marked"] and not result["is_wrapper"]


def _write_config(monkeypatch, tmp_path: Path, text: str) -> Path:
    monkeypatch.setenv("VLLM_CONFIG_ROOT", str(tmp_path))
    path = tmp_path / NON_CARRY_OVER
    path.write_text(text)
    return path


def test_doctor_warns_when_the_non_carry_over_file_lists_the_switch(monkeypatch, tmp_path):
    path = _write_config(monkeypatch, tmp_path, json.dumps(["NCCL_DEBUG", envs.SWITCH]))
    data = doctor.report({envs.SWITCH: "1"})
    section = data["ray_non_carry_over"]
    warning = (
        f"{NON_CARRY_OVER} lists {envs.SWITCH}: Ray workers will not get it, so the plugin is inactive there"
    )
    assert section["file"] == str(path) and section["listed"] == [envs.SWITCH]
    assert section["warning"] == warning
    assert doctor.render(data).count(warning) == 1


def test_doctor_is_quiet_or_one_line_for_other_files(monkeypatch, tmp_path):
    path = _write_config(monkeypatch, tmp_path, json.dumps(["NCCL_DEBUG"]))
    section = doctor.ray_non_carry_over_report()
    assert section["warning"] is None and section["note"] == f"{path} lists none of the plugin's variables"
    path.write_text("{not json")
    section = doctor.ray_non_carry_over_report()
    assert section["warning"] is None and section["note"].startswith(f"cannot read {path} (JSONDecodeError")
    path.write_text("7")
    assert doctor.ray_non_carry_over_report()["note"].startswith(f"cannot read {path} (TypeError")
    path.write_text("[" * 100_000 + "]" * 100_000)  # nested past Python's recursion limit
    assert (
        doctor.ray_non_carry_over_report()["note"]
        == f"cannot read {path} (RecursionError: JSON nested too deeply)"
    )
    path.unlink()
    assert doctor.ray_non_carry_over_report()["note"].startswith(f"no {path}:")
    assert "ray:      no " in doctor.render(doctor.report({}))


class _Dist:
    """What ``importlib.metadata`` knows: ``{dist: (version, Requires-Dist)}`` and who provides aiter."""

    def __init__(self, monkeypatch, dists: dict[str, tuple[str, list[str]]], aiter: list[str]) -> None:
        metadata = doctor.importlib.metadata

        def lookup(name: str) -> tuple[str, list[str]]:
            if name not in dists:
                raise metadata.PackageNotFoundError(name)
            return dists[name]

        monkeypatch.setattr(metadata, "packages_distributions", lambda: {"aiter": aiter} if aiter else {})
        monkeypatch.setattr(metadata, "requires", lambda name: lookup(name)[1])
        monkeypatch.setattr(metadata, "version", lambda name: lookup(name)[0])


def test_doctor_names_the_flydsl_aiter_declares(monkeypatch):
    requires = ["torch", "flydsl==0.5.0; platform_system == 'Linux'"]
    _Dist(monkeypatch, {"amd-aiter": ("0.1.9", requires), "flydsl": ("0.5.0", [])}, ["amd-aiter"])
    data = doctor.report({})
    needs = data["flydsl_for_aiter"]
    assert needs | {"note": None} == {
        "aiter_dist": "amd-aiter",
        "declares": "flydsl==0.5.0",
        "installed": "0.5.0",
        "warning": None,
        "note": None,
    }
    assert "amd-aiter declares flydsl==0.5.0; flydsl 0.5.0 installed" in doctor.render(data)


def test_doctor_warns_once_when_flydsl_differs(monkeypatch):
    _Dist(monkeypatch, {"amd-aiter": ("0.1.9", ["flydsl==0.5.0"]), "flydsl": ("0.4.2", [])}, ["amd-aiter"])
    data = doctor.report({})
    warning = "amd-aiter declares flydsl==0.5.0 but flydsl 0.4.2 is installed"
    assert data["flydsl_for_aiter"]["warning"] == warning
    assert doctor.render(data).count(warning) == 1


def test_doctor_flydsl_note_never_raises_without_aiter_or_metadata(monkeypatch):
    _Dist(monkeypatch, {}, [])
    assert doctor.flydsl_requirement_report()["note"] == "aiter not installed"
    _Dist(monkeypatch, {"aiter": ("1", ["torch"])}, ["aiter"])
    assert doctor.flydsl_requirement_report()["note"] == "aiter declares no flydsl"
    _Dist(monkeypatch, {"aiter": ("1", ["flydsl>=0.4"])}, ["aiter"])
    warning = doctor.flydsl_requirement_report()["warning"]
    assert warning == "aiter declares flydsl>=0.4 but flydsl is not installed"
