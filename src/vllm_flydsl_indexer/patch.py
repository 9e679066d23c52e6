# SPDX-License-Identifier: Apache-2.0
"""Install and uninstall the FlyDSL router over vLLM's decode-logits call (vllm-ascend's patch record).

*What:* ``vllm.v1.attention.ops.rocm_aiter_mla_sparse.rocm_fp8_paged_mqa_logits``.
*Why:* on gfx950 it calls aiter's Gluon kernel; aiter's FlyDSL kernel is faster at some shapes (AMD's
MI355X measurements), a per-shape choice vLLM cannot make.
*How:* a same-signature wrapper replaces every imported binding of the function; it passes the caller's
module (one ``sys._getframe``) for the call-site audit and keeps the original as ``__wrapped__`` for
ineligible calls. :func:`uninstall` restores every binding.
*Upstream:* aiter PR #4221 (the kernel), #6140 (the tuned dispatcher). Retire once vLLM routes to FlyDSL.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.target import MARKER, TARGET_NAME


@dataclass
class InstalledPatch:
    original: Callable
    wrapper: Callable
    router: FlyDSLRouter
    modules: list[ModuleType]


_installed: InstalledPatch | None = None


def _bindings(fn: Callable) -> list[ModuleType]:
    """Every imported module whose global ``TARGET_NAME`` is ``fn``."""
    return [m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get(TARGET_NAME) is fn]


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
        return route(
            caller_frame(1).f_globals.get("__name__"), q_fp8, kv_cache_fp8, weights, context_lens,
            block_tables, schedule_metadata, max_model_len, compress_ratio=compress_ratio,
        )  # fmt: skip

    setattr(rocm_fp8_paged_mqa_logits, MARKER, True)
    rocm_fp8_paged_mqa_logits.router = router  # type: ignore[attr-defined]
    return rocm_fp8_paged_mqa_logits


def install(target: ModuleType, router_of: Callable[[Callable], FlyDSLRouter]) -> InstalledPatch:
    """Replace every binding of the target with the router ``router_of(original)`` makes. Idempotent."""
    global _installed
    current = vars(target)[TARGET_NAME]
    if getattr(current, MARKER, False) and _installed is not None:
        return _installed
    wrapper = wrap(current, router_of(current))
    modules = _bindings(current)
    for module in modules:
        setattr(module, TARGET_NAME, wrapper)
    _installed = InstalledPatch(current, wrapper, wrapper.router, modules)
    return _installed


def installed() -> InstalledPatch | None:
    return _installed


def uninstall() -> None:
    """Restore the original in every module that holds the wrapper."""
    global _installed
    if _installed is not None:
        for module in _bindings(_installed.wrapper):
            setattr(module, TARGET_NAME, _installed.original)
        _installed = None
