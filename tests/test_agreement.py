# SPDX-License-Identifier: Apache-2.0
"""Randomised agreement between the arms through real vLLM 0.33.0's function.

The stock arm is vLLM's unpatched ``rocm_fp8_paged_mqa_logits`` (driving the
Gluon-contract double); the FlyDSL arm is the same call after ``register()``.
The shared workspace buffer is poisoned with NaN before every call, so any
column a consumer reads that FlyDSL did not write shows up.
"""

from __future__ import annotations

import importlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import import_call_site
from vllm_flydsl_indexer.selftest import read_window_ends
from vllm_flydsl_indexer.target import TARGET_MODULE
from vllm_flydsl_indexer.tools.audit import CALL_SITES
from vllm_flydsl_indexer.tools.harness import compare_in_windows
from vllm_flydsl_indexer.tools.paths import call_site_in
from vllm_flydsl_indexer.tools.reference import make_paged_problem


def poison_workspace(rows: int, max_model_len: int) -> None:
    from vllm.v1.worker.workspace import current_workspace_manager

    (buf,) = current_workspace_manager().get_simultaneous(((rows, max_model_len), torch.float32))
    buf.fill_(float("nan"))


def call(fn, problem, compress_ratio, caller=TARGET_MODULE):
    """``fn`` on ``problem``, called from code living in module ``caller`` (as that call site does)."""
    rows = problem.batch * problem.next_n
    poison_workspace(rows, problem.max_model_len)
    args = problem.call_args()
    out = call_site_in(importlib.import_module(caller))(fn, args, {"compress_ratio": compress_ratio})
    return out.clone()


# Call sites whose next_n > 1 calls may be taken, written out here (not read from the audit).
MULTI_ROW_CALLERS = {TARGET_MODULE, "vllm.models.deepseek_v41.amd.ops.sparse_indexer"}
# The call sites this vLLM has (0.32.0 lacks some), then one module that is not a call site.
CALLERS = [c for c in sorted(CALL_SITES) if import_call_site(c) is not None] + [
    "vllm.model_executor.layers.sparse_attn_indexer"
]


def expected_to_take(next_n, per_row, compress_ratio, block_size, caller):
    if compress_ratio == 4 and block_size > 1:
        return False  # vLLM's own C4A route
    if next_n == 1:
        return True
    return per_row and compress_ratio == 1 and caller in MULTI_ROW_CALLERS


@st.composite
def problems(draw):
    # Most draws are the shapes vLLM builds (next_n 1 or 2 with a per-row table), so eligible
    # next_n > 1 calls are common; the rest probe what the rules must refuse.
    next_n = draw(st.sampled_from([1, 2, 2, 2, 3, 4]))
    batch = draw(st.integers(1, 5))
    block_size = draw(st.sampled_from([1, 16, 64]))
    compress_ratio = draw(st.sampled_from([1, 2, 4]))
    if compress_ratio == 4 and block_size == 64:
        compress_ratio = draw(st.sampled_from([1, 2]))  # C4A Triton: not runnable on CPU
    heads = draw(st.sampled_from([32, 64]))
    # Padding rows (0), lengths shorter than next_n, and longer contexts.
    lens = draw(
        st.lists(
            st.one_of(st.just(0), st.integers(1, 4), st.integers(5, 300)), min_size=batch, max_size=batch
        )
    )
    per_row = draw(st.sampled_from([True, True, True, False]))
    caller = draw(st.sampled_from(CALLERS + [TARGET_MODULE] * 3))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(
        next_n=next_n,
        block_size=block_size,
        compress_ratio=compress_ratio,
        heads=heads,
        lens=lens,
        per_row=per_row,
        caller=caller,
        seed=seed,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=problems())
def test_arms_agree_on_every_read_column(target, workspace, installed, aiter_calls, case):
    problem = make_paged_problem(
        case["lens"],
        next_n=case["next_n"],
        heads=case["heads"],
        head_dim=128,
        block_size=case["block_size"],
        preshuffle=case["block_size"] > 1,
        per_row_bounds=case["per_row"],
        compress_ratio=case["compress_ratio"],
        max_model_len=max(case["lens"]) + 64,
        generator=torch.Generator().manual_seed(case["seed"]),
    )
    ratio = case["compress_ratio"]
    aiter_calls.clear()
    stock = call(installed.original, problem, ratio)
    stock_arms = [name for name, _ in aiter_calls]
    aiter_calls.clear()
    tested = len(installed.router.self_tests)
    patched = call(target.rocm_fp8_paged_mqa_logits, problem, ratio, case["caller"])
    patched_arms = [name for name, _ in aiter_calls]

    takes = expected_to_take(case["next_n"], case["per_row"], ratio, case["block_size"], case["caller"])
    if ratio == 4 and case["block_size"] > 1:
        # vLLM's C4A route (torch fallback at this block size): untouched, identical.
        assert stock_arms == [] and patched_arms == []
        assert torch.equal(stock.nan_to_num(), patched.nan_to_num())
        return
    else:
        assert stock_arms == ["gluon"]
        # A configuration's first taken call runs its self-test (stock, FlyDSL) before it.
        self_test = ["gluon", "flydsl"] if len(installed.router.self_tests) > tested else []
        assert patched_arms == ([*self_test, "flydsl"] if takes else ["gluon"])

    rows = problem.batch * problem.next_n
    ends = read_window_ends(problem.context_lens, rows, problem.next_n)
    result = compare_in_windows(stock, patched, ends, topk=64)
    assert result.nan_free, "a read column was never written"
    assert result.mask_equal and result.topk_equal, result.describe()
    assert result.max_rel_diff == 0.0, result.describe()
    # Every read column holds exactly the stock value (-inf included).
    cols = torch.arange(problem.max_model_len).view(1, -1)
    inside = cols < ends.view(-1, 1)
    assert torch.equal(stock[inside], patched[inside])


def test_native_mtp_calls_are_taken_with_fly_dsl_defaults(target, workspace, installed, aiter_calls):
    problem = make_paged_problem(
        [300, 2, 0, 129],
        next_n=2,
        heads=64,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    call(target.rocm_fp8_paged_mqa_logits, problem, 1)
    launch = (
        "flydsl",
        {
            "Preshuffle": True,
            "KVBlockSize": 64,
            "ChunkK": 128,
            "SplitKV": None,
            "WavePerEU": 2,
            "variant": None,
        },
    )
    # The configuration's self-test (stock, then FlyDSL launched as the call is), then the call.
    assert aiter_calls == [aiter_calls[0], launch, launch] and aiter_calls[0][0] == "gluon"


def test_flydsl_leaves_columns_past_the_window_untouched(target, workspace, installed):
    """No -inf prefill and no sanitize pass: the adapter writes only FlyDSL's window."""
    problem = make_paged_problem(
        [50, 7],
        next_n=2,
        heads=32,
        head_dim=128,
        block_size=16,
        preshuffle=True,
        max_model_len=128,
        generator=torch.Generator().manual_seed(2),
    )
    # A workspace already larger than the self-test's problem needs (as after vLLM's profiling run):
    # the first call's self-test borrows its front and puts its bytes back, so the NaN stays.
    poison_workspace(64, 1024)
    out = call(target.rocm_fp8_paged_mqa_logits, problem, 1)
    ends = read_window_ends(problem.context_lens, 4, 2)
    for r, end in enumerate(ends.tolist()):
        assert not torch.isnan(out[r, :end]).any()
        assert torch.isnan(out[r, end:]).all(), "a column past the window was written"


def test_a_nan_inside_a_read_window_fails_the_rule_and_one_outside_does_not():
    gen = torch.Generator().manual_seed(11)
    expected = torch.randn(4, 40, generator=gen)
    ends = torch.tensor([40, 17, 0, 5])
    assert compare_in_windows(expected, expected.clone(), ends).ok(0)
    outside = expected.clone()
    outside[1, 30] = float("nan")  # past row 1's window: nobody reads it
    assert compare_in_windows(expected, outside, ends).ok(0)
    inside = expected.clone()
    inside[3, 4] = float("nan")  # the last column row 3 reads
    result = compare_in_windows(expected, inside, ends)
    assert not result.nan_free and not result.ok(1e-3)


def test_one_neg_inf_column_inside_a_read_window_fails_the_rule_by_its_mask():
    """Only the ``-inf`` mask gives it away: the column is below the top-k and nothing else differs."""
    gen = torch.Generator().manual_seed(12)
    expected = torch.randn(3, 32, generator=gen)
    ends = torch.tensor([32, 20, 9])
    masked = expected.clone()
    col = int(expected[1, :20].argmin())  # the smallest value row 1 reads: never in its top-2
    masked[1, col] = float("-inf")
    result = compare_in_windows(expected, masked, ends, topk=2)
    assert result.topk_equal and result.nan_free and result.within(0)
    assert not result.mask_equal and not result.ok(0)
    assert "-inf mask differs" in result.describe() or "mask" in result.describe()
    # The same -inf past row 1's window is read by nobody.
    outside = expected.clone()
    outside[1, 25] = float("-inf")
    assert compare_in_windows(expected, outside, ends, topk=2).ok(0)
