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

import torch

from vllm_flydsl_indexer.adapter import FlyDSLRouter, StockHooks
from vllm_flydsl_indexer.gates import TARGET_NAME
from vllm_flydsl_indexer.kernels import KernelVariant
from vllm_flydsl_indexer.tuning import TunedTable

MARKER = "_vllm_flydsl_indexer"


@dataclass
class InstalledPatch:
    original: Callable
    wrapper: Callable
    router: FlyDSLRouter
    modules: list[ModuleType]


_installed: InstalledPatch | None = None


def vllm_stock_hooks(target: ModuleType) -> StockHooks:
    """Hooks that ask vLLM exactly what the original function asks it.

    Module globals are looked up at call time, as the original does, so a
    test that patches them sees both arms change together.
    """
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.distributed.parallel_state import get_dcp_world_size_and_rank

    def stock_uses_gluon(compress_ratio: int, block_size: int) -> bool:
        on_gfx9 = target._ON_GFX950 or target._ON_GFX942
        if on_gfx9 and target._indexer_k_is_c4a_block_flat(compress_ratio) and block_size > 1:
            return False  # vLLM's own C4A Triton route
        if not (rocm_aiter_ops.is_enabled() or rocm_aiter_ops.is_rdna_aiter_enabled()):
            return False
        return bool(target._ON_GFX950) and target.paged_mqa_logits_module() is not None

    def output_buffer(rows: int, max_model_len: int) -> torch.Tensor:
        (out,) = target.current_workspace_manager().get_simultaneous(
            ((rows, max_model_len), torch.float32),
        )
        return out

    def preshuffle(block_size: int) -> bool:
        # 0.34.0: ``indexer_k_cache_is_shuffled(block_size) and not _ON_RDNA``; before: ``block_size > 1``.
        shuffled = getattr(target, "indexer_k_cache_is_shuffled", None)
        if shuffled is None:
            return block_size > 1
        return bool(shuffled(block_size)) and not getattr(target, "_ON_RDNA", False)

    return StockHooks(
        stock_uses_gluon=stock_uses_gluon,
        preshuffle=preshuffle,
        output_buffer=output_buffer,
        per_sequence_lens=lambda t: target._per_sequence_context_lens(t),
        dcp_world_size=lambda: get_dcp_world_size_and_rank()[0],
    )


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


def unpatched(fn: Callable) -> Callable:
    """``fn`` itself, or the original function when ``fn`` is this package's wrapper."""
    return fn.__wrapped__ if getattr(fn, MARKER, False) else fn


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
