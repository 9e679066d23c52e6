# SPDX-License-Identifier: Apache-2.0
"""Verify-on-enable canary through real vLLM 0.33.0, with correct and broken doubles.

The self-test is off here (it would catch the broken doubles first): these tests are the canary's.
"""

from __future__ import annotations

import logging

import pytest
import torch

from test_agreement import call
from vllm_flydsl_indexer import envs
from vllm_flydsl_indexer.selftest import compare_in_windows, read_window_ends
from vllm_flydsl_indexer.tools.reference import make_paged_problem


@pytest.fixture
def verified(target, monkeypatch, fresh_register, plugin_log):
    from vllm_flydsl_indexer import patch

    monkeypatch.setenv(envs.SWITCH, "1")
    monkeypatch.setenv(envs.VERIFY, "1")
    monkeypatch.setenv(envs.SELFTEST, "0")
    fresh_register()
    assert "verify-on-enable on" in plugin_log[0].getMessage()
    return patch.installed()


def problems(n):
    return [
        make_paged_problem(
            [257, 31, 0, 64],
            next_n=2,
            heads=64,
            head_dim=128,
            block_size=64,
            preshuffle=True,
            generator=torch.Generator().manual_seed(100 + i),
        )
        for i in range(n)
    ]


def test_correct_kernel_passes_then_costs_nothing(target, workspace, verified, aiter_calls, plugin_log):
    p1, p2, p3 = problems(3)
    out = call(target.rocm_fp8_paged_mqa_logits, p1, 1)
    assert [a for a, _ in aiter_calls] == ["gluon", "flydsl"]
    assert any("canary passed" in r.getMessage() for r in plugin_log)
    stock = call(verified.original, p1, 1)
    ends = read_window_ends(p1.context_lens, 8, 2)
    assert compare_in_windows(stock, out, ends).ok(0)
    aiter_calls.clear()
    call(target.rocm_fp8_paged_mqa_logits, p2, 1)
    call(target.rocm_fp8_paged_mqa_logits, p3, 1)
    assert [a for a, _ in aiter_calls] == ["flydsl", "flydsl"], "canary ran again"


def test_canary_checks_the_first_call_of_every_configuration(
    target, workspace, verified, aiter_calls, plugin_log
):
    """next_n 1 after next_n 2: a second configuration gets its own canary, once."""
    (p2,) = problems(1)
    p1 = make_paged_problem(
        [100, 7, 64], next_n=1, heads=64, head_dim=128, block_size=64, preshuffle=True, per_row_bounds=False
    )
    for p in (p2, p1, p1, p2):
        call(target.rocm_fp8_paged_mqa_logits, p, 1)
    assert [a for a, _ in aiter_calls] == ["gluon", "flydsl", "gluon", "flydsl", "flydsl", "flydsl"]
    passed = [r.getMessage() for r in plugin_log if "canary passed" in r.getMessage()]
    assert len(passed) == 2 and "next_n=2" in passed[0] and "next_n=1" in passed[1], passed


def test_canary_compares_a_few_mb_of_rows_whatever_max_model_len():
    """Whole sequences, spread from the first to the last, as many as fit in CANARY_BYTES."""
    from vllm_flydsl_indexer.router import CANARY_BYTES, canary_sequences

    assert canary_sequences(64, 1, 163840) == [0, 13, 25, 38, 50, 63]  # six 640 KiB rows fit in 4 MiB
    assert canary_sequences(64, 2, 163840) == [0, 32, 63]
    assert canary_sequences(64, 8, 163840) == [0]  # at least one whole sequence
    assert canary_sequences(3, 1, 1024) == [0, 1, 2]
    for batch, next_n, width in ((512, 1, 163840), (256, 2, 163840), (64, 4, 8192), (1, 1, 10**6)):
        rows = len(canary_sequences(batch, next_n, width)) * next_n
        assert rows == next_n or rows * width * 4 <= CANARY_BYTES


def test_wrong_kernel_is_caught_and_process_falls_back(
    target, workspace, verified, aiter_calls, plugin_log, monkeypatch
):
    import aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits as fly

    monkeypatch.setattr(fly, "BROKEN", True)
    p1, p2 = problems(2)
    out = call(target.rocm_fp8_paged_mqa_logits, p1, 1)
    errors = [r.getMessage() for r in plugin_log if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "DISAGREE" in errors[0] and "max rel diff" in errors[0]
    assert "heads=64 head_dim=128 KVBlockSize=64 next_n=2" in errors[0]
    # The call that caught it still returns the stock answer.
    aiter_calls.clear()
    stock = call(verified.original, p1, 1)
    ends = read_window_ends(p1.context_lens, 8, 2)
    assert compare_in_windows(stock, out, ends).ok(0)
    # Every later call of that configuration goes to the stock path.
    aiter_calls.clear()
    call(target.rocm_fp8_paged_mqa_logits, p2, 1)
    assert [a for a, _ in aiter_calls] == ["gluon"]
    assert len(verified.router.failed) == 1


def test_canary_sees_a_column_the_kernel_never_writes(
    target, workspace, verified, aiter_calls, plugin_log, monkeypatch
):
    """FlyDSL runs into a NaN-filled buffer, not over stock's answer, so a missing column shows."""
    import aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits as fly

    monkeypatch.setattr(fly, "SHORT_BY_ONE", True)
    (p1,) = problems(1)
    out = call(target.rocm_fp8_paged_mqa_logits, p1, 1)
    # Only sampled rows of stock's answer were kept: on disagreement stock runs again for the answer.
    assert [a for a, _ in aiter_calls] == ["gluon", "flydsl", "gluon"]
    errors = [r.getMessage() for r in plugin_log if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "DISAGREE" in errors[0] and "NaN or unwritten" in errors[0], errors
    stock = call(verified.original, p1, 1)
    ends = read_window_ends(p1.context_lens, 8, 2)
    assert compare_in_windows(stock, out, ends).ok(0), "the canary call must return stock's answer"
    assert len(verified.router.failed) == 1
