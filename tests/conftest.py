# SPDX-License-Identifier: Apache-2.0
"""The test process simulates gfx950 with aiter for real vLLM 0.33.0 on CPU.

The ``amdsmi`` double makes vLLM's platform detection report ROCm gfx950, and
the aiter double provides both kernels' contracts built on the reference.
This must happen before anything imports ``vllm.platforms``, so it is done at
conftest import. Scenarios that need another machine (no vLLM, not ROCm,
plugin loading) run in subprocesses via :func:`run_python`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_flydsl_indexer.kernels import identify_flydsl
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.target import StockHooks
from vllm_flydsl_indexer.tools.harness import plugin_logger
from vllm_flydsl_indexer.tools.reference import make_paged_problem

TESTS = Path(__file__).resolve().parent
DOUBLES = TESTS / "doubles"
AMDSMI_DOUBLE = DOUBLES / "amdsmi_gfx950"
AITER_DOUBLE = DOUBLES / "aiter_flydsl"

os.environ["VLLM_ROCM_USE_AITER"] = "1"
# The node cache of every test process lives in this session's own directory, never the user's.
CACHE_ROOT = tempfile.mkdtemp(prefix="vllm-flydsl-indexer-tests-")
os.environ["VLLM_CACHE_ROOT"] = CACHE_ROOT
# The routing tests were written for "no table: FlyDSL wherever eligible"; tests of the tables and of this
# node's measurement (tests/test_measure.py) set or clear it themselves.
os.environ["VLLM_FLYDSL_INDEXER_TUNED_CSV"] = "none"
# A suite started in the background (`nohup`, a shell's `&`) inherits SIGHUP or SIGINT ignored, and so
# would every process it starts: the signal tests need what a terminal gives, so the defaults come back.
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
for path in (AITER_DOUBLE, AMDSMI_DOUBLE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def simulation_env(*, gfx950: bool = True, aiter: bool = True, rocm: bool = True, **extra: str) -> dict:
    """Environment for a subprocess: which doubles are on its path, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "AMDSMI_DOUBLE"))}
    paths = []
    if aiter:
        paths.append(str(AITER_DOUBLE))
    if rocm:
        paths.append(str(AMDSMI_DOUBLE))
        env["AMDSMI_DOUBLE_ARCH"] = "gfx950" if gfx950 else "gfx942"
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["VLLM_ROCM_USE_AITER"] = "1"
    env["VLLM_CACHE_ROOT"] = CACHE_ROOT
    env.update(extra)
    return env


def import_call_site(name: str):
    """A caller's module, or ``None`` when this vLLM cannot import it.

    Not every vLLM in the window has every call site (0.32.0 has no DeepSeek-V4.1
    AMD ops; its GLM-5-next package needs torchvision, absent from CI's 0.32 venv).
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def call_site_or_skip(name: str):
    """:func:`import_call_site`, skipping the test with the reason when it is absent."""
    module = import_call_site(name)
    if module is None:
        pytest.skip(f"this vLLM cannot import the call-site module {name}")
    return module


# The aiter double's modules whose content depends on $AITER_DOUBLE_FLYDSL / $AITER_DOUBLE_DISPATCHER.
AITER_DOUBLE_MODULES = (
    "aiter.ops.flydsl",
    "aiter.ops.flydsl.kernels",
    "aiter.ops.flydsl.kernels.mqa_logits",
    "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits",
    "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950",
    "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_early",
    "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_padded_q",
    "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_entry",
    "aiter.paged_mqa_logits",
)


def bind_module(name: str, module: types.ModuleType | None) -> None:
    """Point ``sys.modules`` and the parent package's attribute at the same ``module``.

    ``None`` removes both, so the next import loads the module afresh.
    """
    parent_name, _, child = name.rpartition(".")
    parent = sys.modules.get(parent_name)
    if module is None:
        sys.modules.pop(name, None)
        if parent is not None and hasattr(parent, child):
            delattr(parent, child)
    else:
        sys.modules[name] = module
        if parent is not None:
            setattr(parent, child, module)


@pytest.fixture
def aiter_as(monkeypatch):
    """Make the aiter double look like one revision: ``aiter_as(flydsl=..., dispatcher=...)``.

    The double's modules are re-imported under the new settings; afterwards the
    originals go back into ``sys.modules`` *and* onto their parent packages, so
    ``import a.b as m`` and ``importlib.import_module("a.b")`` agree again.
    """
    originals = {name: sys.modules.get(name) for name in AITER_DOUBLE_MODULES}

    def configure(flydsl: str = "general", dispatcher: bool = False) -> None:
        monkeypatch.setenv("AITER_DOUBLE_FLYDSL", flydsl)
        monkeypatch.setenv("AITER_DOUBLE_DISPATCHER", "1" if dispatcher else "0")
        for name in reversed(AITER_DOUBLE_MODULES):
            bind_module(name, None)

    yield configure
    for name in AITER_DOUBLE_MODULES:
        bind_module(name, originals[name])


def run_python(code: str, env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this venv."""
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def target():
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as module

    assert module._ON_GFX950, "the amdsmi double did not make vLLM see gfx950"
    return module


@pytest.fixture
def workspace(monkeypatch):
    """vLLM's real workspace manager on CPU."""
    import torch
    from vllm.v1.worker import workspace as ws

    if not torch.accelerator.is_available():
        # vLLM 0.32's resize path empties the accelerator cache, which a CPU-only torch refuses.
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    ws.reset_workspace_manager()
    ws.init_workspace_manager(torch.device("cpu"))
    yield ws
    ws.reset_workspace_manager()


@pytest.fixture
def aiter_calls():
    import aiter

    aiter.CALLS.clear()
    yield aiter.CALLS
    aiter.CALLS.clear()


@pytest.fixture
def fresh_register(monkeypatch):
    """``register()`` as in a fresh process; the patch is undone afterwards."""
    import vllm.envs

    import vllm_flydsl_indexer
    from vllm_flydsl_indexer import patch

    monkeypatch.setattr(vllm_flydsl_indexer, "_registered", False)
    # What register() may add to vllm.envs is undone too.
    monkeypatch.setattr(vllm.envs, "environment_variables", dict(vllm.envs.environment_variables))
    monkeypatch.setattr(vllm.envs, "compile_factors", vllm.envs.compile_factors)
    yield vllm_flydsl_indexer.register
    patch.uninstall()


@pytest.fixture
def installed(target, monkeypatch, fresh_register, plugin_log):
    """The patch installed through ``register()`` with the switch on."""
    from vllm_flydsl_indexer import envs, patch

    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    assert patch.installed() is not None, [r.getMessage() for r in plugin_log]
    return patch.installed()


@pytest.fixture
def plugin_log():
    """Records the plugin's log lines (vLLM's logger does not propagate to root)."""
    import logging

    from vllm_flydsl_indexer.envs import LOGGER_NAME

    records: list[logging.LogRecord] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Handler(level=logging.DEBUG)
    logger = logging.getLogger(LOGGER_NAME)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    forget_once()
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)
    forget_once()


def forget_once() -> None:
    """Forget what was logged once: vLLM's ``*_once`` caches."""
    import vllm.logger as vllm_logger

    for name in ("debug", "info", "warning", "error"):
        cached = getattr(vllm_logger, f"_print_{name}_once", None)
        if cached is not None:
            cached.cache_clear()


# The router on its own (no vLLM): what tests that build a router by hand share.

# vLLM's logger for the plugin, as register() gets it (its info_once/warning_once/error_once included).
LOGGER = plugin_logger()  # where vLLM is absent (the device runs), a stdlib logger with the same methods


class Recorder:
    """Stands in for vLLM's original function: records calls, returns a marker."""

    def __init__(self):
        self.calls = []
        self.marker = torch.full((1,), 7.0)

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.marker


def flydsl_double():
    from aiter.ops.flydsl.kernels.mqa_logits import fp8_paged_mqa_logits as general

    return general.flydsl_fp8_paged_mqa_logits


def general_variant(fn=None):
    """The general (PR #4221) variant, identified from its double; ``fn`` replaces the launch target."""
    from aiter.ops.flydsl.kernels.mqa_logits import fp8_paged_mqa_logits as general

    variant = identify_flydsl(general.flydsl_fp8_paged_mqa_logits, general, "general double")
    assert variant.name == "general", variant
    return variant if fn is None else dataclasses.replace(variant, fn=fn)


def router_for(original, fn=None, hooks_=None, **kw):
    """The router's rules on their own: the self-test is off unless asked for, since ``original`` is
    often a :class:`Recorder`, not a stock arm (tests/test_selftest.py tests the self-test)."""
    kw.setdefault("self_test", False)
    return FlyDSLRouter(original, general_variant(fn), hooks_ or hooks(), LOGGER, **kw)


def hooks(buffer=None, dcp=1, gluon=True, preshuffle=lambda bs: bs > 1):
    return StockHooks(
        preshuffle=preshuffle,
        gluon_objection=lambda ratio, bs: None if gluon else "stock would not run Gluon here (a test hook)",
        output_buffer=lambda rows, mml: (
            buffer if buffer is not None else torch.full((rows, mml), float("nan"))
        ),
        per_sequence_lens=lambda t: t[:, -1].contiguous() if t.dim() == 2 and t.shape[1] > 1 else t,
        dcp_world_size=lambda: dcp,
    )


def base_problem(**kw):
    args = dict(next_n=2, heads=64, head_dim=128, block_size=64, preshuffle=True)
    args.update(kw)
    return make_paged_problem([130, 5, 64], generator=torch.Generator().manual_seed(5), **args)


def as_args(p, **override):
    args = dict(
        q_fp8=p.q_fp8,
        kv_cache_fp8=p.kv_cache,
        weights=p.weights,
        context_lens=p.context_lens,
        block_tables=p.block_tables,
        schedule_metadata=None,
        max_model_len=p.max_model_len,
    )
    args.update(override)
    return tuple(args.values())


class OpAudit(TorchDispatchMode):
    """Records every aten op the adapter itself dispatches (kernel excluded)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list]] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            tensors = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            self.ops.append((func._schema.name, tensors))
        return func(*args, **(kwargs or {}))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow_except(*ids)``: every parametrised case is ``slow`` but those ids.

    Runs before ``-m`` selects, so ``-m slow`` and the default ``-m 'not slow'`` see the mark.
    """
    for item in items:
        mark = item.get_closest_marker("slow_except")
        callspec = getattr(item, "callspec", None)
        if mark is not None and (callspec is None or callspec.id not in mark.args):
            item.add_marker(pytest.mark.slow)
