# SPDX-License-Identifier: Apache-2.0
"""``reference.py`` against code this project did not write: vLLM's own torch implementation.

``fp8_paged_mqa_logits_torch`` (``vllm/v1/attention/ops/rocm_aiter_mla_sparse.py``)
is vLLM's eager fallback for the same call: next_n 1, block-flat cache, ``-inf``
everywhere outside ``[0, seq_len)``. Both write contracts of the reference must
match it inside every row's window, and the FlyDSL contract must write exactly
that window.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from vllm_flydsl_indexer.tools import reference as ref

POISON = 7.25


def vllm_torch_logits():
    module = pytest.importorskip("vllm.v1.attention.ops.rocm_aiter_mla_sparse")
    fn = getattr(module, "fp8_paged_mqa_logits_torch", None)
    if fn is None:
        pytest.skip("this vLLM has no fp8_paged_mqa_logits_torch")
    if module.FP8_DTYPE != torch.float8_e4m3fn:
        pytest.skip(f"vLLM's fp8 dtype here is {module.FP8_DTYPE}, the cache is e4m3fn")
    return fn


def lengths(kvb: int, gen: torch.Generator) -> list[int]:
    """0, 1, block edges either side, and random lengths."""
    edges = [0, 1, kvb, kvb + 1, 2 * kvb - 1, 2 * kvb, 3 * kvb + 1]
    return edges + torch.randint(1, 4 * kvb + 9, (3,), generator=gen).tolist()


LAYOUTS = [(1, False), (16, False), (64, False), (16, True), (64, True)]


@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("kvb,preshuffle", LAYOUTS)
def test_reference_matches_vllms_torch_implementation(heads, kvb, preshuffle):
    """vLLM 0.34.0's fallback reads the preshuffled cache (``shuffled=``); earlier ones only the flat one."""
    oracle = vllm_torch_logits()
    takes_layout = "shuffled" in inspect.signature(oracle).parameters
    if preshuffle and not takes_layout:
        pytest.skip("this vLLM's fp8_paged_mqa_logits_torch reads only the flat cache layout (no shuffled=)")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    seq_lens = lengths(kvb, gen)
    problem = ref.make_paged_problem(
        seq_lens, next_n=1, heads=heads, head_dim=128, block_size=kvb, preshuffle=preshuffle, generator=gen
    )
    mml = problem.max_model_len
    layout = {"shuffled": preshuffle} if takes_layout else {}
    expected = oracle(
        problem.q_fp8,
        problem.kv_cache,
        problem.weights,
        problem.context_lens,
        problem.block_tables,
        mml,
        **layout,
    )
    lens = torch.tensor(seq_lens).view(-1, 1)
    inside = torch.arange(mml).view(1, -1) < lens
    assert torch.isneginf(expected[~inside]).all()  # the oracle's own window
    assert torch.isfinite(expected[inside]).all() and expected[inside].abs().sum() > 0
    for contract in ("flydsl", "gluon"):
        out = torch.full((len(seq_lens), mml), POISON)
        ref.fp8_paged_mqa_logits_reference(
            problem.q_fp8,
            problem.kv_cache,
            problem.weights,
            out,
            problem.context_lens,
            problem.block_tables,
            mml,
            preshuffle=preshuffle,
            contract=contract,
        )
        torch.testing.assert_close(out[inside], expected[inside], rtol=1e-5, atol=1e-5)
        if not preshuffle:
            # Outside the window nothing is written (no -inf prefill) by either contract here:
            # Gluon's -inf band is empty for next_n 1 without preshuffle.
            assert (out[~inside] == POISON).all(), contract
        elif contract == "flydsl":
            assert (out[~inside] == POISON).all()
