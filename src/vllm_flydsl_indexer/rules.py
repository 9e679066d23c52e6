# SPDX-License-Identifier: Apache-2.0
"""Why did this call stay stock? Every rule of the decode step, in the order the router applies them.

A rule takes the call and the router and returns ``None`` ("no objection")
or a short reason; the router (:mod:`vllm_flydsl_indexer.router`) applies
:data:`RULES` in order, and the first reason is what its log line says, once,
for the stock path. A call that passes every rule is launched on FlyDSL.

No rule reads a tensor value, so none issues a host sync and each decides
the same during graph capture; none reads vLLM's modules (the stock-side
questions go to hooks resolved at start-up), so every verdict is memoised
with the call's signature.

The facts each rule applies live with what they describe: stock's own
questions in :mod:`~vllm_flydsl_indexer.stock`, the kernels' contracts in
:mod:`~vllm_flydsl_indexer.kernels`, the call-site audit in
:mod:`~vllm_flydsl_indexer.callers`, the measured table in
:mod:`~vllm_flydsl_indexer.tuning`. After the rules the router adds the guards
of its own history (no first-time compile or self-test inside graph capture; a
shape whose self-test or kernel failed stays stock).
"""

from __future__ import annotations

from vllm_flydsl_indexer.callers import multi_row_objection
from vllm_flydsl_indexer.kernels import cu_count, strided_cache_reason
from vllm_flydsl_indexer.target import Call, RouterView
from vllm_flydsl_indexer.tuning import pick_for, where

__all__ = [
    "RULES",
    "contiguity_rule",
    "contract_rule",
    "dispatcher_rule",
    "gluon_rule",
    "layout_rule",
    "table_rule",
    "window_rule",
]


def gluon_rule(call: Call, router: RouterView) -> str | None:
    """Only the call stock would send to aiter's gfx950 Gluon kernel is ours to change."""
    reason = router.hooks.gluon_objection(call.compress_ratio, call.kv_cache.shape[1])
    return None if reason is None else f"stock does not use aiter's Gluon kernel here: {reason}"


def contiguity_rule(call: Call, router: RouterView) -> str | None:
    """Every FlyDSL API needs a layer-contiguous cache (its contiguity is part of the memo key)."""
    return None if call.kv_cache.is_contiguous() else strided_cache_reason(call.kv_cache)


def contract_rule(call: Call, router: RouterView) -> str | None:
    """The found API's exact contract: the common one plus its own limits."""
    return router.variant.violation(call)


def window_rule(call: Call, router: RouterView) -> str | None:
    """Written columns equal read columns: FlyDSL writes ``[0, ctx_b - next_n + i]`` of row ``(b, i)``.

    ``ctx_b`` is the last column of vLLM's bounds; the consumers read row ``r``
    over ``[0, bounds.reshape(-1)[r])``, or one entry per sequence repeated over
    its rows. They agree for ``next_n == 1`` with one bound per row (any caller,
    compression or DCP), and for ``next_n > 1`` with a ``(B, next_n)`` native
    table from an audited caller (:data:`~vllm_flydsl_indexer.callers.CALL_SITES`),
    ``compress_ratio == 1`` and DCP 1. Anything else (compressed or
    DCP-localised bounds, one bound repeated over rows) can read a column
    FlyDSL never writes, where Gluon writes ``-inf``.
    """
    next_n, context_lens = call.q_fp8.shape[1], call.context_lens
    if next_n == 1:
        if context_lens.dim() == 2 and context_lens.shape[1] != 1:
            return f"next_n=1 with {context_lens.shape[1]} bounds per sequence"
        return None
    if context_lens.dim() != 2 or context_lens.shape[1] != next_n:
        return (
            f"next_n={next_n} without a (B, next_n) bounds table: "
            "consumers read columns FlyDSL does not write"
        )
    objection = multi_row_objection(call.caller)
    if objection is not None:
        return objection
    if call.compress_ratio != 1:
        return (
            f"next_n={next_n} with compress_ratio={call.compress_ratio}: compressed bounds are not one apart"
        )
    if call.dcp_world_size != 1:
        return f"next_n={next_n} with decode context parallel size {call.dcp_world_size}: localised bounds"
    return None


def layout_rule(call: Call, router: RouterView) -> str | None:
    """FlyDSL is launched with the cache layout (``Preshuffle``) stock passes Gluon, or not at all."""
    block_size = call.kv_cache.shape[1]
    layout = router.hooks.preshuffle(block_size)
    told = router.variant.preshuffle(block_size)
    if told != layout:
        return (
            f"stock reads this KVBlockSize={block_size} cache with Preshuffle={layout}, "
            f"FlyDSL would be launched with Preshuffle={told}"
        )
    return None


def dispatcher_rule(call: Call, router: RouterView) -> str | None:
    """With aiter's dispatcher only its FlyDSL picks are taken: where its table picks Gluon, it would
    re-tune Gluon's ChunkK/WavePerEU, so vLLM's original runs instead (the switch changes only the kernel).
    Asked from shapes when the route is built, never per call."""
    objection = router.variant.dispatch_objection
    if objection is None:
        return None
    return objection(call, router.variant.preshuffle(call.kv_cache.shape[1]))


def table_rule(call: Call, router: RouterView) -> str | None:
    """A measured table keeps the call stock where it found stock (Gluon) faster, or where the
    FlyDSL launch it measured cannot be made: its rows disagree, or the found kernel cannot take
    the row's knob."""
    cus = cu_count(call.q_fp8.device)
    pick = pick_for(call, router, cus)
    if pick is None:
        return None
    _, next_n, heads, head_dim = call.q_fp8.shape
    shape = f"heads={heads} head_dim={head_dim} KVBlockSize={call.kv_cache.shape[1]} next_n={next_n}"
    if pick.backend != "flydsl":
        return f"{where(router.table, pick, cus)} measured stock (Gluon) faster for {shape}"
    if pick.conflict is not None:
        return f"{where(router.table, pick, cus)}: {pick.conflict} for {shape}"
    problem = router.variant.knob_problem(pick.wg_per_cu)
    if problem is not None:
        return f"{where(router.table, pick, cus)} measured FlyDSL with {problem}"
    return None


# In order; the first reason wins.
RULES = (
    gluon_rule,  # only the call stock sends to aiter's Gluon
    contiguity_rule,  # a layer-contiguous cache
    contract_rule,  # the found API's exact contract and limits
    window_rule,  # written columns equal read columns, per caller
    layout_rule,  # launched with stock's Preshuffle
    dispatcher_rule,  # aiter's dispatcher: only where it launches FlyDSL
    table_rule,  # a measured table's per-shape choice and its launch
)
