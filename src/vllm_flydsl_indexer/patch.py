# SPDX-License-Identifier: Apache-2.0
"""Install and uninstall the FlyDSL router over vLLM's decode-logits call.

Patch registry (one patch):

* **What:** ``vllm.v1.attention.ops.rocm_aiter_mla_sparse.rocm_fp8_paged_mqa_logits``.
* **Why:** on gfx950 it calls aiter's Gluon ``deepgemm_fp8_paged_mqa_logits``;
  aiter PR #4221 adds ``flydsl_fp8_paged_mqa_logits`` for the same job,
  reported 1.7x-3.1x faster on MI355X.
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

Why it is safe: everything is resolved before anything changes, the swap is
plain attribute assignment, and :func:`uninstall` restores every binding.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

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
    "wrap",
]


@dataclass
class InstalledPatch:
    original: Callable
    wrapper: Callable
    router: FlyDSLRouter
    modules: list[ModuleType]


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
    def rocm_fp8_paged_mqa_logits(*args, **kwargs):
        return route(caller_frame(1).f_globals.get("__name__"), *args, **kwargs)

    setattr(rocm_fp8_paged_mqa_logits, MARKER, True)
    rocm_fp8_paged_mqa_logits.router = router  # type: ignore[attr-defined]
    return rocm_fp8_paged_mqa_logits


def install(
    target: ModuleType,
    variant: KernelVariant,
    logger: logging.Logger,
    verifier: Callable | None = None,
    table: TunedTable | None = None,
) -> InstalledPatch:
    """Replace every binding of the target with the router. Idempotent."""
    global _installed
    current = vars(target)[TARGET_NAME]
    if getattr(current, MARKER, False):
        assert _installed is not None
        return _installed
    hooks = vllm_stock_hooks(target)
    router = FlyDSLRouter(current, variant, hooks, logger, verifier=verifier, table=table)
    rocm_fp8_paged_mqa_logits = wrap(current, router)
    modules = _bindings(current)
    for module in modules:
        setattr(module, TARGET_NAME, rocm_fp8_paged_mqa_logits)
    _installed = InstalledPatch(current, rocm_fp8_paged_mqa_logits, router, modules)
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
    _installed = None
