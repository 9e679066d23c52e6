# SPDX-License-Identifier: Apache-2.0
"""The router on its own (no vLLM): contract violations, hot-path audit, JIT rule."""

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
from vllm_flydsl_indexer.kernels import KernelVariant
from vllm_flydsl_indexer.router import FlyDSLRouter, call_facts
from vllm_flydsl_indexer.target import TARGET_MODULE
from vllm_flydsl_indexer.tools.reference import fp8_paged_mqa_logits_reference, make_paged_problem


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
    # And a different DCP size is a different verdict for next_n > 1.
    router.hooks = hooks(dcp=2)
    assert call(*as_args(p), compress_ratio=1) is original.marker
    assert router.calls_taken == 2 and len(original.calls) == 2


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
def test_argument_error_rejects_only_that_call_signature(error, plugin_log):
    kernel, calls = _kernel_raising(error, 3)
    original = Recorder()
    router = router_for(original, kernel)
    call = functools.partial(router.call_from, TARGET_MODULE)
    three, four = _problem(3, 11), _problem(4, 12)
    assert call(*as_args(three), compress_ratio=1) is original.marker
    assert call(*as_args(three), compress_ratio=1) is original.marker  # memoised: not launched again
    assert calls == [3]
    # The same kernel configuration at another batch is still taken.
    assert call(*as_args(four), compress_ratio=1) is not original.marker
    assert calls == [3, 4] and router.failed == {} and router.calls_taken == 1
    errors = [r.getMessage() for r in plugin_log if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "rejected a call's arguments" in errors[0] and str(error) in errors[0]


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


def test_the_device_is_part_of_what_a_flydsl_verdict_is_checked_against():
    """A FlyDSL verdict decided on one device is not launched on another (the CU count, aiter's
    per-GPU choices): the device is one of the call's facts."""
    p = base_problem()
    args = as_args(p)

    class OnDevice:
        def __init__(self, tensor, index):
            self.tensor, self.device = tensor, torch.device("cuda", index)

        def __getattr__(self, name):
            return getattr(self.tensor, name)

    facts = {call_facts((OnDevice(p.q_fp8, i), *args[1:]), 1) for i in (0, 1)}
    assert len(facts) == 2
