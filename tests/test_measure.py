# SPDX-License-Identifier: Apache-2.0
"""Never FlyDSL blind (issue 44): a shape no table covers is measured on this GPU before FlyDSL takes it.

Under the CPU simulation the measurement times with the wall clock, and its problem shrinks to the call's
``max_model_len`` (small here), so doubles of known relative speed (a sleep per call) decide it. 64 heads
and no table row, as for DeepSeek-V3.2.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import textwrap
import time

import pytest
import torch

from conftest import (
    LOGGER,
    TESTS,
    as_args,
    general_variant,
    hooks,
    simulation_env,
)
from vllm_flydsl_indexer import measure
from vllm_flydsl_indexer.kernels import identify_entry
from vllm_flydsl_indexer.router import FlyDSLRouter

SLOW, FAST = 0.004, 0.0005


class Arm:
    """A stand-in kernel of known speed: sleeps ``delay`` per call and counts its calls."""

    def __init__(self, delay: float, fail: bool = False):
        self.delay, self.fail, self.calls, self.longest = delay, fail, 0, 0.0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fail:
            raise RuntimeError("planted failure")
        began = time.perf_counter()
        time.sleep(self.delay)
        self.longest = max(self.longest, time.perf_counter() - began)
        return torch.full((1,), 7.0)


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    return tmp_path


def make(stock, flydsl, tune=True, entry=None, **kw):
    variant = general_variant(flydsl)
    if entry is not None:
        variant = dataclasses.replace(variant, entry=entry)
    return FlyDSLRouter(stock, variant, hooks(), LOGGER, self_test=False, tune=tune, gfx="gfx950", **kw)


def _problem(lens, next_n):
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    return make_paged_problem(
        lens, next_n=next_n, heads=64, head_dim=128, block_size=64, preshuffle=True, max_model_len=256
    )


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_a_slower_flydsl_leaves_every_decode_call_on_stock(cache_root):
    stock, flydsl = Arm(FAST), Arm(SLOW)
    router = make(stock, flydsl)
    for batch in (3, 3, 2, 5, 4):
        router(*as_args(_problem(torch.randint(40, 120, (batch,)).tolist(), 1)))
    assert router.calls_taken == 0 and router.calls_delegated == 5
    cached = rows(measure.cache_path("gfx950", 1))
    assert {(r["batch_size"], r["backend"], r["heads"]) for r in cached} == {
        ("2", "gluon", "64"),
        ("4", "gluon", "64"),
    }
    assert all(float(r["flydsl_us"]) > float(r["gluon_us"]) for r in cached)


def test_a_faster_flydsl_takes_every_decode_call(cache_root):
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl)
    router(*as_args(_problem([50, 60, 70], 1)))
    measured = stock.calls
    assert measured > 1 and router.calls_taken == 1  # stock ran inside the measurement only
    for batch in (3, 2):
        router(*as_args(_problem(torch.randint(40, 120, (batch,)).tolist(), 1)))
    assert router.calls_taken == 3 and router.calls_delegated == 0 and stock.calls == measured
    (row,) = rows(measure.cache_path("gfx950", 1))
    assert row["backend"] == "flydsl" and row["batch_size"] == "2" and row["context_len"] == "256"
    assert float(row["gluon_us"]) > float(row["flydsl_us"]) * measure.MARGIN


def test_a_second_process_reads_the_cache_and_measures_nothing(cache_root):
    first = make(Arm(SLOW), Arm(FAST))
    first(*as_args(_problem([50, 60], 1)))
    assert first.spent > 0
    stock, flydsl = Arm(SLOW), Arm(FAST)
    second = make(stock, flydsl)
    second(*as_args(_problem([70, 80, 90], 1)))
    assert second.spent == 0 and stock.calls == 0 and flydsl.calls == 1  # the live call only
    assert second.calls_taken == 1


def test_a_corrupt_cache_is_ignored_with_one_warning_and_replaced(cache_root, plugin_log):
    path = measure.cache_path("gfx950", 1)
    path.parent.mkdir(parents=True)
    path.write_text("gfx,cu_num\n\x00garbage,,,\n")
    router = make(Arm(SLOW), Arm(FAST))
    router(*as_args(_problem([50, 60], 1)))
    warnings = [r.getMessage() for r in plugin_log if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "node cache ignored" in warnings[0], warnings
    (row,) = rows(path)
    assert row["backend"] == "flydsl" and row["gfx"] == "gfx950"


def test_a_foreign_cache_row_is_rewritten(cache_root, plugin_log):
    first = make(Arm(SLOW), Arm(FAST))
    first(*as_args(_problem([50, 60], 1)))
    path = measure.cache_path("gfx950", 1)
    path.write_text(path.read_text().replace(",1,2,", ",7,2,", 1))  # a row for a 7-CU GPU
    router = make(Arm(FAST), Arm(SLOW))
    router(*as_args(_problem([50, 60], 1)))
    assert router.spent > 0 and router.calls_taken == 0
    assert [(r["cu_num"], r["backend"]) for r in rows(path)] == [("1", "gluon")]


def test_never_measures_in_capture_and_an_eager_call_decides_later(cache_root):
    capturing = [True]
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl, is_capturing=lambda: capturing[0])
    args = as_args(_problem([50, 60], 1))
    router(*args)
    assert stock.calls == 1 and flydsl.calls == 0 and router.spent == 0  # stock's live call only
    assert router.verdicts == {} and router.routes == {}  # nothing memoised from capture
    capturing[0] = False
    router(*args)
    assert router.spent > 0 and router.calls_taken == 1


def test_tune_off_keeps_unmeasured_buckets_on_stock(cache_root):
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl, tune=False)
    router(*as_args(_problem([50, 60], 1)))
    assert router.calls_delegated == 1 and flydsl.calls == 0 and stock.calls == 1
    assert not measure.cache_path("gfx950", 1).exists()


def test_no_table_chosen_keeps_flydsl_wherever_eligible(cache_root):
    stock, flydsl = Arm(SLOW), Arm(SLOW)
    router = make(stock, flydsl, tune=None)
    router(*as_args(_problem([50, 60], 1)))
    assert router.calls_taken == 1 and stock.calls == 0 and router.spent == 0


def test_a_measurement_that_raises_leaves_the_bucket_stock_with_one_warning(cache_root, plugin_log):
    router = make(Arm(FAST), Arm(FAST, fail=True))
    for _ in range(3):
        router(*as_args(_problem([50, 60], 1)))
    assert router.calls_taken == 0 and router.calls_delegated == 3
    warnings = [r.getMessage() for r in plugin_log if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "planted failure" in warnings[0] and "stays stock" in warnings[0]
    assert not measure.cache_path("gfx950", 1).exists()


@pytest.mark.parametrize(
    ("figures", "taken"),
    [
        ([1.0, 0.98, math.inf], "gluon"),
        ([1.0, 0.96, math.inf], "flydsl"),
        ([1.0, 0.99, 0.5], "flydsl_gfx950"),
    ],
)
def test_the_winner_must_beat_stock_by_the_margin(cache_root, monkeypatch, figures, taken):
    monkeypatch.setattr(measure, "measure", lambda *a: list(figures))
    router = make(Arm(0), Arm(0))
    pick = router.pick(as_args(_problem([50, 60], 1)), 1)
    assert pick[0] == taken and pick[4] == "this node's measurement"


def test_the_process_budget_leaves_later_buckets_on_stock(cache_root, monkeypatch):
    router = make(Arm(SLOW), Arm(FAST))
    router.spent = measure.PROCESS_BUDGET_S
    router(*as_args(_problem([50, 60], 1)))
    assert router.calls_delegated == 1 and not measure.cache_path("gfx950", 1).exists()


def test_the_bucket_bound_holds_on_the_wall_clock(cache_root):
    """Each bucket's timed repeats stay within BUCKET_BUDGET_S (plus one call per candidate and context)."""
    stock, flydsl = Arm(0.002), Arm(0.002)
    router = make(stock, flydsl)
    router.pick(as_args(_problem([50, 60, 70, 80], 1)), 1)
    # Beyond the shares: each candidate's untimed call and its first timed one (one context under the CPU
    # simulation), at most the longest call each, and the measurement's own Python.
    extra = 2 * (stock.longest + flydsl.longest)
    assert router.spent < measure.BUCKET_BUDGET_S + extra + 0.01, (router.spent, extra)
    assert stock.calls > 2 and flydsl.calls > 2


def test_the_gfx950_entry_runs_only_where_the_measurement_chose_it(cache_root, aiter_as, aiter_calls):
    aiter_as(flydsl="general+entry")
    from aiter.ops.flydsl.kernels.mqa_logits import fp8_paged_mqa_logits_gfx950_entry as module

    from vllm_flydsl_indexer.kernels import find_kernel

    variant, _ = find_kernel()
    assert variant.name == "general" and variant.entry is not None and variant.entry.name == "gfx950-entry"
    assert variant.entry.heads == frozenset({32, 64}) and variant.entry.max_next_n == 2
    kwargs = variant.entry.launch_kwargs(2, 64, 256, 1)
    assert "Preshuffle" not in kwargs and kwargs["SplitKV"] == 4  # ceil(1 CU * 8 / 2), from shapes
    entry = identify_entry(module.flydsl_fp8_paged_mqa_logits_gfx950, module, "double")
    p = _problem([50, 60], 1)
    # The general kernel slow, the entry fast: the entry is measured faster and launched.
    router = make(Arm(0.6), Arm(0.6), entry=entry)  # the entry double computes the reference: ~70 ms
    out = router(*as_args(p))
    assert router.calls_taken == 1 and aiter_calls[-1][0] == "flydsl-gfx950-entry", router.verdicts
    assert torch.isfinite(out[:, :50]).any()
    # Made slower than stock: never launched (stock wins the measurement).
    module.DELAY_S = SLOW
    try:
        aiter_calls.clear()
        other = make(Arm(FAST), Arm(SLOW), entry=entry)
        other.node = measure.load_cache(measure.cache_path("gfx950", 1), "gfx950", 1, LOGGER)
        other.node.shapes.clear()
        other(*as_args(_problem([50, 60, 70, 80], 1)))
        assert other.calls_taken == 0
    finally:
        module.DELAY_S = 0.0


TP_SCRIPT = textwrap.dedent(
    """
    import dataclasses, datetime, json, sys, time
    sys.path.insert(0, {tests!r})
    import torch, torch.distributed as dist
    from conftest import LOGGER, general_variant, hooks
    from vllm_flydsl_indexer.router import FlyDSLRouter
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    rank, fail = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method="file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))

    class Arm:
        def __init__(self, delay, fail=False):
            self.delay, self.fail = delay, fail
        def __call__(self, *a, **k):
            if self.fail:
                raise RuntimeError("planted failure on rank %d" % rank)
            time.sleep(self.delay)
            return torch.zeros(1)

    flydsl = Arm({fast}, fail=(fail == "raise" and rank == 1))
    if fail == "slow" and rank == 1:
        flydsl = Arm(3 * {slow})
    h = dataclasses.replace(hooks(), tp_group=lambda: (dist.group.WORLD, rank))
    router = FlyDSLRouter(Arm({slow}), general_variant(flydsl), h, LOGGER, self_test=False, tune=True)
    for batch in (2, 2, 5, 3, 4):
        p = make_paged_problem([60] * batch, next_n=1, heads=64, head_dim=128, block_size=64, preshuffle=True,
                               max_model_len=256)
        router(p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, p.max_model_len)
    verdicts = {{str(k[1]): (v if isinstance(v, str) else v[0]) for k, v in router.verdicts.items()}}
    print(json.dumps({{"verdicts": verdicts, "taken": router.calls_taken}}))
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize(("fail", "expected"), [("none", "flydsl"), ("raise", "stock"), ("slow", "gluon")])
def test_two_tp_ranks_agree_and_none_hangs_when_one_fails(tmp_path, fail, expected):
    """Two processes over gloo: one verdict per bucket for both; the slowest rank counts; a rank whose
    measurement raises leaves the group on stock, and neither hangs."""
    import json
    import subprocess
    import sys

    code = TP_SCRIPT.format(tests=str(TESTS), store=str(tmp_path / "store"), fast=FAST, slow=SLOW)
    env = simulation_env(VLLM_CACHE_ROOT=str(tmp_path / "cache"))
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(rank), fail], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=200)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["verdicts"] == results[1]["verdicts"]
    assert set(results[0]["verdicts"]) == {"2", "4"}
    kinds = {v if v in ("flydsl", "gluon") else "stock" for v in results[0]["verdicts"].values()}
    assert kinds == {expected}, results
    assert all(r["taken"] == (5 if expected == "flydsl" else 0) for r in results)


def test_a_problem_over_the_memory_cap_is_not_built_and_stays_stock(cache_root, monkeypatch, plugin_log):
    """At most MAX_EXTRA_BYTES beyond vLLM's own (q, weights and block tables; the logits are vLLM's
    workspace): a bucket whose timing problem needs more is refused before anything is allocated."""
    monkeypatch.setattr(measure, "MAX_EXTRA_BYTES", 2 * 64 * (128 + 4) - 1)  # below batch 2's q and weights
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl)
    router(*as_args(_problem([50, 60], 1)))
    assert router.calls_delegated == 1 and flydsl.calls == 0 and stock.calls == 1
    (warning,) = [r.getMessage() for r in plugin_log if r.levelname == "WARNING"]
    assert "MemoryError" in warning and "stays stock" in warning
