# SPDX-License-Identifier: Apache-2.0
"""Install and uninstall the FlyDSL router over vLLM's decode-logits call. Two patches, installed and
undone together (vllm-ascend's patch-record format):

1. **The router.** *What:* ``vllm.v1.attention.ops.rocm_aiter_mla_sparse.rocm_fp8_paged_mqa_logits``.
   *Why:* on gfx950 it calls aiter's Gluon kernel; aiter PR #4221 adds a FlyDSL kernel for the same job,
   and AMD's MI355X measurements find each faster at some shapes and batch sizes. vLLM cannot make that
   per-shape choice; the patch lets the measured choice reach it. *How:* a wrapper with the same
   signature replaces the function in the defining module and in every imported module that bound the
   same object (modules imported later, or importing the name at call time, get the replaced name). It
   reads the calling module from its caller's frame (one ``sys._getframe`` per call) for the call-site
   audit, and keeps the original as ``__wrapped__``: ineligible calls go to it unchanged. *Upstream:*
   aiter PR #4221 (the kernel) and #6140 (the tuned dispatcher). Retire it once vLLM routes to FlyDSL.
2. **The config watch** (vLLM 0.33.0 and later). *What:*
   ``vllm.platforms.rocm._maybe_default_dsv4_mxfp4_indexer``. *Why:* a model on aiter's MXFP4 indexer
   never calls the target, so after ACTIVE the plugin would say nothing. *How:* the original runs
   unchanged, then one WARNING where the resolved config never reaches the target
   (``RocmPlatform.check_and_update_config`` calls it by its module global). *Upstream:* none.

Everything is resolved before anything changes, the swap is plain attribute assignment, and
:func:`uninstall` restores every binding.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from vllm_flydsl_indexer.envs import MODEL_STOCK_LINE, log_once
from vllm_flydsl_indexer.kernels import KernelVariant
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.target import (
    MARKER,
    MXFP4_DEFAULT_FUNCTION,
    MXFP4_DEFAULT_MODULE,
    TARGET_NAME,
    StockHooks,
    config_objection,
    vllm_stock_hooks,
)
from vllm_flydsl_indexer.tuning import TunedTable

__all__ = ["InstalledPatch", "install", "installed", "uninstall", "watch_config", "wrap"]


@dataclass
class InstalledPatch:
    original: Callable
    wrapper: Callable
    router: FlyDSLRouter
    modules: list[ModuleType]
    # The module whose MXFP4 default is watched, and that function's original; None without one.
    config_watch: tuple[ModuleType, Callable] | None = None


_installed: InstalledPatch | None = None


def _bindings(fn: Callable) -> list[ModuleType]:
    """Every imported module whose global ``TARGET_NAME`` is ``fn``."""
    found = []
    for module in list(sys.modules.values()):
        try:
            namespace = vars(module)
        except TypeError:
            continue
        if namespace.get(TARGET_NAME) is fn:
            found.append(module)
    return found


def wrap(original: Callable, router: FlyDSLRouter) -> Callable:
    """The function that replaces ``original``: the router, told which module called it (``check`` and
    ``bench`` call this same wrapper from the call sites' modules)."""
    route = router.call_from
    caller_frame = sys._getframe

    @functools.wraps(original)
    def rocm_fp8_paged_mqa_logits(
        q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata, max_model_len, *,
        compress_ratio=1,
    ):  # fmt: skip
        caller = caller_frame(1).f_globals.get("__name__")
        return route(
            caller, q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata,
            max_model_len, compress_ratio=compress_ratio,
        )  # fmt: skip

    setattr(rocm_fp8_paged_mqa_logits, MARKER, True)
    rocm_fp8_paged_mqa_logits.router = router  # type: ignore[attr-defined]
    return rocm_fp8_paged_mqa_logits


def watch_config(original: Callable, logger: logging.Logger) -> Callable:
    """``original`` (vLLM's MXFP4 default), then one WARNING when the model never calls the target."""

    @functools.wraps(original)
    def watched(vllm_config, *args, **kwargs):
        result = original(vllm_config, *args, **kwargs)
        try:
            reason = config_objection(vllm_config)
        except Exception as e:  # noqa: BLE001 - a warning never fails vLLM's config
            logger.debug("%s model config unreadable (%s: %s)", MODEL_STOCK_LINE, type(e).__name__, e)
            return result
        if reason is not None:
            log_once(logger, logging.WARNING, "%s %s", MODEL_STOCK_LINE, reason)
        return result

    setattr(watched, MARKER, True)
    return watched


def _install_config_watch(logger: logging.Logger) -> tuple[ModuleType, Callable] | None:
    """Wrap vLLM's MXFP4 default where this vLLM has one (imports nothing: the gates imported it)."""
    module = sys.modules.get(MXFP4_DEFAULT_MODULE)
    original = getattr(module, MXFP4_DEFAULT_FUNCTION, None)
    if module is None or original is None or getattr(original, MARKER, False):
        return None
    setattr(module, MXFP4_DEFAULT_FUNCTION, watch_config(original, logger))
    return module, original


def install(
    target: ModuleType,
    variant: KernelVariant,
    logger: logging.Logger,
    verifier: Callable | None = None,
    table: TunedTable | None = None,
    self_test: bool = True,
    hooks: StockHooks | None = None,
) -> InstalledPatch:
    """Replace every binding of the target with the router. Idempotent. ``hooks``: the router's vLLM hooks
    the target gate resolved; without them they are resolved first (:func:`vllm_stock_hooks`), so a
    drifted target raises before anything changes."""
    global _installed
    current = vars(target)[TARGET_NAME]
    if getattr(current, MARKER, False):
        assert _installed is not None
        return _installed
    if hooks is None:
        hooks = vllm_stock_hooks(target)
    router = FlyDSLRouter(
        current, variant, hooks, logger, verifier=verifier, table=table, self_test=self_test
    )
    rocm_fp8_paged_mqa_logits = wrap(current, router)
    modules = _bindings(current)
    watch = _install_config_watch(logger)
    for module in modules:
        setattr(module, TARGET_NAME, rocm_fp8_paged_mqa_logits)
    _installed = InstalledPatch(current, rocm_fp8_paged_mqa_logits, router, modules, watch)
    return _installed


def installed() -> InstalledPatch | None:
    return _installed


def uninstall() -> None:
    """Restore the original in every module that holds the wrapper."""
    global _installed
    if _installed is None:
        return
    for module in _bindings(_installed.wrapper):
        setattr(module, TARGET_NAME, _installed.original)
    if _installed.config_watch is not None:
        module, original = _installed.config_watch
        setattr(module, MXFP4_DEFAULT_FUNCTION, original)
    _installed = None
