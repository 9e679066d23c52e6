# SPDX-License-Identifier: Apache-2.0
"""This node's measurement on a real GPU (issue 44): device events, the per-bucket bound, and never a
measurement inside ``torch.cuda.graph`` capture. FlyDSL does not run here, so the arms are stand-ins of
known relative speed (matrix products), as the issue allows. Needs no vLLM."""

from __future__ import annotations

import csv

import pytest
import torch

from conftest import LOGGER, general_variant, hooks
from vllm_flydsl_indexer import measure
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.tools.reference import make_paged_problem

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or HIP GPU"),
]
MML = 32768


class Arm:
    """``products`` matrix products of 1024x1024 per call: a capturable stand-in of known cost."""

    def __init__(self, products: int):
        self.products, self.calls = products, 0
        self.a = torch.randn(1024, 1024, device="cuda")

    def __call__(self, *args, **kwargs):
        self.calls += 1
        x = self.a
        for _ in range(self.products):
            x = x @ self.a
        return x


def router_of(stock, flydsl):
    buffer = torch.full((64, MML), float("nan"), device="cuda")
    return FlyDSLRouter(stock, general_variant(flydsl), hooks(buffer), LOGGER, self_test=False, tune=True)


def problem(lens=(300, 5000, 70, 900)):
    return make_paged_problem(
        list(lens), next_n=1, heads=64, head_dim=128, block_size=64, preshuffle=True, max_model_len=MML,
        device="cuda",
    )  # fmt: skip


def call(router, p=None):
    p = p or problem()
    return router(p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, p.max_model_len)


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))


def test_the_measurement_times_with_device_events_within_its_bound(monkeypatch):
    timed = []

    class Event(torch.cuda.Event):
        def elapsed_time(self, end):
            timed.append(super().elapsed_time(end))
            return timed[-1]

    monkeypatch.setattr(measure.torch.cuda, "Event", Event)
    stock, flydsl = Arm(8), Arm(1)
    router = router_of(stock, flydsl)
    call(router, problem((300,)))  # bucket 1 first: CUDA's and cuBLAS's lazy start-up (the "compilation")
    spent, timed[:] = router.spent, []
    call(router)  # bucket 4
    spent = router.spent - spent
    assert timed and router.calls_taken == 2
    # Within the bucket's budget; beyond it only each candidate's untimed and first timed call per context.
    print(f"bucket 4 measured in {spent * 1e3:.1f} ms, {len(timed)} event timings")
    assert spent < 1.5 * measure.BUCKET_BUDGET_S, spent
    with open(measure.cache_path(router.gfx, measure.cu_count(torch.device("cuda")))) as f:
        (row,) = [r for r in csv.DictReader(f) if r["batch_size"] == "4"]
    assert row["backend"] == "flydsl" and row["batch_size"] == "4"
    assert float(row["gluon_us"]) > 3 * float(row["flydsl_us"]), row  # 8 products against 1


def test_a_bucket_first_seen_in_capture_stays_stock_until_an_eager_call_measures_it():
    stock, flydsl = Arm(8), Arm(1)
    router = router_of(stock, flydsl)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        Arm(1)()
    torch.cuda.current_stream().wait_stream(side)
    graph, p = torch.cuda.CUDAGraph(), problem()
    with torch.cuda.graph(graph):
        call(router, p)
    assert stock.calls == 1 and flydsl.calls == 0, "no measurement in capture: stock's own call only"
    assert router.verdicts == {} and router.spent == 0 and router.routes == {}
    graph.replay()
    torch.cuda.synchronize()
    call(router, p)
    assert router.spent > 0 and router.calls_taken == 1 and flydsl.calls > 2
