# SPDX-License-Identifier: Apache-2.0
"""FlyDSL-contract double of aiter PR #4221's ``flydsl_fp8_paged_mqa_logits``.

Reproduces the real wrapper's asserts, so any call the adapter lets through
that the real kernel would reject fails the tests. ``BROKEN`` makes it
deliberately wrong and ``SHORT_BY_ONE`` makes it leave the last column of every
row's window unwritten (the self-test must catch both: tests/test_selftest.py). Under
``$AITER_DOUBLE_FLYDSL=gfx950-padded-q`` or ``gfx950-early`` this module is what
it is in those aiter revisions: a shim re-exporting the gfx950 kernel.
"""

import math
import os

import torch

import aiter
from vllm_flydsl_indexer.tools.reference import flydsl_contract_reference

BROKEN = False
SHORT_BY_ONE = False


def _pow2(n):
    return n > 0 and (n & (n - 1)) == 0


def flydsl_fp8_paged_mqa_logits(
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    kv_indices,
    max_model_len,
    *,
    Preshuffle=False,
    KVBlockSize=1,
    ChunkK=128,
    SplitKV=None,
    WavePerEU=2,
    TotalCuCount=None,
    variant=None,
    stream=None,
):
    batch_size, next_n, heads, head_dim = q_fp8.shape
    if Preshuffle:
        assert KVBlockSize % 16 == 0
    assert ChunkK % 32 == 0
    assert _pow2(heads) and _pow2(head_dim)
    assert heads % 32 == 0 and head_dim % 64 == 0
    num_blocks, kvb, one, index_dim = kv_cache.shape
    assert (kvb, one) == (KVBlockSize, 1) and index_dim >= head_dim + 4
    assert kv_cache.dtype == torch.uint8
    assert num_blocks * KVBlockSize * index_dim < 2**31
    assert q_fp8.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    # The real wrapper reshapes; (B, next_n > 1) raises there.
    lens = context_lens.reshape(batch_size)
    # The real kernel assumes a block stride of KVBlockSize * index_dim.
    assert kv_cache.is_contiguous()
    aiter.CALLS.append(
        (
            "flydsl",
            {
                "Preshuffle": Preshuffle,
                "KVBlockSize": KVBlockSize,
                "ChunkK": ChunkK,
                "SplitKV": SplitKV,
                "WavePerEU": WavePerEU,
                "variant": variant,
            },
        )
    )
    if SHORT_BY_ONE:
        lens = lens - 1
    flydsl_contract_reference(
        q_fp8,
        kv_cache,
        weights,
        out_logits,
        lens,
        kv_indices,
        max_model_len,
        Preshuffle=Preshuffle,
        KVBlockSize=KVBlockSize,
    )
    if BROKEN:
        out_logits.mul_(1.0 + 1e-1 * math.pi)
    return out_logits


if os.environ.get("AITER_DOUBLE_FLYDSL") == "gfx950-padded-q":
    from aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_padded_q import (  # noqa: F401, F811
        flydsl_fp8_paged_mqa_logits,
        flydsl_fp8_paged_mqa_logits_gfx950,
    )
elif os.environ.get("AITER_DOUBLE_FLYDSL") == "gfx950-early":
    from aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_early import (  # noqa: F401, F811
        flydsl_fp8_paged_mqa_logits,
        flydsl_fp8_paged_mqa_logits_gfx950,
    )
