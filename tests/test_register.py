# SPDX-License-Identifier: Apache-2.0
"""register(): gates in order, one log line, idempotence, every binding, undo."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import random
from pathlib import Path

import pytest

from vllm_flydsl_indexer import envs, gates, patch
from vllm_flydsl_indexer import kernels as identification
from vllm_flydsl_indexer.target import MARKER

TARGET = "rocm_fp8_paged_mqa_logits"
V41 = "vllm.models.deepseek_v41.amd.ops.sparse_indexer"


def lines(records):
    return [r.getMessage() for r in records]


def assert_untouched(target, original):
    assert vars(target)[TARGET] is original
    assert not getattr(vars(target)[TARGET], MARKER, False)
    assert patch.installed() is None


@pytest.fixture
def original(target):
    fn = vars(target)[TARGET]
    assert not getattr(fn, MARKER, False)
    return fn


def test_active_under_gfx950_simulation_logs_one_line(target, original, installed, plugin_log):
    msgs = lines(plugin_log)
    assert len(msgs) == 1
    assert msgs[0].startswith("vllm-flydsl-indexer: FlyDSL paged MQA logits ACTIVE")
    assert plugin_log[0].levelno == logging.INFO
    assert "aiter.ops.flydsl.flydsl_fp8_paged_mqa_logits" in msgs[0]
    # ACTIVE is never a silent promise for every model: the line says who reaches it and who tells.
    assert "only models whose FP8 indexer calls it on a layer-contiguous cache reach it" in msgs[0]
    assert msgs[0].endswith("vllm-flydsl-indexer doctor --model MODEL tells whether yours does)")
    wrapper = vars(target)[TARGET]
    assert wrapper is not original and wrapper.__wrapped__ is original
    patch.uninstall()
    assert vars(target)[TARGET] is original


def test_register_reads_vllms_target_once(
    target, original, monkeypatch, fresh_register, plugin_log, workspace, aiter_calls
):
    """vLLM's target source is read and parsed once per process (issue 43): the target gate's
    fingerprint and its caller's (one file), and the hooks it resolved are what the install uses. A later
    evaluation (doctor in the same process) reads nothing again, nor do the next_n 2 calls from that
    caller, whose route looks its fingerprint up (issue 49)."""
    import ast

    from vllm_flydsl_indexer import target as target_module

    source = original.__code__.co_filename
    reads, parsed = [], []
    read_capped, parse = target_module.read_capped, ast.parse
    monkeypatch.setattr(
        target_module, "read_capped", lambda path, *a: reads.append(path) or read_capped(path, *a)
    )
    monkeypatch.setattr(ast, "parse", lambda *a, **k: parsed.append(1) or parse(*a, **k))
    target_module._defs.cache_clear()  # as in a fresh process
    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    installed = patch.installed()
    assert installed is not None, lines(plugin_log)
    assert reads == [source] and len(parsed) == 1, (reads, parsed)
    assert installed.router.hooks.per_sequence_lens is target._per_sequence_context_lens
    assert gates.evaluate(full=True).gates == gates.evaluate().gates
    assert reads == [source] and len(parsed) == 1, (reads, parsed)
    from vllm_flydsl_indexer.tools.paths import call_site_in
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    lens = [random.randrange(2, 300) for _ in range(3)]
    p = make_paged_problem(lens, next_n=2, heads=32, head_dim=128, block_size=64, preshuffle=True)
    site = call_site_in(target)  # code in the defining module, as its indexer op calls the target
    for _ in range(3):
        site(vars(target)[TARGET], p.call_args(), {"compress_ratio": 1})
    assert installed.router.calls_taken == 3 and aiter_calls[-1][0] == "flydsl", aiter_calls
    assert reads == [source] and len(parsed) == 1, (reads, parsed)


def test_register_twice_wraps_once(target, original, monkeypatch, fresh_register, plugin_log):
    monkeypatch.setenv(envs.SWITCH, "true")
    fresh_register()
    first = vars(target)[TARGET]
    fresh_register()
    assert vars(target)[TARGET] is first
    assert first.__wrapped__ is original
    # Even a second install (as a new register() in the same process would try) does not stack.
    again = patch.install(target, lambda original: None)
    assert again.wrapper is first and first.__wrapped__ is original
    assert len(lines(plugin_log)) == 1


def test_deepseek_v41_module_binding_is_patched(target, original, monkeypatch, fresh_register):
    try:
        v41 = importlib.import_module(V41)
    except ModuleNotFoundError:
        pytest.skip(f"this vLLM has no {V41} (0.32.0); 0.33.0 binds the name there")
    assert vars(v41)[TARGET] is original, "vLLM 0.33.0 binds the name at import"
    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    assert vars(v41)[TARGET] is vars(target)[TARGET]
    assert vars(v41)[TARGET].__wrapped__ is original
    assert v41 in patch.installed().modules
    patch.uninstall()
    assert vars(v41)[TARGET] is original


def test_signature_is_preserved(target, installed):

    assert inspect.signature(vars(target)[TARGET]) == inspect.signature(installed.original)


@pytest.mark.parametrize("value", ["", "0", "false", "FALSE", " False "])
def test_switch_off_patches_nothing(target, original, monkeypatch, fresh_register, plugin_log, value):
    monkeypatch.setenv(envs.SWITCH, value)
    fresh_register()
    assert_untouched(target, original)
    reason = (
        f"{envs.SWITCH} is not set (1/true enables it)"
        if not value.strip()
        else f"{envs.SWITCH}={value.strip()} (off; 1/true enables it)"
    )
    assert lines(plugin_log) == [f"vllm-flydsl-indexer: stock paged MQA logits (FlyDSL inactive: {reason})"]
    assert "is not set to 1" not in lines(plugin_log)[0]  # "true" enables it too
    assert plugin_log[0].levelno == logging.DEBUG  # nobody asked for FlyDSL: quiet


@pytest.mark.parametrize("value", ["1", "TRUE", "True", "true"])
def test_switch_on_values(monkeypatch, value):
    monkeypatch.setenv(envs.SWITCH, value)
    assert envs.read_flag(envs.SWITCH) == (True, None)


@pytest.mark.parametrize("value", ["yes", "2", "on", "enable"])
def test_bad_switch_value_warns_and_stays_off(
    target, original, monkeypatch, fresh_register, plugin_log, value
):
    monkeypatch.setenv(envs.SWITCH, value)
    fresh_register()
    assert_untouched(target, original)
    assert len(plugin_log) == 1
    record = plugin_log[0]
    assert record.levelno == logging.WARNING
    msg = record.getMessage()
    assert envs.SWITCH in msg and repr(value) in msg and "1/0/true/false" in msg


def _fail_gate(monkeypatch, gate):
    if gate == "version":
        monkeypatch.setattr(gates, "vllm_version", lambda: "0.31.2")
        return "vLLM 0.31.2 is outside the tested window 0.32.x-0.34.x"
    if gate == "rocm":
        from vllm.platforms import current_platform

        monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: False)
        return "not ROCm"
    if gate == "gfx950":
        import vllm.platforms.rocm as rocm

        monkeypatch.setattr(rocm, "_ON_GFX950", False)
        monkeypatch.setattr(rocm, "_GCN_ARCH", "gfx942:sramecc+:xnack-")
        return "not gfx950 (vLLM reports gfx942"
    if gate == "aiter":
        import vllm.envs

        monkeypatch.setenv("VLLM_ROCM_USE_AITER", "0")
        vllm.envs.disable_envs_cache()
        return "VLLM_ROCM_USE_AITER is not 1, so vLLM does not use aiter"
    if gate == "aiter-missing":
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "aiter" else real(name, *a)
        )
        return "aiter is not installed (importlib.util.find_spec('aiter') is None)"
    if gate == "kernel":
        monkeypatch.setattr(identification, "KERNEL_MODULES", ("aiter.ops.flydsl_missing",))
        return "aiter.ops.flydsl_missing: ModuleNotFoundError"
    if gate == "target":
        import vllm.v1.attention.ops.rocm_aiter_mla_sparse as t

        def rocm_fp8_paged_mqa_logits(
            q_fp8,
            kv_cache_fp8,
            weights,
            context_lens,
            block_tables,
            schedule_metadata,
            max_model_len,
            *,
            compress_ratio=1,
            extra=0,
        ):
            return None

        monkeypatch.setattr(t, TARGET, rocm_fp8_paged_mqa_logits)
        return "its source is unreadable (LookupError: no def rocm_fp8_paged_mqa_logits"
    raise AssertionError(gate)


@pytest.mark.parametrize("gate", ["version", "rocm", "gfx950", "aiter", "aiter-missing", "kernel", "target"])
def test_each_failing_gate_leaves_vllm_untouched(target, monkeypatch, fresh_register, plugin_log, gate):
    monkeypatch.setenv(envs.SWITCH, "1")
    reason = _fail_gate(monkeypatch, gate)
    before = vars(target)[TARGET]
    fresh_register()
    assert vars(target)[TARGET] is before
    assert patch.installed() is None
    msgs = lines(plugin_log)
    assert len(msgs) == 1
    assert msgs[0].startswith("vllm-flydsl-indexer: stock paged MQA logits (FlyDSL inactive: ")
    assert reason in msgs[0]
    # The user asked for FlyDSL: not getting it must show where INFO is dropped.
    assert plugin_log[0].levelno == logging.WARNING


def test_kernel_probe_reports_non_import_errors(monkeypatch):
    import sys
    import types

    broken = types.ModuleType("aiter_broken_probe")

    def boom(name):
        raise RuntimeError("flydsl 0.0.9 does not match aiter's pin")

    monkeypatch.setitem(sys.modules, "aiter_broken_probe", broken)
    monkeypatch.setattr(identification.importlib, "import_module", boom)
    variant, reason = identification.find_kernel()
    assert variant is None
    assert "RuntimeError: flydsl 0.0.9 does not match aiter's pin" in reason


def test_kernel_without_keyword_only_knobs_is_refused(monkeypatch):
    import aiter.ops.flydsl as fly

    def flydsl_fp8_paged_mqa_logits(q, kv, w, out, ctx, bt, mml, Preshuffle=False, KVBlockSize=1):
        return out

    monkeypatch.setattr(fly, "flydsl_fp8_paged_mqa_logits", flydsl_fp8_paged_mqa_logits)
    monkeypatch.setattr(identification, "KERNEL_MODULES", ("aiter.ops.flydsl",))
    variant, reason = identification.find_kernel()
    assert variant is None and "lacks keyword-only Preshuffle, KVBlockSize" in reason


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.33.1.dev12+g1234abc.rocm700", True),
        ("0.32.0+rocm7.0.0", True),
        ("0.31.9", False),
        ("0.34.0", True),
        ("0.34.2rc1+rocm710", True),
        ("0.35.0", False),
        ("0.31.0", False),
        ("garbage", False),
        (None, False),
    ],
)
def test_version_window(version, ok):
    assert gates.check_version(version)[1] is ok


def test_a_newer_vllm_stays_stock_whatever_the_environment_says(monkeypatch, fresh_register, plugin_log):
    """A release is supported once audited: the opt-in this package once read is gone."""
    monkeypatch.setenv(envs.SWITCH, "1")
    monkeypatch.setenv("VLLM_FLYDSL_INDEXER_ALLOW_UNTESTED_VLLM", "1")
    monkeypatch.setattr(gates, "vllm_version", lambda: "0.35.0")
    fresh_register()
    assert patch.installed() is None
    assert "vLLM 0.35.0 is outside the tested window 0.32.x-0.34.x" in lines(plugin_log)[0]


def test_switch_off_leaves_vllm_envs_alone(fresh_register, monkeypatch):
    import vllm.envs

    for name in envs.ALL_VARIABLES:
        monkeypatch.setenv(name, "0")
    table = dict(vllm.envs.environment_variables)
    factors = vllm.envs.compile_factors
    fresh_register()
    assert vllm.envs.environment_variables == table
    assert vllm.envs.compile_factors is factors


def test_switch_on_registers_only_set_variables_and_keeps_them_out_of_the_compile_key(
    fresh_register, monkeypatch, plugin_log
):
    import vllm.envs

    for name in envs.ALL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(envs.SWITCH, "1")
    monkeypatch.setenv(envs.TUNED_CSV, str(random.random()))
    vllm.envs.disable_envs_cache()
    before = vllm.envs.compile_factors()
    fresh_register()
    registered = {name for name in envs.ALL_VARIABLES if name in vllm.envs.environment_variables}
    assert registered == {envs.SWITCH, envs.TUNED_CSV}
    assert vllm.envs.environment_variables[envs.SWITCH]() == "1"
    # vLLM's validation no longer calls them unknown; its compile cache key is what it was,
    # and stays so when their values change (none changes a compiled graph).
    assert vllm.envs.compile_factors() == before
    monkeypatch.setenv(envs.TUNED_CSV, str(random.random()))
    assert vllm.envs.compile_factors() == before
    # A variable vLLM itself hashes still counts.
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_MLA", "0" if before.get("VLLM_ROCM_USE_AITER_MLA") else "1")
    assert vllm.envs.compile_factors() != before


def test_vllm_that_declares_the_switch_routes_itself(
    target, original, fresh_register, monkeypatch, plugin_log
):
    import vllm.envs

    monkeypatch.setenv(envs.SWITCH, "1")
    vllm.envs.environment_variables[envs.SWITCH] = lambda: os.environ.get(envs.SWITCH)
    table = dict(vllm.envs.environment_variables)
    fresh_register()
    assert_untouched(target, original)
    assert vllm.envs.environment_variables == table
    msgs = lines(plugin_log)
    assert msgs == [
        f"vllm-flydsl-indexer: vLLM routes the paged MQA logits itself (vllm.envs declares {envs.SWITCH}); "
        "the plugin patches nothing"
    ]
    assert plugin_log[0].levelno == logging.INFO
    # doctor says the same.
    from vllm_flydsl_indexer.tools import doctor

    data = doctor.report({envs.SWITCH: "1"})
    assert data["arm"] == "vllm" and data["log_line"] == msgs[0]
    text = doctor.render(data)
    assert "  2. in-tree FAIL vllm.envs declares" in text
    assert "arm:      vLLM's own route (the plugin patches nothing)" in text


def test_register_never_raises(monkeypatch, fresh_register, plugin_log, target, original):
    monkeypatch.setenv(envs.SWITCH, "1")

    def explode(environ=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(gates, "evaluate", explode)
    fresh_register()
    assert_untouched(target, original)
    msgs = lines(plugin_log)
    assert len(msgs) == 1 and "unexpected error during registration: RuntimeError: boom" in msgs[0]


# What vllm.logger raises on import, other than ImportError, in a fresh process; each is caught.
BROKEN_LOGGER = r"""
import importlib.abc, json, logging, os, sys

class Custom(Exception):
    pass

RAISE = {"RecursionError": RecursionError("maximum recursion depth exceeded"),
         "SystemExit": SystemExit(3), "Custom": Custom("vllm.logger is broken")}

class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm.logger":
            raise RAISE[os.environ["RAISE"]]

records = []
class H(logging.Handler):
    def emit(self, r): records.append((r.name, r.levelname, r.getMessage()))
logging.getLogger("vllm.plugins.flydsl_indexer").addHandler(H())
sys.meta_path.insert(0, Broken())
import vllm_flydsl_indexer
vllm_flydsl_indexer.register()
vllm_flydsl_indexer.register()  # idempotent: nothing more
print("RESULT" + json.dumps({
    "records": records,
    "plugin_modules": sorted(m for m in sys.modules if m.startswith("vllm_flydsl_indexer")),
    "vllm_logger": "vllm.logger" in sys.modules,
}))
"""


@pytest.mark.parametrize(
    "raised,says",
    [
        ("RecursionError", "RecursionError: maximum recursion depth exceeded"),
        ("SystemExit", "SystemExit: 3"),
        ("Custom", "Custom: vllm.logger is broken"),
    ],
)
@pytest.mark.slow_except("Custom-Custom: vllm.logger is broken")
def test_register_never_raises_when_vllms_logger_is_broken(raised, says):
    """Issue 45 item 18: importing vllm.logger raises something other than ImportError. register() returns,
    logs one WARNING on the stdlib logger, and imports nothing that would touch vLLM."""
    import json

    import vllm_flydsl_indexer
    from conftest import run_python, simulation_env

    env = simulation_env(**{envs.SWITCH: "1", "RAISE": raised})
    # The copy of the package this process tests, in the subprocess too.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(vllm_flydsl_indexer.__file__).parents[1]), env["PYTHONPATH"]]
    )
    proc = run_python(BROKEN_LOGGER, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
    assert result["records"] == [
        [
            envs.LOGGER_NAME,
            "WARNING",
            f"vllm-flydsl-indexer: stock paged MQA logits (FlyDSL inactive: vllm.logger unusable: {says})",
        ]
    ]
    assert result["plugin_modules"] == ["vllm_flydsl_indexer", "vllm_flydsl_indexer.envs"]
    assert not result["vllm_logger"]


def test_the_plugin_logs_through_vllms_logger():
    """The runtime always runs under vLLM's logger (issue 43): its once-methods, its handler."""
    import vllm.logger

    from vllm_flydsl_indexer.envs import LOGGER_NAME, get_logger

    logger = get_logger()
    assert logger is vllm.logger.init_logger(LOGGER_NAME) and logger.name == LOGGER_NAME
    assert all(callable(getattr(logger, f"{level}_once", None)) for level in ("info", "warning", "error"))


def test_an_active_line_that_carries_warnings_is_a_warning(target, monkeypatch, fresh_register, plugin_log):
    """ACTIVE, but a variable of the plugin did not parse: the caveat must show where INFO is dropped."""
    monkeypatch.setenv(envs.SWITCH, "1")
    monkeypatch.setenv(envs.SELFTEST, "yes")
    fresh_register()
    assert patch.installed() is not None
    assert patch.installed().router.self_test is True  # the default, as the caveat says
    (line,) = lines(plugin_log)
    assert line.startswith("vllm-flydsl-indexer: FlyDSL paged MQA logits ACTIVE"), line
    assert line.endswith(f"[{envs.SELFTEST}='yes' is not one of 1/0/true/false (any case); treating it as 1]")
    assert plugin_log[0].levelno == logging.WARNING


def test_the_gates_say_the_same_after_register_added_the_plugins_variables(
    target, monkeypatch, fresh_register, plugin_log
):
    """register() adds the set variables to vllm.envs; its own getters are not vLLM declaring the switch."""
    import vllm.envs

    from vllm_flydsl_indexer.tools import doctor

    monkeypatch.setenv(envs.SWITCH, "1")
    monkeypatch.setenv(envs.SELFTEST, "1")
    first = gates.evaluate()
    assert first.active and not first.in_tree
    fresh_register()
    assert patch.installed() is not None
    assert {envs.SWITCH, envs.SELFTEST} <= set(vllm.envs.environment_variables)
    again = gates.evaluate(full=True)
    assert (again.active, again.in_tree, again.reason) == (True, False, "all gates passed")
    assert ("in-tree", True, "vLLM does not route it itself") in again.gates
    assert [g[:2] for g in again.gates] == [g[:2] for g in first.gates]
    assert doctor.report({envs.SWITCH: "1"})["arm"] == "flydsl"
