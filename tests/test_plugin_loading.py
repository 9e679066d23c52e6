# SPDX-License-Identifier: Apache-2.0
"""vLLM's real plugin loader finds and runs the entry point, in fresh processes."""

from __future__ import annotations

import json

import pytest

from conftest import run_python, simulation_env
from vllm_flydsl_indexer import envs

PROBE = r"""
import json, sys, logging
records = []
class H(logging.Handler):
    def emit(self, r): records.append((r.levelname, r.getMessage()))
plugin_logger = logging.getLogger("vllm.plugins.flydsl_indexer")
plugin_logger.addHandler(H())
plugin_logger.setLevel(logging.DEBUG)
import vllm.envs as E
factors_before = E.compile_factors()
names_before = set(E.environment_variables)
before = set(sys.modules)
from vllm.plugins import load_general_plugins
load_general_plugins()
aiter_after_load = sorted(m for m in sys.modules if m == "aiter" or m.startswith("aiter."))
factors_after = E.compile_factors()
import vllm.v1.attention.ops.rocm_aiter_mla_sparse as t
fn = t.rocm_fp8_paged_mqa_logits
print("RESULT" + json.dumps({
    "patched": bool(getattr(fn, "_vllm_flydsl_indexer", False)),
    "lines": [m for _, m in records],
    "levels": [lv for lv, _ in records],
    "new_modules": sorted(m for m in set(sys.modules) - before if m.startswith(("vllm_flydsl", "aiter"))),
    "aiter_after_load": aiter_after_load,
    "factors_unchanged": factors_after == factors_before,
    "new_factors": sorted(set(factors_after) - set(factors_before)),
    "new_names": sorted(set(E.environment_variables) - names_before),
}))
"""


def probe(env: dict) -> dict:
    proc = run_python(PROBE, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.mark.parametrize("plugins", [None, "flydsl_indexer"])
@pytest.mark.slow_except("None")
def test_loader_activates_plugin_on_simulated_gfx950(plugins):
    extra = {envs.SWITCH: "1"}
    if plugins is not None:
        extra["VLLM_PLUGINS"] = plugins
    result = probe(simulation_env(**extra, **{envs.SELFTEST: "1"}))
    assert result["patched"] is True
    assert len(result["lines"]) == 1
    assert "FlyDSL paged MQA logits ACTIVE" in result["lines"][0]
    assert result["levels"] == ["INFO"]
    # vLLM's environment validation knows the variables that are set, and only those; vLLM's
    # torch.compile cache key does not change (none of them changes a compiled graph).
    assert result["new_names"] == sorted([envs.SWITCH, envs.SELFTEST])
    assert result["factors_unchanged"], result["new_factors"]


@pytest.mark.slow
def test_allowlist_without_plugin_skips_it():
    result = probe(simulation_env(**{envs.SWITCH: "1", "VLLM_PLUGINS": "some_other_plugin"}))
    assert result["patched"] is False
    assert result["lines"] == []


@pytest.mark.slow
def test_switch_off_imports_nothing_more():
    # Other variables of the plugin set, the switch not: still nothing in vLLM changes.
    result = probe(simulation_env(**{envs.SELFTEST: "0", envs.TUNED_CSV: "/nonexistent.csv"}))
    assert result["patched"] is False
    assert result["lines"] == [
        "vllm-flydsl-indexer: stock paged MQA logits "
        f"(FlyDSL inactive: {envs.SWITCH} is not set (1/true enables it))"
    ]
    # Quiet when off: DEBUG only (vLLM's loader already lists the plugins it loads).
    assert result["levels"] == ["DEBUG"]
    # vllm.envs is untouched: no new variable, the same torch.compile cache key.
    assert result["new_names"] == []
    assert result["factors_unchanged"], result["new_factors"]
    # Only the package itself and its switch parsing; no gates, kernel probe or aiter.
    assert set(result["new_modules"]) <= {
        "vllm_flydsl_indexer",
        "vllm_flydsl_indexer.envs",
    }, result["new_modules"]


@pytest.mark.slow
def test_not_gfx950_stays_stock():
    result = probe(simulation_env(gfx950=False, **{envs.SWITCH: "1"}))
    assert result["patched"] is False
    assert "not gfx950 (vLLM reports gfx942" in result["lines"][0]
    assert result["aiter_after_load"] == []  # vLLM would not import aiter here either


@pytest.mark.slow
def test_vllm_without_rocm_stays_stock():
    result = probe(simulation_env(rocm=False, **{envs.SWITCH: "1"}))
    assert result["patched"] is False
    assert "FlyDSL inactive: not ROCm" in result["lines"][0]


@pytest.mark.slow
def test_no_aiter_stays_stock():
    result = probe(simulation_env(aiter=False, **{envs.SWITCH: "1"}))
    assert result["patched"] is False
    # vLLM's own question, find_spec, stops it before any import.
    assert (
        "FlyDSL inactive: aiter is not installed (importlib.util.find_spec('aiter') is None)"
        in result["lines"][0]
    )


@pytest.mark.slow
def test_aiter_disabled_imports_no_aiter():
    result = probe(simulation_env(**{envs.SWITCH: "1", "VLLM_ROCM_USE_AITER": "0"}))
    assert result["patched"] is False
    assert result["aiter_after_load"] == []
    assert len(result["lines"]) == 1
    assert "FlyDSL inactive: VLLM_ROCM_USE_AITER is not 1" in result["lines"][0]
    assert result["factors_unchanged"], result["new_factors"]
