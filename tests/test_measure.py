# SPDX-License-Identifier: Apache-2.0
"""Never FlyDSL blind (issues 44, 49): a shape no table covers is measured on this GPU before FlyDSL takes it.

Under the CPU simulation the measurement times with the wall clock, and its problem shrinks to the call's
``max_model_len`` (small here), so doubles of known relative speed (a sleep per call) decide it. 64 heads
and no table row, as for DeepSeek-V3.2. What the code decides is asserted (calls, rows, verdicts), never a
wall-clock bound: these tests pass with the other core busy.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import os
import random
import textwrap
import time

import pytest
import torch

from conftest import LOGGER, TESTS, as_args, general_variant, hooks, simulation_env
from vllm_flydsl_indexer import measure, tuning
from vllm_flydsl_indexer.router import FlyDSLRouter

SLOW, FAST = 0.004, 0.0005
GFX, CUS = "gfx950", 1


class Arm:
    """A stand-in kernel of known speed: sleeps ``delay`` per call, counts its calls, logs them in
    ``order`` (shared by the arms of one test)."""

    def __init__(self, delay: float, fail: bool = False, name: str = "", order: list | None = None):
        self.delay, self.fail, self.calls, self.name, self.order = delay, fail, 0, name, order

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.order is not None:
            self.order.append(self.name)
        if self.fail:
            raise RuntimeError("planted failure")
        time.sleep(self.delay)
        return torch.full((1,), 7.0)


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    return tmp_path


def make(stock, flydsl, tune=True, hooks_=None, **kw):
    variant = general_variant(flydsl)
    return FlyDSLRouter(stock, variant, hooks_ or hooks(), LOGGER, self_test=False, tune=tune, gfx=GFX, **kw)


def _problem(lens, next_n=1, max_model_len=256):
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    return make_paged_problem(
        lens,
        next_n=next_n,
        heads=64,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        max_model_len=max_model_len,
    )


def batch(n, max_model_len=256):
    return as_args(_problem(torch.randint(40, 120, (n,)).tolist(), max_model_len=max_model_len))


def path():
    return measure.cache_path(GFX, CUS, measure.cache_key(torch.device("cpu"), GFX, CUS))


def rows(file=None):
    with open(file or path()) as f:
        assert f.readline() == measure.cache_key(torch.device("cpu"), GFX, CUS) + "\n"
        return list(csv.DictReader(f))


def warnings_of(plugin_log):
    return [r.getMessage() for r in plugin_log if r.levelname == "WARNING"]


def test_a_slower_flydsl_leaves_every_decode_call_on_stock(cache_root):
    stock, flydsl = Arm(FAST), Arm(SLOW)
    router = make(stock, flydsl)
    for n in (3, 3, 2, 5, 4):
        router(*batch(n))
    assert router.calls_taken == 0 and router.calls_delegated == 5
    cached = rows()
    assert {(r["batch_size"], r["backend"], r["heads"]) for r in cached} == {
        ("2", "gluon", "64"),
        ("4", "gluon", "64"),
    }
    assert all(float(r["flydsl_us"]) > float(r["gluon_us"]) for r in cached)


def test_a_faster_flydsl_takes_every_decode_call(cache_root):
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl)
    router(*batch(3))
    measured = stock.calls
    assert measured > 1 and router.calls_taken == 1  # stock ran inside the measurement only
    for n in (3, 2):
        router(*batch(n))
    assert router.calls_taken == 3 and router.calls_delegated == 0 and stock.calls == measured
    (row,) = rows()
    assert row["backend"] == "flydsl" and row["batch_size"] == "2" and row["context_len"] == "256"
    assert float(row["gluon_us"]) > float(row["flydsl_us"]) * measure.MARGIN


def test_each_arm_is_timed_in_interleaved_rounds_after_one_untimed_call(cache_root):
    """ROUNDS rounds, each arm once a round, in a rotating order: never all of stock then all of FlyDSL."""
    order: list[str] = []
    stock, flydsl = Arm(SLOW, name="s", order=order), Arm(FAST, name="f", order=order)
    router = make(stock, flydsl)
    router.decide(batch(2), 1)
    assert stock.calls == flydsl.calls == 1 + measure.ROUNDS  # one context under the simulation
    timed = order[2:]
    assert sorted(timed) == sorted("sf" * measure.ROUNDS)
    firsts = {timed[2 * r] for r in range(measure.ROUNDS)}
    assert firsts == {"s", "f"}, timed  # the round's first arm changes


def test_a_second_process_reads_the_cache_at_its_context_and_measures_again_at_another(cache_root):
    first = make(Arm(SLOW), Arm(FAST))
    first(*batch(2))
    assert first.spent > 0
    stock, flydsl = Arm(SLOW), Arm(FAST)
    second = make(stock, flydsl)
    second(*batch(3))
    assert second.spent == 0 and stock.calls == 0 and flydsl.calls == 1  # the live call only
    assert second.calls_taken == 1
    third_stock, third_flydsl = Arm(FAST), Arm(SLOW)
    third = make(third_stock, third_flydsl)
    third(*batch(3, max_model_len=128))  # another max_model_len: the cached row is not its context
    assert third.spent > 0 and third.calls_taken == 0 and third_stock.calls > 1
    assert sorted(r["context_len"] for r in rows()) == ["128", "256"]


def test_a_cache_from_another_stack_is_not_used(cache_root, monkeypatch):
    make(Arm(SLOW), Arm(FAST))(*batch(2))
    assert rows()[0]["backend"] == "flydsl"
    for what in ("torch", "triton", "vllm", "aiter", "flydsl"):
        versions = {**measure.stack_versions(), what: "9.9.9-other"}
        monkeypatch.setattr(measure, "stack_versions", lambda v=versions: v)
        router = make(Arm(FAST), Arm(SLOW))
        router(*batch(2))
        assert router.spent > 0 and router.calls_taken == 0, what  # measured, not read
        monkeypatch.undo()
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache_root))


def test_an_unreadable_version_is_measured_and_never_cached(cache_root, monkeypatch):
    versions = {**measure.stack_versions(), "triton": "unknown"}
    monkeypatch.setattr(measure, "stack_versions", lambda: versions)
    assert measure.cache_key(torch.device("meta"), GFX, CUS) is None  # on a device: no key
    assert measure.cache_key(torch.device("cpu"), GFX, CUS) is not None  # the simulation runs no Triton


def test_a_corrupt_cache_file_is_ignored_with_one_warning_and_replaced(cache_root, plugin_log):
    path().parent.mkdir(parents=True, mode=0o700)
    path().write_text("gfx,cu_num\n\x00garbage,,,\n")
    router = make(Arm(SLOW), Arm(FAST))
    router(*batch(2))
    warnings = warnings_of(plugin_log)
    assert len(warnings) == 1 and "node cache" in warnings[0] and "another stack" in warnings[0], warnings
    (row,) = rows()
    assert row["backend"] == "flydsl" and row["gfx"] == GFX


def _plant(**changes):
    """A measured row, then ``changes`` to it: what a second process reads."""
    make(Arm(SLOW), Arm(FAST))(*batch(2))
    (row,) = rows()
    row.update(changes)
    text = path().read_text().splitlines()
    writer_rows = [row] + (
        [dict(row, backend="gluon", us=row["gluon_us"], flydsl_us=str(2 * float(row["gluon_us"])))]
        if changes.pop("_twice", 0)
        else []
    )
    import io

    out = io.StringIO()
    writer = csv.DictWriter(out, tuning.COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: r[k] for k in tuning.COLUMNS} for r in writer_rows)
    path().write_text(text[0] + "\n" + out.getvalue())


@pytest.mark.parametrize(
    "changes",
    [
        {"flydsl_us": "nan"},
        {"gluon_us": "inf"},
        {"us": "-1"},
        {"flydsl_us": "0"},
        {"backend": "gluon"},  # its figures say FlyDSL
        {"us": "12345"},  # not the winner's figure
        {"_twice": 1},  # a second row of its key with another verdict
    ],
    ids=["nan", "inf", "negative", "zero", "contradicts-backend", "contradicts-us", "twice"],
)
@pytest.mark.slow_except("nan", "twice")
def test_an_impossible_cached_row_is_corrupt_warned_once_and_measured_again(cache_root, plugin_log, changes):
    _plant(**changes)
    plugin_log.clear()
    stock, flydsl = Arm(FAST), Arm(SLOW)  # measured now, the other way round
    router = make(stock, flydsl)
    router(*batch(2))
    assert router.spent > 0 and router.calls_taken == 0 and stock.calls > 1
    warnings = warnings_of(plugin_log)
    assert len(warnings) == 1 and "measured again" in warnings[0], warnings
    assert [r["backend"] for r in rows()] == ["gluon"]


def test_never_measures_in_capture_and_an_eager_call_decides_later(cache_root):
    capturing = [True]
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl, is_capturing=lambda: capturing[0])
    args = batch(2)
    router(*args)
    assert stock.calls == 1 and flydsl.calls == 0 and router.spent == 0  # stock's live call only
    assert router.verdicts == {} and router.routes == {}  # nothing memoised from capture
    capturing[0] = False
    router(*args)
    assert router.spent > 0 and router.calls_taken == 1


def test_once_vllm_serves_an_unmeasured_bucket_stays_stock_naming_tune(cache_root, plugin_log):
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl, hooks_=dataclasses.replace(hooks(), serving=lambda: True))
    router(*batch(2))
    assert router.spent == 0 and flydsl.calls == 0 and router.calls_delegated == 1
    lines = [r.getMessage() for r in plugin_log if r.levelname == "INFO"]
    assert any("tune --model" in line for line in lines), lines


def test_tune_off_keeps_unmeasured_buckets_on_stock(cache_root):
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl, tune=False)
    router(*batch(2))
    assert router.calls_delegated == 1 and flydsl.calls == 0 and stock.calls == 1
    assert not path().exists()


def test_no_table_chosen_keeps_flydsl_wherever_eligible(cache_root):
    stock, flydsl = Arm(SLOW), Arm(SLOW)
    router = make(stock, flydsl, tune=None)
    router(*batch(2))
    assert router.calls_taken == 1 and stock.calls == 0 and router.spent == 0


def test_a_measurement_that_raises_leaves_the_bucket_stock_with_one_warning(cache_root, plugin_log):
    router = make(Arm(FAST), Arm(FAST, fail=True))
    for _ in range(3):
        router(*batch(2))
    assert router.calls_taken == 0 and router.calls_delegated == 3
    warnings = warnings_of(plugin_log)
    assert len(warnings) == 1 and "planted failure" in warnings[0] and "stays stock" in warnings[0]
    assert not path().exists()


def test_a_failed_self_test_is_not_cached_and_the_next_process_tests_again(cache_root, plugin_log):
    """A FlyDSL that fails its self-test is stock until restart, and no cached row outlives the restart."""
    router = make(Arm(SLOW), Arm(FAST))
    router.self_test, router._self_test = True, lambda *a: "planted: the top-k disagrees"
    for _ in range(2):
        router(*batch(2))
    assert router.calls_taken == 0 and router.failed
    errors = [r.getMessage() for r in plugin_log if r.levelname == "ERROR"]
    assert len(errors) == 1 and "self-test failed" in errors[0] and "until vLLM restarts" in errors[0]
    assert not path().exists()
    restarted = make(Arm(SLOW), Arm(FAST))
    restarted(*batch(2))
    assert restarted.spent > 0 and restarted.calls_taken == 1


@pytest.mark.parametrize(("table_says", "cache_says"), [("gluon", "flydsl"), ("flydsl", "gluon")])
def test_a_table_row_outranks_this_nodes_cache(cache_root, table_says, cache_says):
    """The user's (or the built-in) table first; this node's cache or measurement only where no row covers
    the call."""
    key = measure.cache_key(torch.device("cpu"), GFX, CUS)
    us = {"flydsl": (5.0, 10.0, 5.0), "gluon": (10.0, 10.0, 20.0)}[cache_says]
    values = (GFX, CUS, 2, 1, 64, 128, 64, True, "256", cache_says, 0, 0, 0, *us)
    assert measure.write_cache(path(), key, [dict(zip(tuning.COLUMNS, values, strict=True))]) is None
    shape = (CUS, 1, 64, 128, 64)
    table = tuning.TunedTable("t.csv", GFX, shapes={shape: {2: [(table_says, 0)]}})
    stock, flydsl = Arm(FAST), Arm(FAST)
    router = make(stock, flydsl, table=table)
    router(*batch(2))
    assert router.calls_taken == (table_says == "flydsl") and router.spent == 0
    (route,) = router.routes.values()
    assert (route.reason or route.source).startswith("t.csv on gfx950"), route


def test_flydsl_must_beat_stock_by_the_margin():
    assert not measure.settle(0.98)
    assert measure.settle(1 / measure.MARGIN)
    assert measure.settle(0.96)
    assert not measure.settle(1.0) and not measure.settle(math.inf)


def test_a_round_is_the_geomean_over_contexts_and_the_verdict_the_median_round():
    # Two contexts: FlyDSL 4x faster at one, 2x slower at the other: geomean 1/sqrt(2) (min would say 1/4).
    rounds = [[[1.0, 0.25], [1.0, 2.0]] for _ in range(measure.ROUNDS)]
    stock, (ratio,) = measure.summarise(rounds)
    assert stock == pytest.approx(1.0) and ratio == pytest.approx(2**-0.5)
    # One lucky round among slower ones does not decide: the median does.
    noisy = [[[1.0, 0.1]]] + [[[1.0, 1.2]] for _ in range(measure.ROUNDS - 1)]
    assert measure.summarise(noisy)[1] == [pytest.approx(1.2)]
    # Stock's figure: its median round's geomean over contexts.
    assert measure.summarise([[[s, 1.0], [4 * s, 1.0]] for s in (1.0, 2.0, 3.0, 4.0, 50.0)])[
        0
    ] == pytest.approx(6.0)


def test_the_process_budget_accumulates_and_leaves_later_buckets_on_stock(cache_root, monkeypatch):
    monkeypatch.setattr(measure, "PROCESS_BUDGET_S", 1e-6)
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl)
    router(*batch(2))
    assert router.spent > 1e-6 and router.calls_taken == 1  # the first bucket spends it
    calls = stock.calls
    router(*batch(4))
    assert stock.calls == calls + 1 and router.calls_delegated == 1  # the next: stock's live call only


def test_the_first_call_decides_every_bucket_up_to_the_largest_decode_batch(cache_root):
    """Issue 49 item 4: a shape's first call (vLLM's warm-up decode step) measures every bucket this
    process can serve, so later batches of any bucket are decided without timing in a served step."""
    largest = random.choice((8, 13, 15))  # buckets 1, 2, 4 and 8 whatever the bound from 8 to 15
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl, hooks_=dataclasses.replace(hooks(), max_batch=lambda: largest))
    router(*batch(3))
    assert router.calls_taken == 1
    assert sorted(int(r["batch_size"]) for r in rows()) == [1, 2, 4, 8]
    assert all(r["backend"] == "flydsl" for r in rows())
    measured, spent = stock.calls, router.spent
    for n in (1, 6, 8, 7, 1):
        router(*batch(n))
    assert stock.calls == measured and router.spent == spent and router.calls_taken == 6  # none timed


def test_the_sweep_runs_once_per_shape_and_context_and_within_the_budget(cache_root, monkeypatch, plugin_log):
    """A bucket whose measurement raised is not measured again at every later first call; a new context is
    swept again; the process budget bounds the sweep as it bounds a single bucket."""
    monkeypatch.setattr(measure, "MAX_EXTRA_BYTES", 3 * 64 * 132 + 2 * 4 * 4)  # buckets 4 and 8 too large
    router = make(Arm(SLOW), Arm(FAST), hooks_=dataclasses.replace(hooks(), max_batch=lambda: 8))
    raised = lambda: sum("raised MemoryError" in w for w in warnings_of(plugin_log))  # noqa: E731
    router(*batch(2))
    assert raised() == 2 and sorted(int(r["batch_size"]) for r in rows()) == [1, 2]
    router(*batch(1)), router(*batch(3))
    assert raised() == 2 and router.calls_taken == 3
    router(*batch(2, max_model_len=192))
    assert raised() == 4 and sorted(r["context_len"] for r in rows()) == ["192", "192", "256", "256"]
    monkeypatch.setattr(measure, "PROCESS_BUDGET_S", 1e-6)
    router = make(Arm(SLOW), Arm(FAST), hooks_=dataclasses.replace(hooks(), max_batch=lambda: 2))
    router(*batch(1, max_model_len=128))
    assert [r["batch_size"] for r in rows() if r["context_len"] == "128"] == ["1"]  # the live bucket only


def test_the_measurement_draws_no_global_random_numbers(cache_root):
    args = batch(2)
    state = torch.get_rng_state()
    make(Arm(FAST), Arm(FAST))(*args)
    assert torch.equal(state, torch.get_rng_state())


def test_the_measured_line_and_cache_warnings_come_from_tp_rank_0_only(cache_root, plugin_log):
    path().parent.mkdir(parents=True, mode=0o700)
    path().write_text("garbage\n")
    rank1 = dataclasses.replace(hooks(), tp_group=lambda: (None, 1))
    make(Arm(SLOW), Arm(FAST), hooks_=rank1)(*batch(2))
    assert not [r for r in plugin_log if "measured" in r.getMessage() or "node cache" in r.getMessage()]
    make(Arm(SLOW), Arm(FAST))(*batch(4))
    assert [r for r in plugin_log if "measured" in r.getMessage()]


def test_the_cache_never_follows_a_link_and_the_write_is_atomic(cache_root):
    victim = cache_root / "victim.txt"
    victim.write_text("keep me\n")
    path().parent.mkdir(parents=True, mode=0o700)
    os.symlink(victim, path())
    make(Arm(SLOW), Arm(FAST))(*batch(2))
    assert victim.read_text() == "keep me\n"
    assert sorted(p.name for p in path().parent.iterdir() if p.name.endswith(".tmp")) == []
    key = measure.cache_key(torch.device("cpu"), GFX, CUS)
    row = dict(rows_of_one())
    assert measure.write_cache(path(), key, [row]) is None
    assert not os.path.islink(path()) and victim.read_text() == "keep me\n"
    assert [r["backend"] for r in rows()] == ["flydsl"]


def test_a_cache_file_that_is_a_link_is_never_read(cache_root):
    make(Arm(SLOW), Arm(FAST))(*batch(2))  # a valid row that says FlyDSL
    planted = cache_root / "planted.csv"
    os.replace(path(), planted)
    os.symlink(planted, path())
    router = make(Arm(FAST), Arm(SLOW))
    router(*batch(2))
    assert router.spent > 0 and router.calls_taken == 0  # measured, not read through the link
    assert not os.path.islink(path()) and rows()[0]["backend"] == "gluon"


def test_a_kernel_that_fails_its_self_test_is_never_timed_and_leaves_no_row(cache_root):
    """FlyDSL fails its self-test at the small problem: the shape has failed, so nothing is timed and the
    bucket is not cached: a restart tests it again."""
    router = make(Arm(SLOW), Arm(FAST))
    router.self_test = True
    router._self_test = lambda route, *a: "planted: the top-k disagrees"
    stock, flydsl = router.original, router.variant.fn
    router(*batch(2))
    assert router.spent == 0 and stock.calls == 1 and flydsl.calls == 0
    assert router.failed and not path().exists()


def test_a_self_test_problem_is_the_reason_even_where_the_shape_is_not_marked_failed(cache_root, plugin_log):
    """The measurement trusts the self-test's answer itself, not only ``router.failed``: the bucket's reason
    is the problem, nothing is timed and nothing raises (a raise there once left a TP peer waiting)."""
    router = make(Arm(SLOW), Arm(FAST))
    router._tested = lambda *a: "planted self-test failure"
    router(*batch(2))
    assert list(router.verdicts.values()) == ["planted self-test failure"] and router.spent == 0
    assert not [r.getMessage() for r in plugin_log if r.levelno >= logging.WARNING]


def rows_of_one():
    values = (GFX, CUS, 2, 1, 64, 128, 64, True, "256", "flydsl", 0, 0, 0, 10.0, 37.0, 10.0)
    return zip(tuning.COLUMNS, values, strict=True)


def test_a_cache_directory_others_can_write_is_refused_with_one_warning(cache_root, plugin_log):
    make(Arm(SLOW), Arm(FAST))(*batch(2))  # a valid row that says FlyDSL
    os.chmod(path().parent, 0o777)
    before = path().read_text()
    plugin_log.clear()
    stock, flydsl = Arm(FAST), Arm(SLOW)
    router = make(stock, flydsl)
    router(*batch(2))
    assert router.spent > 0 and router.calls_taken == 0  # not read: measured again, stock now
    assert path().read_text() == before  # nor written
    warnings = warnings_of(plugin_log)
    assert len(warnings) == 1 and "only it can write" in warnings[0], warnings


@pytest.mark.parametrize("backend", ["gluon", "flydsl"])
@pytest.mark.parametrize("edge", [-5e-4, 0.0, 5e-4])
def test_a_measurement_at_the_margins_edge_is_written_and_read_whichever_verdict_it_gave(
    cache_root, backend, edge
):
    """FlyDSL's time over stock's within rounding of ``1 / MARGIN``: a close measurement may have gone either
    way, and its row is neither refused on write nor read as corrupt (a CPU run once measured 0.97128,
    ``gluon``, and the row was refused, so every start measured the bucket again)."""
    gluon = 1000 + 600 * random.random()
    flydsl = gluon * (1 + edge) / measure.MARGIN
    us = gluon if backend == "gluon" else flydsl
    values = (
        GFX,
        CUS,
        2,
        1,
        64,
        128,
        64,
        True,
        "256",
        backend,
        0,
        0,
        0,
        round(us, 4),
        round(gluon, 4),
        round(flydsl, 4),
    )
    row = dict(zip(tuning.COLUMNS, values, strict=True))
    key = measure.cache_key(torch.device("cpu"), GFX, CUS)
    assert measure.write_cache(path(), key, [row]) is None
    found, problems = measure.load_cache(path(), key, GFX, CUS)
    assert problems == [] and [r["backend"] for r in found.values()] == [backend]
    # Past rounding, the figures decide: the other verdict is corrupt.
    far = dict(row, flydsl_us=str(round(gluon * (1.01 if backend == "flydsl" else 0.9) / measure.MARGIN, 4)))
    far["us"] = far["flydsl_us"] if backend == "flydsl" else far["us"]
    assert "say otherwise" in measure.write_cache(path(), key, [far])


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary(cache_root, monkeypatch):
    key = measure.cache_key(torch.device("cpu"), GFX, CUS)
    assert measure.write_cache(path(), key, [dict(rows_of_one())]) is None
    before = path().read_bytes()

    def broken(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(measure.os, "replace", broken)
    row = dict(rows_of_one(), batch_size=4)
    assert "No space left" in measure.write_cache(path(), key, [row])
    assert path().read_bytes() == before and sorted(p.name for p in path().parent.iterdir()) == [path().name]


def test_aiters_gfx950_entry_beside_the_general_kernel_is_never_launched(cache_root, aiter_as, aiter_calls):
    """Two unreleased aiter revisions export ``flydsl_fp8_paged_mqa_logits_gfx950`` beside the general
    kernel; the plugin measures and launches the general kernel alone (measure.CACHE_FORMAT 3)."""
    aiter_as(flydsl="general+entry")
    from vllm_flydsl_indexer.kernels import find_kernel

    variant, _ = find_kernel()
    assert variant.name == "general" and "gfx950" not in variant.fn.__module__, variant
    router = FlyDSLRouter(Arm(0.2), variant, hooks(), LOGGER, self_test=False, tune=True, gfx=GFX)
    out = router(*as_args(_problem([50, 60])))
    assert router.calls_taken == 1 and torch.isfinite(out[:, :50]).any(), router.verdicts
    assert {name for name, _ in aiter_calls} == {"flydsl"}, aiter_calls


def test_a_problem_over_the_memory_cap_is_not_built_and_stays_stock(cache_root, monkeypatch, plugin_log):
    """At most MAX_EXTRA_BYTES beyond vLLM's own (q, weights and block tables; the logits are vLLM's
    workspace): a bucket whose timing problem needs more is refused before anything is allocated."""
    monkeypatch.setattr(measure, "MAX_EXTRA_BYTES", 2 * 64 * (128 + 4) - 1)  # below batch 2's q and weights
    stock, flydsl = Arm(SLOW), Arm(FAST)
    router = make(stock, flydsl)
    router(*batch(2))
    assert router.calls_delegated == 1 and flydsl.calls == 0 and stock.calls == 1
    (warning,) = warnings_of(plugin_log)
    assert "MemoryError" in warning and "stays stock" in warning


TP_SCRIPT = textwrap.dedent(
    """
    import dataclasses, datetime, json, os, sys, time
    sys.path.insert(0, {tests!r})
    import torch, torch.distributed as dist
    from conftest import LOGGER, general_variant, hooks
    from vllm_flydsl_indexer import measure
    from vllm_flydsl_indexer.router import FlyDSLRouter
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    rank, case = int(sys.argv[1]), sys.argv[2]
    os.environ["VLLM_CACHE_ROOT"] = os.path.join({cache!r}, str(rank))  # a node each
    dist.init_process_group("gloo", init_method="file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    measure.AGREE_TIMEOUT_S = 20.0

    class Arm:
        def __init__(self, delay, fail=False):
            self.delay, self.fail = delay, fail
        def __call__(self, *a, **k):
            if self.fail:
                raise RuntimeError("planted failure on rank %d" % rank)
            time.sleep(self.delay)
            return torch.zeros(1)

    flydsl, tune, test = Arm({fast}), True, False
    if case == "both-close":  # FlyDSL 1.6x faster on each rank: MAX takes it, a SUM of ratios would not
        flydsl = Arm({slow} / 1.6)
    if rank == 1 and case == "budget":
        measure.PROCESS_BUDGET_S = 0.0
    if rank == 1 and case == "raise":
        flydsl = Arm({fast}, fail=True)
    if rank == 1 and case in ("slower-than-cache", "slow"):
        flydsl = Arm(3 * {slow})
    if rank == 1 and case == "tune-off":
        tune = False
    if rank == 1 and case == "cache-oserror":
        measure.load_cache = lambda *a: (_ for _ in ()).throw(OSError(116, "Stale file handle"))
    if rank == 0 and case == "slower-than-cache":  # this node's cache says FlyDSL 2x faster
        key = measure.cache_key(torch.device("cpu"), "gfx950", 1)
        values = ("gfx950", 1, 2, 1, 64, 128, 64, True, "256", "flydsl", 0, 0, 0, 5.0, 10.0, 5.0)
        rows = [dict(zip(measure.tuning.COLUMNS, values[:2] + (b,) + values[3:])) for b in (2, 4)]
        assert measure.write_cache(measure.cache_path("gfx950", 1, key), key, rows) is None
    if case == "absent":  # rank 1 never reaches the agreement: rank 0 gives up after AGREE_TIMEOUT_S
        measure.AGREE_TIMEOUT_S = 2.0
        if rank == 1:
            time.sleep(30)
            os._exit(0)
    h = dataclasses.replace(hooks(), tp_group=lambda: (dist.group.WORLD, rank))
    if case.startswith("sweep"):  # the first call measures buckets 2, 1 and 4 (sweep-cut: rank 1 only 2)
        h = dataclasses.replace(h, max_batch=lambda: 5)
        measure.PROCESS_BUDGET_S = 1e-6 if rank == 1 and case == "sweep-cut" else 30.0
    router = FlyDSLRouter(Arm({slow}), general_variant(flydsl), h, LOGGER, self_test=False, tune=tune)
    if rank == 1 and case == "selftest":
        router._tested = lambda *a: "planted self-test failure"
    arms, began = [], time.monotonic()
    for batch in (2, 2, 5, 3, 4):
        p = make_paged_problem([60] * batch, next_n=1, heads=64, head_dim=128, block_size=64, preshuffle=True,
                               max_model_len=256)
        taken = router.calls_taken
        router(p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, p.max_model_len)
        arms.append("flydsl" if router.calls_taken > taken else "stock")
    if case == "absent":
        print(json.dumps({{"arms": arms, "after": 3.0, "seconds": time.monotonic() - began}}), flush=True)
        os._exit(0)
    after = torch.tensor([rank + 1.0])
    dist.all_reduce(after, group=dist.group.WORLD)  # the group still answers
    print(json.dumps({{"arms": arms, "after": after.item(), "seconds": round(time.monotonic() - began, 2)}}))
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("none", "flydsl"),
        ("raise", "stock"),
        ("slow", "stock"),
        ("tune-off", "stock"),
        ("slower-than-cache", "stock"),
        ("cache-oserror", "stock"),
        ("selftest", "stock"),
        ("budget", "stock"),
        ("both-close", "flydsl"),
        ("sweep", "flydsl"),
        ("sweep-cut", ["flydsl", "flydsl", "stock", "flydsl", "stock"]),  # batches 2, 2, 5, 3, 4
    ],
)
@pytest.mark.slow_except("both-close", "slower-than-cache")
def test_two_tp_ranks_agree_at_every_call_and_none_hangs(tmp_path, case, expected):
    """Two processes over gloo, a node each: one verdict for both at every call; the slowest rank counts (a
    cache never outvotes a slower measurement); a rank that raises, is off or fails its self-test keeps the
    group on stock, as does a bucket one rank's sweep (the first call's buckets up to the largest batch)
    left unmeasured; each finishes in seconds and the group answers one more collective."""
    import json
    import subprocess
    import sys

    code = TP_SCRIPT.format(
        tests=str(TESTS), store=str(tmp_path / "store"), cache=str(tmp_path), fast=FAST, slow=SLOW
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(rank), case], env=simulation_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    expected = expected if isinstance(expected, list) else [expected] * 5
    assert results[0]["arms"] == results[1]["arms"] == expected, results
    assert results[0]["after"] == results[1]["after"] == 3.0
    print(f"{case}: the five calls took {max(r['seconds'] for r in results)} s on the slower rank")


def test_a_rank_that_never_reaches_the_agreement_is_given_up_on(tmp_path):
    """Rank 1 never calls (stuck, or gone): rank 0 waits AGREE_TIMEOUT_S (2 s here) once, keeps stock with
    one WARNING and never waits again; it is done while rank 1 still sleeps."""
    import json
    import subprocess
    import sys

    code = TP_SCRIPT.format(
        tests=str(TESTS), store=str(tmp_path / "store"), cache=str(tmp_path), fast=FAST, slow=SLOW
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(rank), "absent"], env=simulation_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        out, err = procs[0].communicate(timeout=120)
        assert procs[1].poll() is None, "rank 1 woke up first: rank 0 waited on it"
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["arms"] == ["stock"] * 5, result
    warnings = [line for line in err.splitlines() if "agreement failed" in line]
    assert len(warnings) == 1 and "timed out" in warnings[0], err[-3000:]
