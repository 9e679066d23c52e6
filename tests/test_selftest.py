# SPDX-License-Identifier: Apache-2.0
"""The per-shape self-test, through real vLLM 0.33.0's original and workspace.

Each planted kernel is caught on its shape's first call: that call returns stock's answer, the shape
stays stock until vLLM restarts, one ERROR says why and says so, and every other shape takes FlyDSL.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_flydsl_indexer import envs, selftest
from vllm_flydsl_indexer import router as router_module
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.selftest import read_window_ends
from vllm_flydsl_indexer.target import AUDITED, fingerprint_of, vllm_stock_hooks
from vllm_flydsl_indexer.tools.arms import reference_variant
from vllm_flydsl_indexer.tools.harness import compare_in_windows
from vllm_flydsl_indexer.tools.reference import GFX950, make_paged_problem

LOGGER = logging.getLogger("vllm.plugins.flydsl_indexer")

DEFINING = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"


# Noise of this fraction of each row's RMS on every finite entry: the agreement metric
# 1 - 2*sum(xy)/sum(x^2 + y^2) is then about NOISE**2 / 2 per row, its largest row 5.2e-3 on the self-test's
# problem (the test measures it): five times the rule's 1e-3 and half of a rule loosened to 1e-2.
NOISE = 0.08
# A bound past every sequence of the self-test's small problem (its longest is 3.5 blocks at KVBlockSize 64):
# the "long" plant is wrong only beyond it, so only the timing contexts can catch it.
LONG = 4 * 64


def add_noise(out: torch.Tensor, fraction: float, seed: int = 7) -> None:
    """Deterministic noise of ``fraction`` of each row's RMS on the finite entries of ``out``."""
    finite = torch.isfinite(out)
    values = torch.where(finite, out, 0.0)
    rms = (values.square().sum(1, keepdim=True) / finite.sum(1, keepdim=True).clamp_min(1)).sqrt()
    noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)) * rms * fraction
    out.copy_(torch.where(finite, out + noise, out))


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
        if self.fault == "noisy" or (self.fault == "long" and int(lens.max()) > LONG):
            add_noise(out, NOISE)
        batch, next_n = q_fp8.shape[:2]
        if self.fault == "reverse" and next_n > 1:
            rows = out.view(batch, next_n, -1)
            rows.copy_(rows.flip(1))
        return out


def stock_hooks(target):
    """The hooks register() resolves for this vLLM's audited target."""
    return vllm_stock_hooks(target, AUDITED[fingerprint_of(target.rocm_fp8_paged_mqa_logits)][1])


def new_route(router: FlyDSLRouter, args: tuple, compress_ratio: int = 1, caller: str = DEFINING):
    """The verdict the router memoises for a new call signature (the key is the test's own)."""
    return router._memoise(("test", len(router.routes)), args, compress_ratio, caller)


@pytest.fixture
def make_router(target, workspace, plugin_log):
    original = target.rocm_fp8_paged_mqa_logits
    hooks = stock_hooks(target)

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
    assert "This call and every later call of this shape use the stock path until vLLM restarts" in found[0]
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
    route = new_route(router, p.call_args())
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


# ---------------------------------------------------------------- issue 37: one net, once per shape


class Faulty(Kernel):
    """The gfx950 reference contract with a fault at some launches only (``when(knobs)``)."""

    def __init__(self, fault: str, when=lambda knobs: True):
        super().__init__()
        self.planted, self.when = fault, when
        self.split_kvs: list[int] = []

    def __call__(self, q_fp8, kv_cache, weights, out, lens, tables, max_model_len, **knobs):
        self.split_kvs.append(knobs.get("SplitKV"))
        if not self.when(knobs):
            return super().__call__(q_fp8, kv_cache, weights, out, lens, tables, max_model_len, **knobs)
        if self.planted == "ignores the block table":
            tables = torch.arange(tables.numel(), dtype=tables.dtype).view_as(tables) % kv_cache.shape[0]
        super().__call__(q_fp8, kv_cache, weights, out, lens, tables, max_model_len, **knobs)
        if self.planted == "writes past a window":
            batch, next_n = q_fp8.shape[:2]
            ends = read_window_ends(lens, batch, 1).repeat_interleave(next_n)
            rows = torch.arange(batch * next_n)
            inside = ends < max_model_len
            out[rows[inside], ends[inside]] = 1.0
        elif self.planted == "reverses rows" and q_fp8.shape[1] > 1:
            rows = out.view(q_fp8.shape[0], q_fp8.shape[1], -1)
            rows.copy_(rows.flip(1))
        return out


@pytest.mark.parametrize(
    ("fault", "next_n", "when"),
    [
        ("writes past a window", 1, "always"),
        ("ignores the block table", 1, "always"),
        ("reverses rows", 2, "SplitKV 1 only"),
        ("reverses rows", 2, "the largest SplitKV only"),
    ],
)
def test_self_test_catches_faults_at_either_end_of_the_split_kv_range(
    make_router, target, plugin_log, fault, next_n, when
):
    """The self-test launches FlyDSL at SplitKV 1 and at the largest reachable: a fault at one end
    only (a shape whose other setting would pass) is caught on the shape's first call."""
    only = {"always": lambda k: True, "SplitKV 1 only": lambda k: k["SplitKV"] == 1}
    kernel = Faulty(fault, only.get(when, lambda k: k["SplitKV"] > 1))
    router = make_router(kernel)
    p = problem(next_n, 21)
    out = run(router, target, p)
    assert agree(target, p, out) and router.calls_taken == 0
    assert sorted(set(kernel.split_kvs)) == [1, 4] or kernel.split_kvs == [1], kernel.split_kvs
    found = errors(plugin_log)
    assert len(found) == 1 and "self-test failed" in found[0], found
    assert router.self_tests and list(router.self_tests.values())[0] is not None


def test_self_test_runs_once_per_shape_over_every_decode_batch(make_router, target, monkeypatch):
    """GLM-5.x (32 heads, the gfx950 kernel, 256 CUs) at next_n 1 and 2 over decode batches 1-256: one
    self-test per shape and kind of bounds, not per batch or SplitKV."""
    monkeypatch.setattr(router_module, "cu_count", lambda device: 256)
    runs = []
    real_run = selftest.run
    monkeypatch.setattr(selftest, "run", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    launches = []
    reference = reference_variant(GFX950).fn

    def gfx950(q_fp8, kv_cache, weights, out, lens, tables, max_model_len, **knobs):
        """The contract's answer while the shape's self-test runs; after it, live calls are counted, not
        computed (nothing compares them here, and 512 reference launches would take minutes)."""
        launches.append(knobs["SplitKV"])
        if len(router.self_tests) < q_fp8.shape[1]:
            reference(q_fp8, kv_cache, weights, out, lens, tables, max_model_len, **knobs)
        return out

    router = make_router(gfx950)
    gen = torch.Generator().manual_seed(37)
    calls = 0
    for next_n in (1, 2):
        p = make_paged_problem(
            torch.randint(next_n, 129, (256,), generator=gen).tolist(),
            next_n=next_n,
            heads=32,
            head_dim=128,
            block_size=64,
            preshuffle=True,
            max_model_len=1024,  # 16 pages: SplitKV ceil(256 * 3 / batch) varies from 3 to 16
            spare_blocks=0,
            generator=gen,
        )
        q, kv, weights, lens, tables, meta, max_model_len = p.call_args()
        for batch in range(1, 257):  # the first ``batch`` sequences of one pool
            rows = batch * next_n
            args = (q[:batch], kv, weights[:rows], lens[:batch], tables[:batch], meta, max_model_len)
            router.call_from(DEFINING, *args)
            calls += 1
    assert router.calls_taken == calls and router.calls_delegated == 0
    assert len(runs) == 2 and len(router.self_tests) == 2, router.self_tests
    assert all(problem is None for problem in router.self_tests.values())
    # Each call launched once, with SplitKV from its batch (3 to 16), and each self-test twice: SplitKV 1
    # and the largest any batch reaches (16), clamped to the self-test problem's 5 pages.
    assert len(launches) == calls + 4 and sorted(set(launches)) == [1, *range(3, 17)], sorted(set(launches))
    assert launches.count(5) == 2 + sum(-(-768 // b) == 5 for b in range(1, 257)) * 2


def test_a_fault_on_a_route_after_another_route_of_the_shape_is_ready(make_router, target, plugin_log):
    """Batch 4 is taken and ready; batch 3 of the same shape raises at launch: that call gets stock's
    answer, and the ready batch-4 route is stock from then on (the whole shape is)."""
    kernel = Kernel()
    router = make_router(kernel)
    four = problem(1, 31)
    assert agree(target, four, run(router, target, four)) and router.calls_taken == 1
    kernel.fault = "raises"
    three = problem(1, 32, lens=(7, 70, 9))
    assert agree(target, three, run(router, target, three)) and router.calls_taken == 1
    launches = kernel.launches
    four = problem(1, 33)
    assert agree(target, four, run(router, target, four))
    assert kernel.launches == launches and router.calls_taken == 1
    found = errors(plugin_log)
    assert len(found) == 1 and "planted kernel failure" in found[0], found


def test_capture_guard_needs_both_compiled_and_self_tested(make_router, target, plugin_log):
    """Inside capture a route launches only when its shape is compiled AND self-tested: either half
    alone keeps the graph on stock."""
    capturing = [True]
    kernel = Kernel()
    router = make_router(kernel, is_capturing=lambda: capturing[0])
    p = problem(1, 41)
    route = new_route(router, p.call_args())
    assert route.reason is None
    # The run below finds this route under the router's own memo key.
    router.routes.clear()
    # Compiled, not self-tested.
    router.compiled.add(route.shape)
    assert agree(target, p, run(router, target, p)) and kernel.launches == 0
    # Self-tested, not compiled.
    router.compiled.clear()
    router.self_tests[(route.shape, route.bounds)] = None
    assert agree(target, p, run(router, target, p)) and kernel.launches == 0
    # Both: taken inside capture.
    router.compiled.add(route.shape)
    run(router, target, p)
    assert kernel.launches == 1 and router.calls_taken == 1


def test_the_self_test_puts_back_vllms_workspace(make_router, target, workspace):
    """The workspace is vLLM's: after a shape's first call (self-test, then the live launch) every
    byte outside the call's read windows is what it was before."""
    kernel = Kernel()
    router = make_router(kernel)
    p = problem(2, 51, lens=(300, 250, 280, 299))
    rows = p.batch * p.next_n
    view = target.current_workspace_manager().get_simultaneous(((rows, p.max_model_len), torch.float32))[0]
    view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(52)))
    before = view.clone()
    run(router, target, p)
    assert router.calls_taken == 1 and router.self_tests
    ends = read_window_ends(p.context_lens, rows, p.next_n).view(-1, 1)
    outside = torch.arange(p.max_model_len).view(1, -1) >= ends
    assert torch.equal(view[outside], before[outside])


@pytest.mark.parametrize("plant", ["rule", "pick", "hook", "problem builder", "output buffer"])
def test_nothing_the_router_does_reaches_the_caller(make_router, target, plugin_log, monkeypatch, plant):
    """One net around the whole call: whatever the router's own work raises, the caller gets stock's
    answer, one ERROR, and the shape stays stock."""

    def boom(*args, **kwargs):
        raise KeyError(f"planted in the {plant}")

    kernel = Kernel()
    router = make_router(kernel)
    if plant == "rule":
        monkeypatch.setattr(router_module, "objection", boom)
    elif plant == "pick":
        monkeypatch.setattr(router_module, "pick_objection", boom)
    elif plant == "hook":
        router.hooks = dataclasses.replace(router.hooks, preshuffle=boom)
    elif plant == "problem builder":
        monkeypatch.setattr(selftest, "synthetic", boom)
    else:
        router.self_test = False
        router.hooks = dataclasses.replace(router.hooks, output_buffer=boom)
    # Twice at one batch, then at another batch of the shape: one ERROR for the shape, not per call.
    for p in (problem(1, 61), problem(1, 62), problem(1, 63, lens=(7, 70, 9))):
        out = run(router, target, p)
        assert agree(target, p, out)
    assert router.calls_taken == 0 and kernel.launches == 0 and router.calls_delegated == 3
    found = errors(plugin_log)
    assert len(found) == 1 and f"planted in the {plant}" in found[0], found
    assert router.failed


def test_breakable_graphs_run_the_router_eagerly_at_every_replay(make_router, target, monkeypatch):
    """vLLM's breakable CUDA graphs (``eager_break_during_capture``): the op ends the segment, runs
    eagerly, and runs again at every replay. The router then runs on every step; its first use
    (compile and self-test) happens once, outside any capture."""
    breakable = pytest.importorskip("vllm.compilation.breakable_cudagraph")
    # CPU stand-ins: no CUDA graph segments, and a weak reference is the tensor itself. Breakable graphs
    # on (vLLM 0.32.0's decorator reads the setting when it decorates; later ones at each call).
    monkeypatch.setattr(breakable, "_weak_ref_capture_arg", lambda arg: arg)
    monkeypatch.setattr(breakable, "is_breakable_cudagraph_enabled", lambda: True)

    class StandIn(breakable.BreakableCUDAGraphCapture):
        def _begin_segment(self) -> None:
            self._capturing = True

        def _end_segment(self) -> None:
            if self._capturing:
                self.segments.append(lambda: None)
                self._capturing = False

    capture = StandIn()
    kernel = Kernel()
    router = make_router(kernel, is_capturing=lambda: capture._capturing)
    runs = []
    real_run = selftest.run
    monkeypatch.setattr(selftest, "run", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    p = problem(2, 71)
    op = breakable.eager_break_during_capture(lambda *args: router.call_from(DEFINING, *args))
    with capture:
        out = op(*p.call_args())
    assert capture.num_eager_breaks == 1 and agree(target, p, out.clone())
    assert router.calls_taken == 1 and len(runs) == 1
    for _ in range(3):
        capture.replay()
    assert router.calls_taken == 4 and len(runs) == 1 and kernel.launches == 2 + 4


# ---------------------------------------------------------------- issue 43: a kernel off by a little


def test_a_kernel_off_by_a_little_fails_the_self_test_and_its_shape_stays_stock(
    make_router, target, plugin_log
):
    """Noise that keeps every -inf, every top-k index and every written column, at an agreement metric of
    about 5e-3: the self-test fails it (the rule is 1e-3; a rule loosened to 1e-2 would pass it), the call
    gets stock's answer, and the shape stays stock until vLLM restarts, as its one ERROR says."""
    kernel = Kernel("noisy")
    router = make_router(kernel)
    p = problem(2, 81)
    # The plant's metric on the self-test's own problem, against stock, at SplitKV 1.
    route = new_route(router, p.call_args())
    args = selftest.synthetic(*route.shape, 132, per_row_bounds=True, device=torch.device("cpu"))
    stock = target.rocm_fp8_paged_mqa_logits(*args).clone()
    noisy = torch.full_like(stock, float("nan"))
    router._flydsl(kernel, {**route.kwargs, "SplitKV": 1}, args, noisy)
    found = compare_in_windows(stock, noisy, read_window_ends(args[3], stock.shape[0], 2))
    assert found.nan_free and found.mask_equal and found.topk_equal, found.describe()
    assert 4e-3 < found.max_rel_diff < 6e-3, found.describe()
    router.routes.clear()
    kernel.launches = 0
    # The live call: the self-test fails at its first launch, the call gets stock's answer.
    out = run(router, target, p)
    assert agree(target, p, out) and router.calls_taken == 0 and kernel.launches == 1
    (error,) = errors(plugin_log)
    assert "self-test failed" in error and "max rel diff 5." in error, error
    assert "heads=32 head_dim=128 KVBlockSize=64 next_n=2" in error
    assert "use the stock path until vLLM restarts" in error
    # The shape stays stock at every batch, without another launch or ERROR.
    for later in (problem(2, 82), problem(2, 83, lens=(9, 99, 1))):
        assert agree(target, later, run(router, target, later))
    assert kernel.launches == 1 and router.calls_taken == 0 and len(errors(plugin_log)) == 1
    assert list(router.failed) == [route.shape]


def test_a_top_k_disagreement_alone_fails_the_self_test():
    """FlyDSL's answer is stock's but for one row's two neighbours at the top-k boundary, swapped: the same
    -inf mask, every read column written, a metric far inside 1e-3, and another top-2048 set. The
    self-test's rule fails it on the top-k alone, naming it; the unswapped answer passes."""
    import random

    seed = random.randrange(2**32)
    gen = torch.Generator().manual_seed(seed)
    k = selftest.INDEX_TOPK
    ends = [2 * k + 64, k + 100, 37]  # wider than the top-k, just wider, and narrower
    batch, width = len(ends), max(ends) + 16
    q = torch.randn(batch, 1, 32, 128, generator=gen).to(torch.float8_e4m3fn)
    lens = torch.tensor(ends, dtype=torch.int32)
    args = (q, None, None, lens, None, None, width)
    answer = torch.randn(batch, width, generator=gen) * 4
    answer[torch.rand(batch, width, generator=gen) < 0.05] = float("-inf")  # masked columns, both arms
    inside = torch.arange(width).view(1, -1) < lens.view(-1, 1)
    swapped = answer.clone()
    top = torch.where(inside[0], answer[0], -torch.inf).topk(k + 1).indices
    swapped[0, top[k - 1]], swapped[0, top[k]] = answer[0, top[k]], answer[0, top[k - 1]]
    workspace = torch.empty(batch * width)  # vLLM's workspace: every view starts at its front

    def stock_buffer(rows: int, columns: int) -> torch.Tensor:
        return workspace[: rows * columns].view(rows, columns)

    def stock(a: tuple) -> torch.Tensor:
        out = stock_buffer(batch, width)
        out[inside] = answer[inside]  # Gluon writes the window, leaves the rest
        return out

    def launch(values: torch.Tensor):
        return lambda a, out: out.copy_(torch.where(inside, values, out))  # out arrives NaN-poisoned

    found = compare_in_windows(answer, swapped, lens)
    assert found.mask_equal and found.nan_free and found.max_rel_diff < 1e-6, (seed, found.describe())
    assert not found.topk_equal, seed
    assert selftest.run(args, stock, stock_buffer, {"as stock": launch(answer)}) is None, seed
    said = selftest.run(args, stock, stock_buffer, {"planted": launch(swapped)})
    assert said is not None and said.startswith("FlyDSL planted: max rel diff"), (seed, said)
    assert "-inf mask identical, top-k DIFFERENT" in said and "NaN" not in said, (seed, said)


# ---------------------------------------------------------------- issue 43: under aiter's dispatcher


@pytest.mark.parametrize("batch,wg_per_cu", [(64, 2), (256, 1)])
def test_under_aiters_dispatcher_the_self_test_launches_flydsl_with_the_live_calls_row(
    target, workspace, aiter_as, aiter_calls, plugin_log, batch, wg_per_cu
):
    """The dispatcher's table picks Gluon for the self-test's four sequences: its self-test must still
    launch FlyDSL, once, through ``run_paged_mqa_logits`` with the dispatcher's own row for the live call
    (the double's rows differ by batch bucket), never Gluon and never a fixed configuration."""
    from vllm_flydsl_indexer import kernels

    aiter_as(flydsl="general", dispatcher=True)
    variant, reason = kernels.find_kernel()
    assert variant is not None and variant.name == "dispatcher", reason
    import aiter.paged_mqa_logits as dispatcher

    row = dispatcher.get_paged_mqa_logits_config(batch, 2, 32, 128, 64, True)
    assert row["backend"] == "flydsl" and row["wg_per_cu"] == wg_per_cu, row
    assert dispatcher.get_paged_mqa_logits_config(4, 2, 32, 128, 64, True)["backend"] == "gluon"
    router = FlyDSLRouter(target.rocm_fp8_paged_mqa_logits, variant, stock_hooks(target), LOGGER)
    p = make_paged_problem(
        torch.randint(2, 40, (batch,), generator=torch.Generator().manual_seed(batch)).tolist(),
        next_n=2, heads=32, head_dim=128, block_size=64, preshuffle=True,
        generator=torch.Generator().manual_seed(91),
    )  # fmt: skip
    out = run(router, target, p)
    assert router.calls_taken == 1 and list(router.self_tests.values()) == [None]
    # The self-test: stock's Gluon on its problem, then FlyDSL once, with the live call's row; then the
    # live call through the dispatcher, which picks the same row.
    assert [name for name, _ in aiter_calls] == ["gluon", "dispatcher", "flydsl", "dispatcher", "flydsl"]
    assert aiter_calls[1] == ("dispatcher", row) and aiter_calls[3] == ("dispatcher", row)
    assert agree(target, p, out)
    aiter_calls.clear()
    run(router, target, p)
    assert [name for name, _ in aiter_calls] == ["dispatcher", "flydsl"] and router.calls_taken == 2


# ---------------------------------------------------------------- wrong doubles behind register()
# (these were the runtime canary's tests, tests/test_verify.py; the canary is gone and the self-test,
# on by default, is what catches them)


@pytest.mark.parametrize(
    "flag,said", [("BROKEN", "max rel diff"), ("SHORT_BY_ONE", "NaN or unwritten values read")]
)
def test_a_wrong_flydsl_double_behind_register_is_caught_at_its_shapes_first_call(
    target, workspace, installed, aiter_calls, plugin_log, monkeypatch, flag, said
):
    """The aiter double's FlyDSL kernel, wrong (``BROKEN``: scaled) or a column short in every row
    (``SHORT_BY_ONE``; FlyDSL writes into a NaN-filled buffer, so a missing column shows): the shape's
    first call runs the self-test, which fails; that call and every later one of the shape get stock's
    answer, with one ERROR."""
    import aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits as fly

    from test_agreement import call

    monkeypatch.setattr(fly, flag, True)
    p1, p2 = (
        make_paged_problem(
            [257, 31, 0, 64],
            next_n=2,
            heads=64,
            head_dim=128,
            block_size=64,
            preshuffle=True,
            generator=torch.Generator().manual_seed(100 + i),
        )  # fmt: skip
        for i in range(2)
    )
    out = call(target.rocm_fp8_paged_mqa_logits, p1, 1)
    # The self-test's stock arm and its one FlyDSL launch, then the call itself on stock.
    assert [name for name, _ in aiter_calls] == ["gluon", "flydsl", "gluon"]
    (error,) = errors(plugin_log)
    assert "self-test failed" in error and said in error, error
    assert "heads=64 head_dim=128 KVBlockSize=64 next_n=2" in error and "until vLLM restarts" in error
    assert agree(target, p1, out)
    aiter_calls.clear()
    call(target.rocm_fp8_paged_mqa_logits, p2, 1)
    assert [name for name, _ in aiter_calls] == ["gluon"] and len(installed.router.failed) == 1
    assert installed.router.calls_taken == 0 and len(errors(plugin_log)) == 1


# ---------------------------------------------------------------- issue 49: the timing contexts


def test_flydsl_wrong_only_at_the_timing_context_fails_its_shape_before_it_is_timed(
    make_router, target, plugin_log, tmp_path, monkeypatch
):
    """A kernel right on the self-test's small problem and wrong past it (noise beyond bound 256) passes
    the small self-test; the measurement's self-test at its timing context (the live ``max_model_len``
    here, 320) fails it before it is timed: stock's answer, one ERROR naming the context, no cached row,
    and the shape stays stock."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    kernel = Kernel("long")
    assert max(selftest.synthetic_lengths(64, 1)) < LONG
    router = make_router(kernel, tune=True, gfx="gfx950")
    p = problem(1, 91, lens=(300, 41, 7), max_model_len=320)
    out = run(router, target, p)
    assert agree(target, p, out) and router.calls_taken == 0
    (error,) = errors(plugin_log)
    assert "self-test failed at context 320: FlyDSL at SplitKV" in error and "max rel diff" in error, error
    assert router.failed and not [r for r in plugin_log if "measured" in r.getMessage()]  # never timed
    assert not list(tmp_path.rglob("*.csv"))  # nothing cached: a restart tests again
    launches = kernel.launches
    later = problem(1, 92, lens=(310, 9), max_model_len=320)
    assert agree(target, later, run(router, target, later)) and kernel.launches == launches


def test_the_timing_contexts_self_test_runs_once_per_shape_and_context(
    make_router, target, tmp_path, monkeypatch
):
    """Two buckets of one shape, measured at the same context (the live ``max_model_len``): the small
    self-test once, the one at the timing context once, and both calls get stock's answer or FlyDSL's
    agreeing with it."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    router = make_router(Kernel(), tune=True, gfx="gfx950")
    ran, self_test = [], router._self_test
    router._self_test = lambda route, args, ratio, lengths=None: (
        ran.append(lengths) or self_test(route, args, ratio, lengths)
    )
    for seed, lens in ((93, (300,)), (94, (300, 41, 7))):  # buckets 1 and 2
        p = problem(1, seed, lens=lens, max_model_len=320)
        assert agree(target, p, run(router, target, p))
    assert ran == [[], [320]] and not router.failed  # the small problem, then the context
    assert list(router.self_tests.values()) == [None, None]
