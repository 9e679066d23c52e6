# SPDX-License-Identifier: Apache-2.0
"""What a CUDA (or HIP) GPU can prove about the hot path.

The adapter runs over a graph-capturable double of the FlyDSL kernel built on
the reference (``flydsl_contract_reference``); the stock call runs over the
Gluon-contract reference. None of this needs vLLM.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_flydsl_indexer.selftest import read_window_ends
from vllm_flydsl_indexer.tools.arms import Arms, Workspace, from_defining_module, patched_call, stock_call
from vllm_flydsl_indexer.tools.harness import compare_in_windows
from vllm_flydsl_indexer.tools.reference import (
    flydsl_contract_reference,
    fp8_paged_mqa_logits_reference,
    gluon_contract_reference,
    make_paged_problem,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or HIP GPU"),
]

LOGGER = logging.getLogger("vllm.plugins.flydsl_indexer")
B, MML, KVB = 8, 4096, 64


def problem(seed: int, next_n: int = 2, heads: int = 64, batch: int = B):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(next_n, MML + 1, (batch,), generator=gen)
    lens[0] = MML  # fixed shapes for replay
    lens[1] = 0  # a padding row
    return make_paged_problem(
        lens.tolist(),
        next_n=next_n,
        heads=heads,
        head_dim=128,
        block_size=KVB,
        preshuffle=True,
        max_model_len=MML,
        pool_blocks=batch * MML // KVB + 16,
        block_table_width=MML // KVB,
        generator=gen,
        device="cuda",
    )


def args_of(p):
    return [p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables]


class Routed:
    """The router as the defining module's indexer calls it (next_n > 1 may be taken)."""

    def __init__(self, router):
        self.router = router
        self.call = from_defining_module(router)

    def __call__(self, *args):
        return self.call(*args)

    @property
    def calls_taken(self):
        return self.router.calls_taken

    @property
    def calls_delegated(self):
        return self.router.calls_delegated


def router_and_workspace(next_n: int = 2, kernel=flydsl_contract_reference):
    ws = Workspace(B * next_n, MML, torch.device("cuda"))
    arms = Arms(False, "reference contracts", "", gluon_contract_reference, kernel)
    return Routed(patched_call(arms, ws)), ws


def expected(p):
    out = torch.full((p.batch * p.next_n, MML), float("nan"), device="cuda")
    return fp8_paged_mqa_logits_reference(
        p.q_fp8,
        p.kv_cache,
        p.weights,
        out,
        p.context_lens,
        p.block_tables,
        MML,
        preshuffle=True,
        contract="flydsl",
    )


def test_patched_call_captures_and_replays_on_fresh_inputs():
    router, ws = router_and_workspace()
    static = problem(0)
    static_args = args_of(static)
    router(*static_args, None, MML)  # eager first call: FlyDSL "compiles" outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        router(*static_args, None, MML)  # side-stream warm-up, as torch recommends
    torch.cuda.current_stream().wait_stream(stream)
    taken_before = router.calls_taken
    with torch.cuda.graph(graph):
        out = router(*static_args, None, MML)
    assert router.calls_taken == taken_before + 1, "the FlyDSL arm was not the one captured"
    for seed in (1, 2, 3):
        fresh = problem(seed)
        for dst, src in zip(static_args, args_of(fresh), strict=True):
            dst.copy_(src)
        ws.buffer.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = expected(fresh)
        ends = read_window_ends(fresh.context_lens, B * 2, 2)
        result = compare_in_windows(want, out, ends, topk=256)
        assert result.ok(0), result.describe()
        assert result.nan_free


def reversed_rows(q, kv, w, out, lens, bt, mml, **kw):
    """A planted FlyDSL arm: right values, but a sequence's rows in reverse order when next_n > 1."""
    flydsl_contract_reference(q, kv, w, out, lens, bt, mml, **kw)
    if q.shape[1] > 1:
        rows = out.view(q.shape[0], q.shape[1], -1)
        rows.copy_(rows.flip(1))
    return out


@pytest.mark.parametrize("kernel", [flydsl_contract_reference, reversed_rows])
def test_self_test_in_vllm_style_warm_up_then_capture(kernel):
    """vLLM's order: an eager warm-up step of each configuration (its self-test runs there, on this
    GPU), then graph capture and replay on fresh inputs. A configuration that failed its self-test
    is captured on stock; the others on FlyDSL; no self-test runs again."""
    router, ws = router_and_workspace(kernel=kernel)
    inner = router.router
    statics = {next_n: problem(40 + next_n, next_n=next_n) for next_n in (2, 1)}
    for p in statics.values():  # the warm-up steps
        out = router(*args_of(p), None, MML)
        torch.cuda.synchronize()
        ends = read_window_ends(p.context_lens, B * p.next_n, p.next_n)
        assert compare_in_windows(expected(p), out, ends, topk=256).ok(0), "warm-up got a wrong answer"
    bad = kernel is reversed_rows
    assert sorted(problem is None for problem in inner.self_tests.values()) == (
        [False, True] if bad else [True, True]
    )
    assert inner.calls_taken == (1 if bad else 2)
    tested = dict(inner.self_tests)
    for next_n, static in statics.items():
        static_args = args_of(static)
        taken, delegated = inner.calls_taken, inner.calls_delegated
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = router(*static_args, None, MML)
        stock_kept = bad and next_n == 2
        assert (inner.calls_taken - taken, inner.calls_delegated - delegated) == (
            (0, 1) if stock_kept else (1, 0)
        )
        for seed in (50, 51):
            fresh = problem(seed + 10 * next_n, next_n=next_n)
            for dst, src in zip(static_args, args_of(fresh), strict=True):
                dst.copy_(src)
            ws.buffer.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ends = read_window_ends(fresh.context_lens, B * next_n, next_n)
            result = compare_in_windows(expected(fresh), out, ends, topk=256)
            assert result.ok(0) and result.nan_free, (next_n, result.describe())
    assert inner.self_tests == tested, "a self-test ran again"


def test_adapter_issues_no_host_sync():
    router, _ = router_and_workspace()
    p = problem(5)
    router(*args_of(p), None, MML)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            router(*args_of(p), None, MML)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert router.calls_taken == 4


def _device_ops(fn) -> int:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


@pytest.mark.parametrize("next_n", [1, 2])
def test_adapter_launches_nothing_stock_does_not(next_n):
    p = problem(7, next_n)
    ws = Workspace(B * next_n, MML, torch.device("cuda"))
    arms = Arms(False, "reference contracts", "", gluon_contract_reference, flydsl_contract_reference)
    router = Routed(patched_call(arms, ws))
    stock = stock_call(gluon_contract_reference, ws)
    call_args = (*args_of(p), None, MML)
    lens = p.context_lens[:, -1].contiguous() if next_n > 1 else p.context_lens
    router(*call_args)
    stock(*call_args)  # warm both

    def kernel_alone(kernel, **kw):
        return lambda: kernel(
            p.q_fp8,
            p.kv_cache,
            p.weights,
            ws.get(B * next_n, MML),
            lens,
            p.block_tables,
            MML,
            Preshuffle=True,
            KVBlockSize=KVB,
            **kw,
        )

    adapter_extra = _device_ops(lambda: router(*call_args)) - _device_ops(
        kernel_alone(flydsl_contract_reference)
    )
    stock_extra = _device_ops(lambda: stock(*call_args)) - _device_ops(
        kernel_alone(gluon_contract_reference, ChunkK=256, WavePerEU=2)
    )
    assert router.calls_taken == 2
    assert adapter_extra == stock_extra, (adapter_extra, stock_extra)
    # Stock and adapter alike: one copy for the per-sequence lengths when next_n > 1, none otherwise.
    assert adapter_extra == (1 if next_n > 1 else 0)


def test_first_compile_never_happens_inside_capture():
    compiled: set[tuple] = set()

    def jit_kernel(q, kv, w, out, lens, bt, mml, *, Preshuffle=False, KVBlockSize=1, **kw):
        key = (q.shape[2], q.shape[3], KVBlockSize)
        if key not in compiled:
            torch.cuda.synchronize()  # a first-call JIT: illegal inside capture
            compiled.add(key)
        return flydsl_contract_reference(
            q, kv, w, out, lens, bt, mml, Preshuffle=Preshuffle, KVBlockSize=KVBlockSize
        )

    router, ws = router_and_workspace(kernel=jit_kernel)
    p = problem(9)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # unwarmed: the adapter keeps stock for this capture
        router(*args_of(p), None, MML)
    assert router.calls_taken == 0 and router.calls_delegated == 1 and compiled == set()
    router(*args_of(p), None, MML)  # eager step compiles
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        out = router(*args_of(p), None, MML)
    graph2.replay()
    torch.cuda.synchronize()
    assert router.calls_taken == 2
    ends = read_window_ends(p.context_lens, B * 2, 2)
    assert compare_in_windows(expected(p), out, ends, topk=256).ok(0)


def test_bench_runs_end_to_end_on_gpu(tmp_path):
    from vllm_flydsl_indexer.tools import cli

    path = tmp_path / "bench.json"
    rc = cli.main(
        [
            "bench",
            "--batch",
            "4",
            "--context-len",
            "8192",
            "--heads",
            "64",
            "--next-n",
            "2",
            "--block-size",
            "64",
            "--repeats",
            "5",
            "--json",
            str(path),
        ]
    )
    assert rc == 0
    import json

    data = json.loads(path.read_text())
    assert data["meta"]["copy_bw_gbps"] > 100
    assert all(r["status"] == "timed" and r["median_us"] > 0 for r in data["results"])


VARIANT_DOUBLES = {
    "general": ("aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits", 64),
    "gfx950": ("aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950", 32),
    "dispatcher": ("aiter.paged_mqa_logits", 32),
}


def variant_router(name: str, ws: Workspace, aiter_as):
    """The router over one kernel API's double (tests/doubles/aiter_flydsl), called as the indexer does."""
    import importlib

    from vllm_flydsl_indexer import kernels as identification

    module_name, heads = VARIANT_DOUBLES[name]
    aiter_as(flydsl="gfx950" if name == "gfx950" else "general", dispatcher=name == "dispatcher")
    module = importlib.import_module(module_name)
    fn = module.paged_mqa_logits if name == "dispatcher" else module.flydsl_fp8_paged_mqa_logits
    variant = (
        identification.identify_dispatcher(module, module_name)
        if name == "dispatcher"
        else identification.identify_flydsl(fn, module, module_name)
    )
    assert not isinstance(variant, str) and variant.name == name, variant
    arms = Arms(False, "doubles", "", gluon_contract_reference, fn, variant)
    return Routed(patched_call(arms, ws)), heads


@pytest.mark.parametrize("name", list(VARIANT_DOUBLES))
def test_each_variant_runs_without_sync_and_captures(name, aiter_as):
    """The no-sync and capture proofs against each API's double.

    The gfx950 double reads ``context_lens.max().item()`` unless the adapter
    passes SplitKV; sync debug mode turns that into an error.
    """
    ws = Workspace(B * 2, MML, torch.device("cuda"))
    router, heads = variant_router(name, ws, aiter_as)
    # The dispatcher's double, like AMD's table, picks FlyDSL from batch 64 only (Gluon below: stock).
    batch = 64 if name == "dispatcher" else B
    static = problem(20, heads=heads, batch=batch)
    static_args = (*args_of(static), None, MML)
    router(*static_args)  # eager: compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            router(*static_args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert router.calls_taken == 4 and router.calls_delegated == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router(*static_args)
    for seed in (21, 22):
        fresh = problem(seed, heads=heads, batch=batch)
        for dst, src in zip(args_of(static), args_of(fresh), strict=True):
            dst.copy_(src)
        ws.buffer.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.full((batch * 2, MML), float("nan"), device="cuda")
        fp8_paged_mqa_logits_reference(
            fresh.q_fp8,
            fresh.kv_cache,
            fresh.weights,
            want,
            fresh.context_lens,
            fresh.block_tables,
            MML,
            preshuffle=True,
            contract="flydsl",
        )
        result = compare_in_windows(want, out, read_window_ends(fresh.context_lens, batch * 2, 2), topk=256)
        assert result.nan_free and result.ok(0), result.describe()


def test_a_tuned_rows_split_kv_is_launched_without_sync_and_captured(aiter_as):
    """A FlyDSL row's wg_per_cu reaches the gfx950 launch as SplitKV on a real GPU: no host sync,
    captured into a graph, and replayed with the measured knob (aiter.CALLS records what was passed)."""
    import aiter

    from vllm_flydsl_indexer import kernels, tuning
    from vllm_flydsl_indexer.tools import behaviour

    ws = Workspace(B * 2, MML, torch.device("cuda"))
    router, heads = variant_router("gfx950", ws, aiter_as)
    cus = kernels.cu_count(torch.device("cuda"))
    header = ",".join(tuning.COLUMNS)
    text = f"{header}\ngfx950,{cus},1,2,{heads},128,64,True,8192,flydsl,0,0,2,1.0,2.0,1.0\n"
    router.router.table = tuning.parse(text, "gfx950", "t.csv")
    assert not isinstance(router.router.table, str), router.router.table
    static = problem(30, heads=heads)
    static_args = (*args_of(static), None, MML)
    aiter.CALLS.clear()
    router(*static_args)  # eager: compile and announce
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        router(*static_args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router(*static_args)
    expected_split = kernels.explicit_split_kv(cus, B, MML, KVB, 2)
    assert expected_split != kernels.explicit_split_kv(cus, B, MML, KVB)  # the knob, not the default
    # The shape's self-test (first call, eager: SplitKV 1 and the largest any launch of the shape
    # reaches, clamped to the self-test problem's pages), then three calls, each with the row's knob.
    top = min(behaviour.self_test_pages(KVB, 2), kernels.explicit_split_kv(cus, 1, MML, KVB, 4))
    assert [kw["SplitKV"] for name, kw in aiter.CALLS] == [1, top] + [expected_split] * 3
    assert router.calls_taken == 3 and router.calls_delegated == 0
    fresh = problem(31, heads=heads)
    for dst, src in zip(args_of(static), args_of(fresh), strict=True):
        dst.copy_(src)
    ws.buffer.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = expected(fresh)
    result = compare_in_windows(want, out, read_window_ends(fresh.context_lens, B * 2, 2), topk=256)
    assert result.nan_free and result.ok(0), result.describe()
