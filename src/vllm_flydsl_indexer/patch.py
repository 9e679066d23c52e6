# SPDX-License-Identifier: Apache-2.0
"""Install and uninstall the FlyDSL router over vLLM's decode-logits call.

Patch registry (two patches, installed and undone together):

1. The router.

* **What:** ``vllm.v1.attention.ops.rocm_aiter_mla_sparse.rocm_fp8_paged_mqa_logits``.
* **Why:** on gfx950 it calls aiter's Gluon ``deepgemm_fp8_paged_mqa_logits``;
  aiter PR #4221 adds ``flydsl_fp8_paged_mqa_logits`` for the same job, and
  AMD's MI355X measurements find each kernel faster at some shapes and batch
  sizes (:mod:`vllm_flydsl_indexer.tuning`). vLLM cannot make that per-shape
  choice; the patch lets the measured choice reach it. (PR #4221 reports its
  kernel 1.7-3.1x faster: that PR's own claim, not this patch's reason.)
* **How:** a wrapper with the same signature replaces the function object in
  the defining module and in every already-imported module that bound the
  same object (vLLM 0.33.0: ``vllm.models.deepseek_v41.amd.ops.sparse_indexer``
  binds it at import). Modules imported later, or importing the name at call
  time (``vllm.models.glm5next.amd.sparse_indexer``), get the replaced name.
  The wrapper reads the calling module from its caller's frame (one
  ``sys._getframe`` per call, no device work) and hands it to the router,
  which applies the call-site audit of :mod:`vllm_flydsl_indexer.callers`. It
  keeps the original as ``__wrapped__``; ineligible calls go to it unchanged,
  so the stock path is byte-for-byte stock.
* **Upstream:** aiter PR #4221 (the kernel; not merged) and aiter PR #6140 (the
  tuned dispatcher; open). Retire this patch once vLLM routes to FlyDSL itself.

2. The config watch (vLLM 0.33.0 and later; absent where vLLM has no MXFP4 indexer).

* **What:** ``vllm.platforms.rocm._maybe_default_dsv4_mxfp4_indexer``.
* **Why:** a model on aiter's MXFP4 indexer (vLLM's default for DeepSeek-V4 on
  MI350/MI355) never calls the target, so after ACTIVE the plugin would say
  nothing at all. Plugins load before any model config exists; this function
  is where vLLM's ROCm platform resolves the indexer cache dtype, once per
  config, never on the decode path.
* **How:** a wrapper calls the original unchanged, then reads the resolved
  config (:func:`vllm_flydsl_indexer.callers.config_objection`) and logs one
  WARNING naming the setting that selects the FP8 indexer.
  ``RocmPlatform.check_and_update_config`` calls the function by its module
  global, so replacing that global is enough (``tests/test_reach.py`` pins it).
* **Upstream:** none; retire it with the router.

Why it is safe: everything is resolved before anything changes (the router's
hooks hold every vLLM object they use, after :mod:`vllm_flydsl_indexer.content`
checked that the original does what they mirror), the swap is plain attribute
assignment, and :func:`uninstall` restores every binding.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from vllm_flydsl_indexer._logging import MODEL_STOCK_LINE, log_once
from vllm_flydsl_indexer.callers import MXFP4_DEFAULT_FUNCTION, MXFP4_DEFAULT_MODULE, config_objection
from vllm_flydsl_indexer.kernels import KernelVariant
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.stock import vllm_stock_hooks
from vllm_flydsl_indexer.target import MARKER, TARGET_NAME
from vllm_flydsl_indexer.tuning import TunedTable

__all__ = [
    "InstalledPatch",
    "install",
    "installed",
    "uninstall",
    "watch_config",
    "wrap",
]


@dataclass
class InstalledPatch:
    original: Callable
    wrapper: Callable
    router: FlyDSLRouter
    modules: list[ModuleType]
    # The module whose MXFP4 default is watched, and that function's original; None without one.
    config_watch: tuple[ModuleType, Callable] | None = None


_installed: InstalledPatch | None = None


def _bindings(original: Callable) -> list[ModuleType]:
    """Every imported module whose global ``TARGET_NAME`` is ``original``."""
    found = []
    for module in list(sys.modules.values()):
        try:
            namespace = vars(module)
        except TypeError:
            continue
        if namespace.get(TARGET_NAME) is original:
            found.append(module)
    return found


def wrap(original: Callable, router: FlyDSLRouter) -> Callable:
    """The function that replaces ``original``: the router, told which module called it.

    One ``sys._getframe`` per call, no device work. ``check`` and ``bench`` call
    this same wrapper from the call sites' modules.
    """
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
    """Wrap vLLM's MXFP4 default where this vLLM has one.

    Imports nothing: the gates imported vLLM's ROCm platform before any install
    (a caller outside vLLM, as the tools, may have none to watch).
    """
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
) -> InstalledPatch:
    """Replace every binding of the target with the router. Idempotent.

    Resolves the router's vLLM hooks first (:func:`vllm_stock_hooks`): where the original does not do
    what they mirror, or a name they use is gone, it raises before anything changes.
    """
    global _installed
    current = vars(target)[TARGET_NAME]
    if getattr(current, MARKER, False):
        assert _installed is not None
        return _installed
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
    for module in list(sys.modules.values()):
        try:
            namespace = vars(module)
        except TypeError:
            continue
        if namespace.get(TARGET_NAME) is _installed.wrapper:
            setattr(module, TARGET_NAME, _installed.original)
    if _installed.config_watch is not None:
        module, original = _installed.config_watch
        setattr(module, MXFP4_DEFAULT_FUNCTION, original)
    _installed = None
