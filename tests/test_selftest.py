# SPDX-License-Identifier: Apache-2.0
"""The per-configuration self-test, through real vLLM 0.33.0's original and workspace (VERIFY unset).

Each planted kernel is caught on its configuration's first call: that call returns stock's answer,
the configuration stays stock, one ERROR says why, and every other configuration takes FlyDSL.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_flydsl_indexer import envs, selftest
from vllm_flydsl_indexer.agreement import compare_in_windows, read_window_ends
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.stock import vllm_stock_hooks
from vllm_flydsl_indexer.target import Call
from vllm_flydsl_indexer.tools.arms import reference_variant
from vllm_flydsl_indexer.tools.reference import GFX950, make_paged_problem

DEFINING = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"


class Kernel:
    """The gfx950 reference contract (reads exactly like the contiguous-q kernel), optionally planted."""

    def __init__(self, fault: str | None = None):
        self.fault = fault
        self.launches = 0
        self.reference = reference_variant(GFX950).fn

    def __call__(self, q_fp8, kv_cache, weights, out, lens, tables, max_model_len, **knobs):
        self.launches += 1
        if self.fault == "raises":
            raise RuntimeError("planted kernel failure")
        if self.fault == "short":
            lens = lens - 1  # one column short in every row's window
        self.reference(q_fp8, kv_cache, weights, out, lens, tables, max_model_len, **knobs)
        batch, next_n = q_fp8.shape[:2]
        if self.fault == "reverse" and next_n > 1:
            rows = out.view(batch, next_n, -1)
            rows.copy_(rows.flip(1))
        return out


@pytest.fixture
def make_router(target, workspace, plugin_log):
    original = target.rocm_fp8_paged_mqa_logits
    hooks = vllm_stock_hooks(target)

    def build(kernel: Kernel, **kw) -> FlyDSLRouter:
        variant = dataclasses.replace(reference_variant(GFX950), fn=kernel)
        return FlyDSLRouter(original, variant, hooks, logging.getLogger("vllm.plugins.flydsl_indexer"), **kw)

    return build


def problem(next_n: int, seed: int, lens=(300, 5, 0, 64), max_model_len: int | None = None):
    return make_paged_problem(
        list(lens),
        next_n=next_n,
        heads=32,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        max_model_len=max_model_len,
        generator=torch.Generator().manual_seed(seed),
    )


def run(router: FlyDSLRouter, target, p) -> torch.Tensor:
    return router.call_from(DEFINING, *p.call_args()).clone()


def stock_answer(target, p) -> torch.Tensor:
    return target.rocm_fp8_paged_mqa_logits(*p.call_args()).clone()


def agree(target, p, out) -> bool:
    rows = p.batch * p.next_n
    return compare_in_windows(
        stock_answer(target, p), out, read_window_ends(p.context_lens, rows, p.next_n)
    ).ok(0)


def errors(log) -> list[str]:
    return [r.getMessage() for r in log if r.levelno == logging.ERROR]


@pytest.mark.parametrize(
    ("fault", "bad_next_n", "said"),
    [
        ("short", 1, "NaN or unwritten"),
        ("reverse", 2, "self-test failed"),
        ("raises", 1, "RuntimeError: planted kernel failure"),
    ],
)
def test_planted_kernel_caught_on_first_use(make_router, target, plugin_log, fault, bad_next_n, said):
    planted = Kernel(fault)
    router = make_router(planted)
    good = Kernel()
    # The other configuration: the other next_n, on a correct kernel behind the same router.
    other_next_n = 2 if bad_next_n == 1 else 1
    bad = problem(bad_next_n, 1)
    out = run(router, target, bad)
    assert agree(target, bad, out), "the first call of the bad configuration must return stock's answer"
    assert router.calls_taken == 0 and router.calls_delegated == 1
    found = errors(plugin_log)
    assert len(found) == 1, found
    assert "self-test failed" in found[0] and said in found[0] and f"next_n={bad_next_n}" in found[0]
    # It stays stock, and does not run the self-test (or the kernel) again.
    launches = planted.launches
    out = run(router, target, problem(bad_next_n, 2))
    assert planted.launches == launches and router.calls_taken == 0
    assert len(errors(plugin_log)) == 1
    # Every other configuration takes FlyDSL.
    router.variant = dataclasses.replace(router.variant, fn=good)
    for seed in (3, 4):
        p = problem(other_next_n, seed)
        taken = router.calls_taken
        out = run(router, target, p)
        assert router.calls_taken == taken + 1 and agree(target, p, out)
    assert run(router, target, problem(bad_next_n, 5)) is not None and router.calls_taken == 2


def test_reverse_rows_harmless_for_next_n_1(make_router, target, plugin_log):
    """The row-order plant differs only when next_n > 1: with one row per sequence it is correct."""
    router = make_router(Kernel("reverse"))
    p = problem(1, 7)
    out = run(router, target, p)
    assert router.calls_taken == 1 and agree(target, p, out) and errors(plugin_log) == []


def test_correct_kernel_taken_from_first_call_then_one_launch_per_call(make_router, target, plugin_log):
    import aiter

    kernel = Kernel()
    router = make_router(kernel)
    aiter.CALLS.clear()
    p = problem(2, 11)
    out = run(router, target, p)
    # The first call: the self-test's stock arm and FlyDSL at SplitKV 1 and at the largest SplitKV
    # (clamped to the problem's pages), then the live launch.
    assert kernel.launches == 3 and [a for a, _ in aiter.CALLS] == ["gluon"]
    assert router.calls_taken == 1 and agree(target, p, out)
    taken = [r.getMessage() for r in plugin_log if "FlyDSL taken" in r.getMessage()]
    assert len(taken) == 1 and "self-test passed" in taken[0], taken
    assert list(router.self_tests.values()) == [None]
    # Steady state: one launch per call, no stock arm, no self-test again.
    aiter.CALLS.clear()
    for seed in (12, 13, 14):
        out = run(router, target, problem(2, seed))
    assert kernel.launches == 6 and aiter.CALLS == [] and len(router.self_tests) == 1


def test_self_test_off(make_router, target, plugin_log):
    kernel = Kernel("short")
    router = make_router(kernel, self_test=False)
    run(router, target, problem(1, 1))
    assert kernel.launches == 1 and router.calls_taken == 1 and router.self_tests == {}


def test_self_test_skipped_inside_capture_keeps_stock(make_router, target, plugin_log):
    kernel = Kernel()
    router = make_router(kernel, is_capturing=lambda: True)
    run(router, target, problem(1, 1))
    assert kernel.launches == 0 and router.calls_taken == 0 and router.self_tests == {}
    assert any("not yet compiled and self-tested" in r.getMessage() for r in plugin_log)


class Allocations(TorchDispatchMode):
    """Peak bytes of the storages ops create that are alive at once.

    Liveness is each storage's own weak reference, so a temporary freed before the next op is
    not counted twice whatever address the allocator hands out next (``bytes`` is the peak).
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.paused = False

    def excluding(self, fn):
        """``fn`` with its own allocations not counted (a kernel's workspace is the kernel's)."""

        def call(*args, **kwargs):
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False

        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        inputs = {
            a.untyped_storage()._cdata
            for a in [*args, *(kwargs or {}).values()]
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in inputs and storage._cdata not in self.live:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.bytes = max(self.bytes, sum(n for _, n in self.live.values()))
        return out


@pytest.mark.parametrize("next_n", [1, 8])
def test_memory_bound_whatever_max_model_len(make_router, target, workspace, next_n):
    """The self-test holds a few MB at most at once, at DeepSeek-V3.2's max_model_len 163840 too.

    Counted: every storage the router and the self-test create (the synthetic problem, stock's
    copied answer, FlyDSL's buffer, the comparison's temporaries); not the arms' own internals
    (here pure-torch references, on a GPU kernels).
    """
    seen = Allocations()
    router = make_router(seen.excluding(Kernel()))
    router.original = seen.excluding(router.original)
    p = problem(next_n, 1, lens=(40, 0, 3), max_model_len=163840)
    route = router._new_route(Call.of(p.call_args(), 1, DEFINING, 1))
    assert route.reason is None, route.reason
    with seen:
        assert router._self_test(route, p.call_args(), 1) is None
    assert 0 < seen.bytes <= selftest.MAX_BYTES, seen.bytes


def test_synthetic_problem_covers_the_cases():
    for block_size, next_n in ((64, 1), (64, 4), (1, 2), (16, 8)):
        args = selftest.synthetic(
            32, 128, block_size, next_n, 132, per_row_bounds=next_n > 1, device=torch.device("cpu")
        )
        q, kv, w, lens, tables, _, max_model_len = args
        seq = torch.tensor(selftest.synthetic_lengths(block_size, next_n))
        assert seq.min() == 0 and (seq % max(block_size, 16) != 0).any() and seq.max() > 2 * block_size
        if next_n > 1:
            j = torch.arange(next_n)
            assert torch.equal(lens.long(), (seq.view(-1, 1) - next_n + j + 1).clamp_min(0))
        assert max_model_len >= int(seq.max()) and tables.shape[1] * block_size >= max_model_len
        assert torch.isfinite(q.float()).all() and torch.isfinite(w).all()
        scales = kv.reshape(kv.shape[0], -1)[:, block_size * 128 : block_size * 132].contiguous()
        assert (scales.view(torch.float32) > 0).all()
        assert torch.isfinite(
            kv.reshape(kv.shape[0], -1)[:, : block_size * 128].view(torch.float8_e4m3fn).float()
        ).all()


def test_plugin_turns_it_on_by_default_and_off_with_the_variable(target, monkeypatch, fresh_register):
    import vllm_flydsl_indexer
    from vllm_flydsl_indexer import patch

    monkeypatch.setenv(envs.SWITCH, "1")
    monkeypatch.delenv(envs.SELFTEST, raising=False)
    fresh_register()
    assert patch.installed().router.self_test is True
    patch.uninstall()
    monkeypatch.setenv(envs.SELFTEST, "0")
    monkeypatch.setattr(vllm_flydsl_indexer, "_registered", False)
    fresh_register()
    assert patch.installed().router.self_test is False
