# SPDX-License-Identifier: Apache-2.0
"""``check``'s per-API reference contracts (issue 26): pinned to the doubles and identification."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from vllm_flydsl_indexer import kernels as identification
from vllm_flydsl_indexer import tuning
from vllm_flydsl_indexer.tools import behaviour
from vllm_flydsl_indexer.tools.arms import (
    Workspace,
    contract_limits,
    mirror_hooks,
    reference_arms,
    stock_call,
    variant_order,
)
from vllm_flydsl_indexer.tools.cases import INDEXER
from vllm_flydsl_indexer.tools.harness import compare_in_windows, with_once
from vllm_flydsl_indexer.tools.reference import VARIANT_CONTRACTS, expected_split_kv

LOGGER = logging.getLogger("test_check_variants")


@pytest.mark.parametrize("contract", VARIANT_CONTRACTS, ids=lambda c: c.name)
def test_reference_contracts_match_what_identification_reads_from_the_doubles(contract, aiter_as):
    aiter_as(flydsl=contract.name)
    found, _ = identification.find_kernel()
    assert found is not None and found.name == contract.name
    limits = contract_limits(contract)
    assert {name: getattr(found, name) for name in limits} == limits
    assert found.split_kv_workgroups_per_cu == contract.split_kv_wg_per_cu


def test_the_found_api_runs_first():
    assert [c.name for c in variant_order("gfx950")] == ["gfx950", "general"]
    assert [c.name for c in variant_order(None)] == ["general", "gfx950"]
    assert [c.name for c in variant_order("dispatcher")] == ["general", "gfx950"]


def test_aiter_columns_are_the_plugins_and_the_table_never_crashes():
    assert behaviour.AITER_COLUMNS == tuning.COLUMNS
    table = behaviour.tuned_table(1, 32, 128)
    assert table.choice(1, 1, 1, 32, 128, 64)[2] == 2  # wg_per_cu
    assert table.choice(1, 2, 1, 32, 128, 64)[0] == "flydsl"  # the other gfx's row is not read
    assert table.choice(1, 2, 2, 32, 128, 64)[0] == "gluon"


def test_expected_split_kv_is_aiters_rule():
    assert expected_split_kv(256, 4, 8192, 64, 3) == 128  # min(pages 128, ceil(768 / 4) = 192)
    assert expected_split_kv(256, 512, 8192, 64, 3) == 2
    assert expected_split_kv(1, 2, 256, 64, 3) == 2


@pytest.mark.parametrize("flydsl", ["general", "gfx950"])
def test_nothing_is_launched_on_a_strided_cache(flydsl, aiter_as, aiter_calls):
    """Counted at the kernel: the earlier gfx950 double copies a strided cache and never raises."""
    from vllm_flydsl_indexer.router import FlyDSLRouter

    aiter_as(flydsl=flydsl)
    variant, _ = identification.find_kernel()
    launches = []

    def counted(*args, **kwargs):
        launches.append(1)
        return variant.fn(*args, **kwargs)

    problems = behaviour.Problems(32, 128, torch.device("cpu"), 0)
    contiguous = problems.get(behaviour.Step(2, 64, behaviour.FLYDSL, 1))
    strided = problems.get(behaviour.Step(2, 64, behaviour.STOCK, 0, form="strided"))
    assert not strided.kv_cache.is_contiguous() and strided.kv_cache.shape == contiguous.kv_cache.shape
    workspace = Workspace(8, behaviour.CONTEXT_LEN, torch.device("cpu"))
    stock = stock_call(reference_arms().gluon, workspace)
    router = FlyDSLRouter(
        stock, dataclasses.replace(variant, fn=counted), mirror_hooks(workspace), with_once(LOGGER)
    )
    router.call_from(INDEXER, *contiguous.call_args())
    # The shape's self-test (FlyDSL at SplitKV 1 and at the largest reachable where the API takes
    # SplitKV, else once), then the call.
    first = 2 if variant.split_kv_workgroups_per_cu is None else 3
    assert len(launches) == first and router.calls_taken == 1
    before = len(aiter_calls)
    out = router.call_from(INDEXER, *strided.call_args()).clone()
    assert len(launches) == first and len(aiter_calls) == before and router.calls_taken == 1
    assert not router.failed
    assert torch.equal(out.nan_to_num(), stock(*strided.call_args()).nan_to_num())


def test_the_mask_comparison_sees_one_minus_inf_column():
    """Pinned as the NaN check is: one -inf column inside a window, every value else equal."""
    expected, actual, ends = behaviour._pair("-inf")
    result = compare_in_windows(expected, actual, ends)
    assert not result.mask_equal and not result.ok(1e-3)
    # The top-k sets alone do not see it (the -inf entry ranks last), so the mask must.
    assert result.topk_equal and result.nan_free and result.within(0)


def test_agreement_self_test_names_each_disagreement():
    results = behaviour.agreement_self_test(2048)
    assert [r.ok for r in results] == [True, True, True]
    assert [r.part for r in results] == ["NaN read", "-inf mask DIFFERENT", "rel diff above the rule"]


@pytest.mark.slow
def test_check_puts_the_found_api_first(aiter_as, target, workspace, capsys):
    from tests.test_check import SMALL, run_check

    aiter_as(flydsl="gfx950")
    rc, out = run_check(capsys, SMALL)
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("scope:   reference contracts")
    assert lines[1].startswith("found:   the gfx950 (") and "its cases come first" in lines[1]
    assert "model and bounds cases, as the gfx950 API (its reference contract)" in out
    assert "\nas the gfx950 API (found)\n" in out
    assert out.index("as the gfx950 API (found)") < out.index("\nas the general API\n")
    assert "gfx950-early" not in out  # refused as an unsupported revision: no section of its own
    assert lines[-1] == "60 passed, 0 failed (reference contracts, not the real kernels)"


@pytest.mark.slow
def test_check_passes_on_a_device_with_many_cus(monkeypatch, target, workspace, capsys):
    """On a GPU the CU count is not 1 (132 on an H200, 256 on an MI355X): every expected SplitKV
    must use the CUs of the device the call's own tensors are on, as the router does (a shapes-only
    case on meta tensors sees 1). Found on an H200, where the pool case expected the GPU's count."""
    from vllm_flydsl_indexer import kernels
    from vllm_flydsl_indexer.tools import cli

    monkeypatch.setattr(kernels, "_cu_count", lambda kind, index: 132 if kind == "cpu" else 1)
    rc = cli.main(["check", "--batch", "4", "--context-len", "320", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, [line for line in out.splitlines() if line.startswith("FAIL")]
    assert out.splitlines()[-1].startswith("60 passed, 0 failed")
