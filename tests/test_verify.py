# SPDX-License-Identifier: Apache-2.0
"""Verify-on-enable canary through real vLLM 0.33.0, with correct and broken doubles."""

from __future__ import annotations

import logging

import pytest
import torch

from test_agreement import call
from vllm_flydsl_indexer import envs
from vllm_flydsl_indexer.agreement import compare_in_windows, read_window_ends
from vllm_flydsl_indexer.tools.reference import make_paged_problem


@pytest.fixture
def verified(target, monkeypatch, fresh_register, plugin_log):
    from vllm_flydsl_indexer import patch

    monkeypatch.setenv(envs.SWITCH, "1")
    monkeypatch.setenv(envs.VERIFY, "1")
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
    assert verified.router.verifier is None


def test_wrong_kernel_is_caught_and_process_falls_back(
    target, workspace, verified, aiter_calls, plugin_log, monkeypatch
):
    import aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits as fly

    monkeypatch.setattr(fly, "BROKEN", True)
    p1, p2 = problems(2)
    out = call(target.rocm_fp8_paged_mqa_logits, p1, 1)
    errors = [r.getMessage() for r in plugin_log if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "DISAGREE" in errors[0] and "max rel diff" in errors[0]
    # The call that caught it still returns the stock answer.
    aiter_calls.clear()
    stock = call(verified.original, p1, 1)
    assert torch.equal(out.nan_to_num(), stock.nan_to_num())
    # Every later call goes to the stock path.
    aiter_calls.clear()
    call(target.rocm_fp8_paged_mqa_logits, p2, 1)
    assert [a for a, _ in aiter_calls] == ["gluon"]
    assert verified.router.disabled_reason is not None


def test_canary_sees_a_column_the_kernel_never_writes(
    target, workspace, verified, aiter_calls, plugin_log, monkeypatch
):
    """FlyDSL runs into a NaN-filled buffer, not over stock's answer, so a missing column shows."""
    import aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits as fly

    monkeypatch.setattr(fly, "SHORT_BY_ONE", True)
    (p1,) = problems(1)
    out = call(target.rocm_fp8_paged_mqa_logits, p1, 1)
    assert [a for a, _ in aiter_calls] == ["gluon", "flydsl"]
    errors = [r.getMessage() for r in plugin_log if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "DISAGREE" in errors[0] and "NaN or unwritten" in errors[0], errors
    stock = call(verified.original, p1, 1)
    ends = read_window_ends(p1.context_lens, 8, 2)
    assert compare_in_windows(stock, out, ends).ok(0), "the canary call must return stock's answer"
    assert verified.router.disabled_reason is not None
