# SPDX-License-Identifier: Apache-2.0
"""Gluon-contract double of aiter's ``deepgemm_fp8_paged_mqa_logits``."""

import aiter
from vllm_flydsl_indexer.tools.reference import gluon_contract_reference


def deepgemm_fp8_paged_mqa_logits(
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    kv_indices,
    max_model_len,
    Preshuffle=False,
    KVBlockSize=1,
    ChunkK=256,
    TotalCuCount=None,
    WavePerEU=2,
    VarCtxSchedule=None,
):
    assert kv_cache.shape[1] == KVBlockSize
    aiter.CALLS.append(("gluon", {"Preshuffle": Preshuffle, "KVBlockSize": KVBlockSize}))
    return gluon_contract_reference(
        q_fp8,
        kv_cache,
        weights,
        out_logits,
        context_lens,
        kv_indices,
        max_model_len,
        Preshuffle=Preshuffle,
        KVBlockSize=KVBlockSize,
    )
