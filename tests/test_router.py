# SPDX-License-Identifier: Apache-2.0
"""The router on its own (no vLLM): contract violations, hot-path audit, JIT rule, each field of the memo
key and of the call facts, one log line per shape."""

from __future__ import annotations

import dataclasses
import functools
import logging

import pytest
import torch

from conftest import (
    LOGGER,
    OpAudit,
    Recorder,
    as_args,
    base_problem,
    flydsl_double,
    general_variant,
    hooks,
    router_for,
)
from vllm_flydsl_indexer import router as router_module
from vllm_flydsl_indexer.envs import STOCK_CALL_LINE
from vllm_flydsl_indexer.kernels import KernelVariant, identify_flydsl
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.target import TARGET_MODULE
from vllm_flydsl_indexer.tools.reference import fp8_paged_mqa_logits_reference, make_paged_problem
from vllm_flydsl_indexer.tuning import TunedTable


def _violations():
    p = base_problem()
    q, kv, w, ctx, bt = p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables
    p16 = base_problem(heads=32, head_dim=64, block_size=16)
    wide = torch.randint(0, 256, (kv.shape[0], 64, 1, 2 * 132), dtype=torch.uint8)
    return {
        "q bf16": as_args(p, q_fp8=q.to(torch.bfloat16)),
        "q e4m3fnuz": as_args(p, q_fp8=q.float().to(torch.float8_e4m3fnuz)),
        "q 3-D": as_args(p, q_fp8=q[:, 0]),
        "heads 16": as_args(p, q_fp8=q[:, :, :16].contiguous(), weights=w[:, :16].contiguous()),
        "heads 48": as_args(p, q_fp8=q[:, :, :48].contiguous(), weights=w[:, :48].contiguous()),
        "head_dim 32": as_args(p16, q_fp8=p16.q_fp8[..., :32].contiguous()),
        "head_dim 96": as_args(p, q_fp8=q[..., :96].contiguous()),
        "kv fp8 view": as_args(p, kv_cache_fp8=kv.view(torch.float8_e4m3fn)),
        "kv not contiguous": as_args(p, kv_cache_fp8=wide[..., :132]),
        "kv shape[2] != 1": as_args(p, kv_cache_fp8=kv.view(kv.shape[0], 32, 2, 132)),
        "index_dim short": as_args(p, kv_cache_fp8=kv[..., :131].contiguous()),
        "KVB 8": as_args(p, kv_cache_fp8=kv.view(kv.shape[0] * 8, 8, 1, 132)),
        "pool >= 2**31": as_args(
            p,
            kv_cache_fp8=torch.empty((2**31 // (64 * 132) + 1, 64, 1, 132), dtype=torch.uint8, device="meta"),
        ),
        "weights bf16": as_args(p, weights=w.to(torch.bfloat16)),
        "weights rows": as_args(p, weights=w[:-1]),
        "weights transposed": as_args(p, weights=w.t().contiguous().t()),
        "ctx int64": as_args(p, context_lens=ctx.long()),
        "ctx rows": as_args(p, context_lens=ctx[:-1]),
        "ctx 3-D": as_args(p, context_lens=ctx.unsqueeze(-1)),
        "block table int64": as_args(p, block_tables=bt.long()),
        "block table rows": as_args(p, block_tables=bt[:-1]),
        "next_n 2 with (B, 1) bounds": as_args(p, context_lens=ctx[:, -1:].contiguous()),
        "next_n 1 with (B, 2) bounds": as_args(
            p, q_fp8=q[:, :1].contiguous(), weights=w.view(3, 2, 64)[:, 0].contiguous()
        ),
    }


VIOLATIONS = _violations()


@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_contract_violations_go_to_stock_unchanged(name):
    args = VIOLATIONS[name]
    original = Recorder()
    kernel_calls = []

    def kernel(*a, **k):
        kernel_calls.append(1)
        return flydsl_double()(*a, **k)

    router = router_for(original, kernel)
    out = router.call_from(TARGET_MODULE, *args, compress_ratio=1)
    assert out is original.marker
    assert kernel_calls == []
    ((called_args, called_kwargs),) = original.calls
    assert all(a is b for a, b in zip(called_args, args, strict=True))
    assert called_kwargs == {"compress_ratio": 1}
    assert router.calls_delegated == 1 and router.calls_taken == 0


def test_valid_call_is_taken_and_matches_the_flydsl_contract():
    p = base_problem()
    original = Recorder()
    router = router_for(original)
    out = router.call_from(TARGET_MODULE, *as_args(p), compress_ratio=1)
    assert original.calls == [] and router.calls_taken == 1
    expected = torch.full_like(out, float("nan"))
    fp8_paged_mqa_logits_reference(
        p.q_fp8,
        p.kv_cache,
        p.weights,
        expected,
        p.context_lens,
        p.block_tables,
        p.max_model_len,
        preshuffle=True,
        contract="flydsl",
    )
    assert torch.equal(out.nan_to_num(5.0), expected.nan_to_num(5.0))


@pytest.mark.parametrize("dcp,ratio,gluon", [(2, 1, True), (1, 2, True), (1, 1, False)])
def test_window_and_route_rules(dcp, ratio, gluon):
    p = base_problem()
    original = Recorder()
    router = router_for(original, hooks_=hooks(dcp=dcp, gluon=gluon))
    assert router.call_from(TARGET_MODULE, *as_args(p), compress_ratio=ratio) is original.marker


@pytest.mark.parametrize("block_size,preshuffle", [(64, True), (1, False)])
def test_flydsl_is_launched_with_stocks_preshuffle_or_not_at_all(block_size, preshuffle):
    """Stock's cache layout decides: a vLLM whose layout rule differs keeps the call stock."""
    p = base_problem(block_size=block_size, preshuffle=preshuffle)
    launched = []

    def kernel(*a, **k):
        launched.append(k["Preshuffle"])
        return flydsl_double()(*a, **k)

    original = Recorder()
    router = router_for(original, kernel, hooks_=hooks(preshuffle=lambda bs: bs > 1))
    router.call_from(TARGET_MODULE, *as_args(p), compress_ratio=1)
    assert launched == [preshuffle] and original.calls == []
    flipped = Recorder()
    router = router_for(flipped, kernel, hooks_=hooks(preshuffle=lambda bs: not bs > 1))
    assert router.call_from(TARGET_MODULE, *as_args(p), compress_ratio=1) is flipped.marker
    assert launched == [preshuffle] and router.calls_taken == 0


def test_next_n_1_is_taken_under_dcp_and_compression():
    p = make_paged_problem(
        [300, 0, 17],
        next_n=1,
        heads=32,
        head_dim=128,
        block_size=16,
        preshuffle=True,
        per_row_bounds=False,
        compress_ratio=2,
        generator=torch.Generator().manual_seed(9),
    )
    original = Recorder()
    router = router_for(original, hooks_=hooks(dcp=4))
    router(*as_args(p), compress_ratio=2)  # an unknown caller: next_n == 1 is always safe
    assert original.calls == [] and router.calls_taken == 1


SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::equal", "aten::is_nonzero"}


@pytest.mark.parametrize("next_n,per_row", [(1, False), (2, True)])
def test_hot_path_audit_no_sync_no_logits_pass_no_allocation(next_n, per_row):
    p = make_paged_problem(
        [200, 3, 64, 0],
        next_n=next_n,
        heads=64,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        per_row_bounds=per_row,
        generator=torch.Generator().manual_seed(4),
    )
    workspace = torch.full((p.batch * next_n, p.max_model_len), float("nan"))
    audit = OpAudit()
    seen_by_kernel = {}

    def kernel(q, kv, w, out, lens, bt, mml, **kw):
        seen_by_kernel.update(out=out, lens=lens, kw=kw)
        audit.paused = True
        try:
            return flydsl_double()(q, kv, w, out, lens, bt, mml, **kw)
        finally:
            audit.paused = False

    router = router_for(Recorder(), kernel, hooks(buffer=workspace))
    with audit:
        out = router.call_from(TARGET_MODULE, *as_args(p), compress_ratio=1)
    assert out is workspace and seen_by_kernel["out"] is workspace
    assert seen_by_kernel["kw"] == {"Preshuffle": True, "KVBlockSize": 64}
    names = [name for name, _ in audit.ops]
    assert not SYNC_OPS & set(names), names
    # Nothing the adapter runs touches the logits buffer: no prefill, no sanitize.
    assert not any(
        t.untyped_storage().data_ptr() == workspace.untyped_storage().data_ptr()
        for _, ts in audit.ops
        for t in ts
    ), names
    # The only ops are vLLM's own per-sequence reduction (the stock path does the same).
    if next_n == 1:
        assert names == [], names
        assert seen_by_kernel["lens"] is p.context_lens
    else:
        assert names == ["aten::select", "aten::clone"], names
        assert torch.equal(seen_by_kernel["lens"], p.context_lens[:, -1])


class _CapturingFlag:
    def __init__(self):
        self.value = False

    def __call__(self):
        return self.value


def test_no_first_time_compile_inside_capture(plugin_log):
    p = base_problem()
    original = Recorder()
    capturing = _CapturingFlag()
    compiled_during_capture = []

    def kernel(*a, **k):
        if capturing.value:
            compiled_during_capture.append(k)
        return flydsl_double()(*a, **k)

    router = router_for(original, kernel, is_capturing=capturing)
    call = functools.partial(router.call_from, TARGET_MODULE)
    capturing.value = True
    assert call(*as_args(p), compress_ratio=1) is original.marker  # not compiled yet: stock
    assert compiled_during_capture == []
    capturing.value = False
    call(*as_args(p), compress_ratio=1)  # eager call compiles
    capturing.value = True
    call(*as_args(p), compress_ratio=1)  # now captured with FlyDSL
    assert len(compiled_during_capture) == 1 and len(original.calls) == 1
    warnings = [r.getMessage() for r in plugin_log if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1
        and "FlyDSL not yet compiled for heads=64 head_dim=128 KVBlockSize=64 next_n=2" in warnings[0]
    )
    # It says what happened and that it is unexpected; it recommends no option that changes nothing.
    assert "this graph keeps the stock path" in warnings[0] and "unexpected" in warnings[0]
    assert "cudagraph_num_of_warmups" not in warnings[0]


def test_memoised_verdict_still_checks_contiguity_live():
    p = base_problem()
    original = Recorder()
    launches = []
    router = router_for(original, fn=lambda *a, **k: launches.append(a[1].is_contiguous()))
    call = functools.partial(router.call_from, TARGET_MODULE)
    call(*as_args(p), compress_ratio=1)
    assert router.calls_taken == 1
    # Same shape and dtype, but a strided view: must not reuse the earlier verdict (nor reach the
    # kernel, whose own argument check would otherwise be the only guard).
    wide = torch.randint(0, 256, (p.kv_cache.shape[0], 64, 1, 2 * 132), dtype=torch.uint8)
    strided = wide[..., :132]
    assert strided.shape == p.kv_cache.shape and not strided.is_contiguous()
    assert call(*as_args(p, kv_cache_fp8=strided), compress_ratio=1) is original.marker
    assert launches == [True]
    # The contiguous call keeps its verdict.
    call(*as_args(p), compress_ratio=1)
    assert router.calls_taken == 2 and launches == [True, True]
    assert len(original.calls) == 1


def test_dcp_is_read_when_a_signature_is_decided_never_on_a_warm_call():
    """The DCP size is start-up state (vLLM sets up its parallel groups before it loads the model): read
    once per new call signature, where it decides next_n > 1, and never again on a warm call."""
    p = base_problem()  # next_n 2
    for dcp, taken in ((1, True), (2, False)):
        reads = []
        original = Recorder()
        router = router_for(
            original,
            hooks_=dataclasses.replace(hooks(), dcp_world_size=lambda r=reads, d=dcp: r.append(1) or d),
        )
        for _ in range(5):
            out = router.call_from(TARGET_MODULE, *as_args(p), compress_ratio=1)
            assert (out is not original.marker) == taken, dcp
        assert len(reads) == 1, (dcp, reads)
        assert router.calls_taken == 5 * taken and len(original.calls) == 5 * (not taken)


def test_the_caller_is_part_of_the_memoised_verdict():
    """One router, identical tensors, next_n 2, ratio 1: the audited caller is taken, the others are not.

    A verdict memoised without the caller would hand the defining module's
    "taken" to GLM-5-next's kpool call (pool-granular bounds) and to an unknown
    caller on every later call with the same shapes.
    """
    from vllm_flydsl_indexer.tools.audit import CALL_SITES

    kpool = next(m for m, site in CALL_SITES.items() if not site.multi_row)
    p = base_problem()
    original = Recorder()
    router = router_for(original)
    assert router.call_from(TARGET_MODULE, *as_args(p), compress_ratio=1) is not original.marker
    assert router.calls_taken == 1 and original.calls == []
    for caller in (kpool, "vllm.model_executor.layers.some_future_indexer", None):
        assert router.call_from(caller, *as_args(p), compress_ratio=1) is original.marker, caller
    assert router.calls_taken == 1 and len(original.calls) == 3
    assert router.call_from(TARGET_MODULE, *as_args(p), compress_ratio=1) is not original.marker
    assert router.calls_taken == 2


def _transposed(weights: torch.Tensor) -> torch.Tensor:
    out = weights.t().contiguous().t()
    assert out.shape == weights.shape and not out.is_contiguous()
    return out


def test_transposed_weights_cost_only_that_call(plugin_log):
    """aiter's wrappers need contiguous weights: the contract refuses them, and the memo key holds
    their contiguity, so one such call neither reaches the kernel nor reuses a taken verdict."""
    p = base_problem()
    original = Recorder()
    kernel_calls = []

    def kernel(*a, **k):
        kernel_calls.append(a[2].is_contiguous())
        return flydsl_double()(*a, **k)

    router = router_for(original, kernel)
    call = functools.partial(router.call_from, TARGET_MODULE)
    assert call(*as_args(p), compress_ratio=1) is not original.marker
    assert call(*as_args(p, weights=_transposed(p.weights)), compress_ratio=1) is original.marker
    assert kernel_calls == [True]
    assert call(*as_args(p), compress_ratio=1) is not original.marker
    assert kernel_calls == [True, True] and router.failed == {}
    assert not [r for r in plugin_log if r.levelno >= logging.ERROR]


def _kernel_raising(error: Exception, batch: int):
    """The FlyDSL double, raising ``error`` for calls of ``batch`` sequences."""
    calls = []

    def kernel(*a, **k):
        calls.append(a[0].shape[0])
        if a[0].shape[0] == batch:
            raise error
        return flydsl_double()(*a, **k)

    return kernel, calls


def _problem(batch: int, seed: int):
    lens = torch.randint(2, 200, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    return make_paged_problem(
        lens,
        next_n=2,
        heads=64,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        generator=torch.Generator().manual_seed(seed + 1),
    )


@pytest.mark.parametrize("error", [ValueError("bad SplitKV"), TypeError("bad dtype"), AssertionError("bad")])
def test_an_argument_error_fails_the_whole_configuration(error, plugin_log):
    """A wrapper that rejects a call its identified contract admits has a contract this package does not
    know: no batch of that configuration is trusted, as with any other exception."""
    kernel, calls = _kernel_raising(error, 3)
    original = Recorder()
    router = router_for(original, kernel)
    call = functools.partial(router.call_from, TARGET_MODULE)
    three, four = _problem(3, 11), _problem(4, 12)
    assert call(*as_args(three), compress_ratio=1) is original.marker
    assert call(*as_args(three), compress_ratio=1) is original.marker  # memoised: not launched again
    assert call(*as_args(four), compress_ratio=1) is original.marker  # another batch: stock too
    assert calls == [3] and len(router.failed) == 1 and router.calls_taken == 0
    errors = [r.getMessage() for r in plugin_log if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and f"raised {type(error).__name__}: {error}" in errors[0]


def test_kernel_fault_disables_the_configuration(plugin_log):
    kernel, calls = _kernel_raising(RuntimeError("HIP launch failure"), 3)
    original = Recorder()
    router = router_for(original, kernel)
    call = functools.partial(router.call_from, TARGET_MODULE)
    assert call(*as_args(_problem(3, 21)), compress_ratio=1) is original.marker
    assert call(*as_args(_problem(4, 22)), compress_ratio=1) is original.marker
    assert calls == [3] and len(router.failed) == 1 and router.calls_taken == 0


class _LaunchKwargsRaise(KernelVariant):
    def launch_kwargs(self, *args, **kwargs):
        raise ZeroDivisionError("planted")


def test_an_exception_in_the_routers_own_work_returns_stock(plugin_log):
    """Building a route (rules, the launch's keyword arguments) never lets an exception reach vLLM."""
    variant = general_variant()
    broken = _LaunchKwargsRaise(**{f.name: getattr(variant, f.name) for f in dataclasses.fields(variant)})
    original = Recorder()
    router = FlyDSLRouter(original, broken, hooks(), LOGGER)
    call = functools.partial(router.call_from, TARGET_MODULE)
    three = _problem(3, 31)
    assert call(*as_args(three), compress_ratio=1) is original.marker
    ((args, kwargs),) = original.calls
    assert all(a is b for a, b in zip(args, as_args(three), strict=True)) and kwargs == {"compress_ratio": 1}
    # The configuration stays stock: another batch does not build a route again.
    assert call(*as_args(_problem(4, 32)), compress_ratio=1) is original.marker
    assert router.calls_taken == 0 and router.calls_delegated == 2 and len(router.failed) == 1
    errors = [r.getMessage() for r in plugin_log if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "ZeroDivisionError" in errors[0] and "planted" in errors[0]


# ---------------------------------------------------------------- issue 43: each field of the key and facts
#
# The verdict is memoised on memo_key (q's, the cache's and the bounds' shapes, the cache's contiguity,
# max_model_len, compress_ratio, the caller) and a FlyDSL verdict is launched only while call_facts (DCP,
# the dtypes, the weights' and block tables' shapes, q's and the weights' contiguity, the device) are the
# ones it was decided on. Each test below calls ONE router twice with only one field changed, and the two
# calls must get different verdicts: a key or facts without that field hands the second call the first
# call's verdict, and the test fails. The kernel is a recorder that checks nothing, so no argument check of
# a double hides a launch the router should not have made.


def _recording_router(variant=None, **kw):
    """A router over ``variant`` (the general double's by default) whose kernel only records its knobs."""
    launches: list[dict] = []

    def kernel(q, kv, w, out, lens, bt, max_model_len, **knobs):
        launches.append(knobs)
        return out

    variant = dataclasses.replace(variant or general_variant(), fn=kernel)
    kw.setdefault("self_test", False)
    hooks_ = kw.pop("hooks_", None) or hooks()
    return FlyDSLRouter(Recorder(), variant, hooks_, LOGGER, **kw), launches


def _kpool_caller() -> str:
    from vllm_flydsl_indexer.tools.audit import CALL_SITES

    return next(m for m, site in CALL_SITES.items() if not site.multi_row)


def _key_cases():
    """Per memo-key field: (the base call with only that field changed, compress_ratio, caller). The base
    call (base_problem: next_n 2, 64 heads, KVB 64, per-row bounds, ratio 1, the defining module) is
    taken; each changed call is stock."""
    p = base_problem()
    kv = p.kv_cache
    wide = torch.randint(0, 256, (kv.shape[0], 64, 1, 2 * 132), dtype=torch.uint8)
    return {
        "q shape": (as_args(p, q_fp8=p.q_fp8[..., :96].contiguous()), 1, TARGET_MODULE),
        "kv shape": (as_args(p, kv_cache_fp8=kv.view(kv.shape[0] * 8, 8, 1, 132)), 1, TARGET_MODULE),
        "kv contiguity": (as_args(p, kv_cache_fp8=wide[..., :132]), 1, TARGET_MODULE),
        "bounds shape": (as_args(p, context_lens=p.context_lens[:, -1:].contiguous()), 1, TARGET_MODULE),
        "compress_ratio": (as_args(p), 2, TARGET_MODULE),
        "caller": (as_args(p), 1, "kpool"),
    }, as_args(p)


KEY_CASES, KEY_BASE = _key_cases()


@pytest.mark.parametrize("order", ["stock first", "taken first"])
@pytest.mark.parametrize("field", list(KEY_CASES))
def test_each_memo_key_field_alone_changes_the_verdict(field, order):
    changed, ratio, caller = KEY_CASES[field]
    caller = _kpool_caller() if caller == "kpool" else caller
    router, launches = _recording_router()
    original = router.original
    base = (TARGET_MODULE, *KEY_BASE)
    other = (caller, *changed)
    if field == "kv contiguity":
        assert changed[1].shape == KEY_BASE[1].shape and not changed[1].is_contiguous()
    calls = [(base, 1, True), (other, ratio, False)]
    for args, compress_ratio, taken in calls if order == "taken first" else calls[::-1]:
        launched = len(launches)
        out = router.call_from(*args, compress_ratio=compress_ratio)
        assert (out is not original.marker) == taken, (field, order, router.routes)
        assert len(launches) == launched + taken, (field, order)
    assert router.calls_taken == 1 and router.calls_delegated == 1 and len(router.routes) == 2


def test_max_model_len_alone_changes_the_launch():
    """max_model_len decides no rule, but it decides the gfx950 launch's SplitKV (pages of the longest
    sequence): a route memoised without it would launch the other call's SplitKV."""
    router, launches = _recording_router(gfx950_variant())
    p = make_paged_problem(
        [40], next_n=1, heads=32, head_dim=128, block_size=64, preshuffle=True, per_row_bounds=False,
        max_model_len=64, generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    # One CU (the CPU): SplitKV = max(1, min(pages, ceil(1 * 3 / batch 1))): 1 page at 64, 3 at 256.
    for max_model_len, split in ((64, 1), (256, 3), (64, 1)):
        router.call_from(TARGET_MODULE, *as_args(p, max_model_len=max_model_len))
        assert launches[-1]["SplitKV"] == split, (max_model_len, launches)
    assert router.calls_taken == 3 and len(router.routes) == 2


def _fact_cases():
    """Per call fact: the base call with only that fact changed, which must stay stock after the base call
    was taken at the same memo key."""
    p = base_problem()
    q, kv, w, lens, bt = p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables
    return {
        "q dtype": as_args(p, q_fp8=q.float().to(torch.float8_e4m3fnuz)),
        "kv dtype": as_args(p, kv_cache_fp8=kv.view(torch.int8)),
        "weights dtype": as_args(p, weights=w.to(torch.bfloat16)),
        "lens dtype": as_args(p, context_lens=lens.long()),
        "block_tables dtype": as_args(p, block_tables=bt.long()),
        "weights shape": as_args(p, weights=w[:-1]),
        "block_tables shape": as_args(p, block_tables=bt[:-1]),
        "weights contiguity": as_args(p, weights=_transposed(w)),
    }, as_args(p)


FACT_CASES, FACT_BASE = _fact_cases()


def _key_fields(args: tuple) -> tuple:
    """What the memo key holds of the tensors: q's, the cache's and the bounds' shapes, the cache's
    contiguity, max_model_len."""
    q, kv, _, lens, _, _, max_model_len = args
    return q.shape, kv.shape, kv.is_contiguous(), lens.shape, max_model_len


@pytest.mark.parametrize("field", list(FACT_CASES))
def test_each_call_fact_alone_sends_a_memoised_flydsl_key_to_stock(field):
    router, launches = _recording_router()
    original = router.original
    assert router.call_from(TARGET_MODULE, *FACT_BASE) is not original.marker and len(launches) == 1
    changed = FACT_CASES[field]
    # Only the facts differ: the memo key's fields are the base call's.
    assert _key_fields(changed) == _key_fields(FACT_BASE)
    assert router.call_from(TARGET_MODULE, *changed) is original.marker, field
    assert len(launches) == 1 and router.calls_taken == 1 and router.calls_delegated == 1


def gfx950_variant() -> KernelVariant:
    import importlib

    module = importlib.import_module("aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950")
    variant = identify_flydsl(module.flydsl_fp8_paged_mqa_logits, module, "gfx950 double")
    assert isinstance(variant, KernelVariant) and variant.name == "gfx950", variant
    return variant


def test_a_strided_q_after_a_contiguous_one_at_the_same_key_stays_stock_on_gfx950():
    """aiter's gfx950 wrapper needs a contiguous q (q's contiguity is a call fact, not in the memo key):
    a strided q of the same shape after a taken contiguous one must not reuse the FlyDSL verdict."""
    router, launches = _recording_router(gfx950_variant())
    p = make_paged_problem(
        [130, 5, 64], next_n=2, heads=32, head_dim=128, block_size=64, preshuffle=True,
        generator=torch.Generator().manual_seed(6),
    )  # fmt: skip
    wide = torch.zeros((*p.q_fp8.shape[:3], 256), dtype=torch.float8_e4m3fn)
    wide[..., :128] = p.q_fp8
    strided = wide[..., :128]
    assert strided.shape == p.q_fp8.shape and not strided.is_contiguous()
    assert router.call_from(TARGET_MODULE, *as_args(p)) is not router.original.marker
    assert router.call_from(TARGET_MODULE, *as_args(p, q_fp8=strided)) is router.original.marker
    assert len(launches) == 1 and router.calls_taken == 1
    # The general kernel reads q at its strides: the same strided q is taken there.
    general, general_launches = _recording_router()
    g = base_problem()
    wide = torch.zeros((*g.q_fp8.shape[:3], 256), dtype=torch.float8_e4m3fn)
    wide[..., :128] = g.q_fp8
    general.call_from(TARGET_MODULE, *as_args(g))
    assert general.call_from(TARGET_MODULE, *as_args(g, q_fp8=wide[..., :128])) is not general.original.marker
    assert len(general_launches) == 2


class _OnDevice:
    """q as if on GPU ``index`` (the router reads its device, never its data here)."""

    def __init__(self, tensor, index):
        self.tensor, self.device = tensor, torch.device("cuda", index)

    def __getattr__(self, name):
        return getattr(self.tensor, name)


def test_the_device_alone_sends_a_memoised_flydsl_key_to_stock(monkeypatch):
    """A verdict decided on one GPU is not launched on another: its CU count picks the table's row.
    Here GPU 0 (256 CUs) measured FlyDSL faster for the shape and GPU 1 (80 CUs) stock."""
    monkeypatch.setattr(router_module, "cu_count", lambda device: {0: 256, 1: 80}[device.index])
    p = base_problem()  # batch 3, next_n 2, 64 heads, head_dim 128, KVB 64
    shape = (2, 64, 128, 64)
    table = TunedTable(
        "t.csv", "gfx950", shapes={(256, *shape): {1: [("flydsl", 0)]}, (80, *shape): {1: [("gluon", 0)]}}
    )
    router, launches = _recording_router(table=table)
    first = as_args(p, q_fp8=_OnDevice(p.q_fp8, 0))
    assert router.call_from(TARGET_MODULE, *first) is not router.original.marker
    assert router.call_from(TARGET_MODULE, *as_args(p, q_fp8=_OnDevice(p.q_fp8, 1))) is router.original.marker
    assert len(launches) == 1 and router.calls_taken == 1
    assert router.call_from(TARGET_MODULE, *first) is not router.original.marker and len(launches) == 2


# ---------------------------------------------------------------- issue 43: one INFO line per shape


def _batches(n: int, **kw):
    """The first 1..n sequences of one problem: the calls of one shape at every batch size."""
    p = make_paged_problem(
        torch.randint(2, 200, (n,), generator=torch.Generator().manual_seed(8)).tolist(), next_n=2,
        heads=64, head_dim=128, block_size=64, preshuffle=True, generator=torch.Generator().manual_seed(9),
    )  # fmt: skip
    for batch in range(1, n + 1):
        yield as_args(
            p, q_fp8=p.q_fp8[:batch], weights=p.weights[: 2 * batch], context_lens=p.context_lens[:batch],
            block_tables=p.block_tables[:batch], **kw,
        )  # fmt: skip


def test_the_stock_line_is_logged_at_info_once_per_shape_not_per_batch(plugin_log):
    """Batches 1..64 of one stock shape (a strided, block-outer cache; then compress_ratio 2 at next_n 2)
    give one INFO line each, not 64."""
    router, launches = _recording_router()
    stock = router.original.marker
    for q, kv, *rest in _batches(64):
        wide = torch.zeros((*kv.shape[:3], 2 * 132), dtype=torch.uint8)
        wide[..., :132] = kv
        assert router.call_from(TARGET_MODULE, q, wide[..., :132], *rest) is stock
        assert router.call_from(TARGET_MODULE, q, kv, *rest, compress_ratio=2) is stock
    assert launches == [] and router.calls_delegated == 128 and len(router.routes) == 128
    lines = [r for r in plugin_log if STOCK_CALL_LINE in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO] * 2, [r.getMessage() for r in lines]
    assert "kv_cache is strided" in lines[0].getMessage()
    assert "next_n=2 with compress_ratio=2" in lines[1].getMessage()


class Spy:
    """A tensor that records which of its attributes the router reads."""

    def __init__(self, tensor, reads: list):
        self.tensor, self.reads = tensor, reads

    def __getattr__(self, name):
        self.reads.append(name)
        return getattr(self.tensor, name)

    def __len__(self):
        self.reads.append("len")
        return len(self.tensor)

    def __getitem__(self, index):
        self.reads.append("getitem")
        return self.tensor[index]


def test_a_warm_call_reads_the_key_and_for_a_flydsl_verdict_its_facts_nothing_more():
    """Issue 51: a warm stock-bound call (here a block-outer cache) reads q's and the bounds' shapes (the memo
    key, with the cache's) and nothing else of q, the weights, the bounds or the block tables; a warm taken
    call reads the key, then the facts, then what the launch passes on."""
    router, launches = _recording_router()
    p = base_problem()
    wide = torch.randint(0, 256, (p.kv_cache.shape[0], 64, 1, 2 * 132), dtype=torch.uint8)
    for kv in (wide[..., :132], p.kv_cache):
        reads: list[str] = []
        spied = [Spy(t, reads) for t in (p.q_fp8, p.weights, p.context_lens, p.block_tables)]
        args = as_args(p, q_fp8=spied[0], kv_cache_fp8=kv, weights=spied[1], context_lens=spied[2],
                       block_tables=spied[3])  # fmt: skip
        router.call_from(TARGET_MODULE, *args)  # decides
        reads.clear()
        for _ in range(3):
            router.call_from(TARGET_MODULE, *args)
        if not kv.is_contiguous():
            assert reads == ["shape", "shape"] * 3 and launches == [], reads
        else:  # a taken call reads q's and the bounds' shapes (the key), then the facts, then launches
            key_and_facts = ["shape", "shape", "dtype", "dtype", "shape", "dtype", "dtype", "shape"]
            key_and_facts += ["is_contiguous", "is_contiguous", "device"]
            per_call = len(reads) // 3
            assert len(launches) == 4 and reads[:per_call] * 3 == reads, reads
            assert reads[: len(key_and_facts)] == key_and_facts, reads
    assert router.calls_delegated == 4


def test_the_taken_line_is_logged_at_info_once_per_shape_not_per_batch(plugin_log):
    router, launches = _recording_router()
    for args in _batches(64):
        assert router.call_from(TARGET_MODULE, *args) is not router.original.marker
    assert len(launches) == 64 and len(router.routes) == 64
    lines = [r for r in plugin_log if "FlyDSL taken for" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO], [r.getMessage() for r in lines]
    assert "heads=64 head_dim=128 KVBlockSize=64 next_n=2" in lines[0].getMessage()
    assert not [r for r in plugin_log if r.levelno >= logging.WARNING]
