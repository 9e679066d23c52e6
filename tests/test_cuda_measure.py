# SPDX-License-Identifier: Apache-2.0
"""This node's measurement on a real GPU (issues 44, 49): it times what serving replays, never the host.

FlyDSL does not run here, so the arms are stand-ins whose host cost (a busy wait per launch) and GPU cost
(``torch.cuda._sleep``) are set, as issue 49 asks. The truth is each arm's time as a replayed graph runs
it, taken with many more replays than the measurement's; the verdict must follow it in every trial.
Needs no vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

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
TRIALS = 10
# (name, (stock host us, stock GPU us), (candidate host us, candidate GPU us)): issue 49's cases.
CASES = [
    ("host-heavy stock, GPU-heavier candidate", (20, 4), (6, 5)),
    ("host-heavy stock, GPU-heavier candidate, 10 us", (20, 10), (6, 12)),
    ("equal hosts, GPU-heavier candidate", (15, 4), (15, 5)),
    ("host-light stock, host-heavy GPU-lighter candidate", (5, 40), (25, 38)),
    ("the reverse: host-light GPU-heavier stock", (6, 5), (20, 4)),
    ("a near tie: the candidate 2% slower on the GPU", (10, 10), (10, 10.2)),
]
IDENTICAL_TRIALS = 30


@pytest.fixture(scope="module")
def cycles_per_us() -> float:
    """``torch.cuda._sleep``'s cycles per microsecond on this GPU, from a replayed graph."""
    cycles, graph = 200_000, torch.cuda.CUDAGraph()
    torch.cuda._sleep(cycles)
    with torch.cuda.graph(graph):
        torch.cuda._sleep(cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return cycles / statistics.median(times)


class Arm:
    """A launch that costs the host ``host_us`` (a busy wait) and the GPU ``gpu_us``; ``capturable`` False
    raises inside graph capture, as a kernel that cannot be captured."""

    def __init__(self, host_us: float, gpu_us: float, rate: float, capturable: bool = True):
        self.host, self.cycles, self.capturable, self.calls = (
            host_us * 1e-6,
            int(gpu_us * rate),
            capturable,
            0,
        )

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if not self.capturable and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("this stand-in cannot be captured")
        end = time.perf_counter() + self.host
        while time.perf_counter() < end:
            pass
        torch.cuda._sleep(self.cycles)


def replayed_us(arm: Arm, calls: int = 20, replays: int = 15) -> float:
    """The truth: ``arm``'s microseconds per call as a replayed graph runs it."""
    arm()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            arm()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def eager_us(arm: Arm, calls: int = 20) -> float:
    """What issue 44's measurement timed: back-to-back Python launches between two events."""
    arm()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        arm()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def verdict(stock: Arm, candidate: Arm) -> str:
    buffer = torch.full((64, MML), float("nan"), device="cuda")
    router = FlyDSLRouter(
        stock, general_variant(candidate), hooks(buffer), LOGGER, self_test=False, tune=True
    )
    p = make_paged_problem(
        [300, 5000, 70, 900], next_n=1, heads=64, head_dim=128, block_size=64, preshuffle=True,
        max_model_len=MML, device="cuda",
    )  # fmt: skip
    pick = router.decide((p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, MML), 1)
    return pick[0] if isinstance(pick, tuple) else "stock"


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(measure, "cache_key", lambda *a: None)  # every trial measures


def _record(name: str, rows: list) -> None:
    out = os.environ.get("VLLM_FLYDSL_INDEXER_RESULTS")
    if out:
        with open(os.path.join(out, f"{name}.json"), "a") as f:
            f.write(json.dumps(rows) + "\n")


@pytest.mark.parametrize(("name", "stock_cost", "candidate_cost"), CASES, ids=[c[0] for c in CASES])
def test_the_verdict_follows_graph_replay_in_every_trial(cycles_per_us, name, stock_cost, candidate_cost):
    stock, candidate = Arm(*stock_cost, cycles_per_us), Arm(*candidate_cost, cycles_per_us)
    truth_stock, truth_candidate = replayed_us(stock), replayed_us(candidate)
    truth = "flydsl" if truth_candidate * measure.MARGIN <= truth_stock else "gluon"
    eager = "flydsl" if eager_us(candidate) * measure.MARGIN <= eager_us(stock) else "gluon"
    verdicts = [verdict(stock, candidate) for _ in range(TRIALS)]
    row = {"case": name, "stock": stock_cost, "candidate": candidate_cost, "truth": truth,
           "replay_us": [round(truth_stock, 2), round(truth_candidate, 2)], "eager_launches_pick": eager,
           "verdicts": verdicts}  # fmt: skip
    print(json.dumps(row))
    _record("verdicts", row)
    assert verdicts == [truth] * TRIALS, row


def test_identical_arms_are_never_picked(cycles_per_us):
    stock, candidate = Arm(10, 10, cycles_per_us), Arm(10, 10, cycles_per_us)
    verdicts = [verdict(stock, candidate) for _ in range(IDENTICAL_TRIALS)]
    _record("identical", {"trials": IDENTICAL_TRIALS, "picked": verdicts.count("flydsl")})
    print(f"identical arms: candidate picked {verdicts.count('flydsl')} of {IDENTICAL_TRIALS}")
    assert verdicts.count("flydsl") == 0, verdicts


def test_a_candidate_that_will_not_capture_is_timed_queued_behind_the_device(cycles_per_us):
    """No graph: its launches wait behind a device-side delay, so a host-heavy, GPU-light candidate is
    timed by its GPU cost (5 us), not the host's rate (30 us a launch)."""
    stock, candidate = Arm(2, 20, cycles_per_us), Arm(30, 5, cycles_per_us, capturable=False)
    assert verdict(stock, candidate) == "flydsl" and candidate.calls > measure.ROUNDS


def test_a_bucket_first_seen_in_capture_stays_stock_until_an_eager_call_measures_it(cycles_per_us):
    stock, flydsl = Arm(5, 40, cycles_per_us), Arm(5, 5, cycles_per_us)
    buffer = torch.full((64, MML), float("nan"), device="cuda")
    router = FlyDSLRouter(stock, general_variant(flydsl), hooks(buffer), LOGGER, self_test=False, tune=True)
    p = make_paged_problem(
        [300, 5000, 70, 900], next_n=1, heads=64, head_dim=128, block_size=64, preshuffle=True,
        max_model_len=MML, device="cuda",
    )  # fmt: skip
    args = (p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, MML)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stock()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        router(*args)
    assert stock.calls == 2 and flydsl.calls == 0, "no measurement in capture: stock's own call only"
    assert router.verdicts == {} and router.spent == 0 and router.routes == {}
    graph.replay()
    torch.cuda.synchronize()
    router(*args)
    assert router.spent > 0 and router.calls_taken == 1 and flydsl.calls > measure.ROUNDS


def test_the_first_call_times_every_bucket_up_to_the_largest_batch_by_graph_replay(cycles_per_us):
    """Issue 49 item 4 on a GPU: the warm-up call at batch 4 times buckets 1 to 64 (each captured and
    replayed); later batches of any of them are decided from those rows, with nothing timed again."""
    stock, flydsl = Arm(5, 40, cycles_per_us), Arm(5, 5, cycles_per_us)
    buffer = torch.full((64, MML), float("nan"), device="cuda")
    swept = dataclasses.replace(hooks(buffer), max_batch=lambda: 64)
    router = FlyDSLRouter(stock, general_variant(flydsl), swept, LOGGER, self_test=False, tune=True)

    def call(batch: int):
        p = make_paged_problem(
            [300 + 97 * i for i in range(batch)], next_n=1, heads=64, head_dim=128, block_size=64,
            preshuffle=True, max_model_len=MML, device="cuda",
        )  # fmt: skip
        router(p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, MML)

    began = time.perf_counter()
    call(4)
    sweep_s, spent = time.perf_counter() - began, router.spent
    assert sorted(bucket for _, bucket, _ in router.node[2]) == [1, 2, 4, 8, 16, 32, 64]
    assert {row["backend"] for row in router.node[2].values()} == {"flydsl"}
    calls = flydsl.calls
    for batch in (1, 3, 16, 50, 64):
        call(batch)
    assert router.spent == spent and flydsl.calls == calls + 5 and router.calls_taken == 6
    _record("sweep", [{"buckets": 7, "sweep_s": round(sweep_s, 3), "spent_s": round(spent, 3)}])
