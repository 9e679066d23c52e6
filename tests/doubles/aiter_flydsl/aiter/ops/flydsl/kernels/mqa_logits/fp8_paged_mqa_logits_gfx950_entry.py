# SPDX-License-Identifier: Apache-2.0
"""Double of aiter's ``flydsl_fp8_paged_mqa_logits_gfx950`` entry (commits f33a573e, 6c1c496c).

Built from the public signature, beside the general kernel: ``(q, kv, w, out,
context_lens, kv_indices, max_model_len, *, KVBlockSize=64, SplitKV=None,
TotalCuCount=None, stream=None)``, no ``Preshuffle`` keyword (a TypeError if
passed). Raises ValueError as the real wrapper does unless heads are in
``SUPPORTED_HEADS``, head_dim is 128, KVBlockSize 64, next_n in {1, 2}, q native
e4m3 and the cache uint8 ``(*, 64, 1, 132)``; reduces ``context_lens`` to one
length per sequence with ``reshape(B)``. Its automatic SplitKV reads the CU
count only (shapes), like the real one. Writes the general kernel's window.
The plugin never launches it (since the sixth session): the double exists to prove that it is left alone.
"""

import torch

import aiter
from vllm_flydsl_indexer.tools.reference import flydsl_contract_reference

SUPPORTED_HEADS = (32, 64)
HEAD_DIM = 128
KV_BLOCK_SIZE = 64
NEXT_N_MAX = 2


def flydsl_fp8_paged_mqa_logits_gfx950(
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    kv_indices,
    max_model_len,
    *,
    KVBlockSize=KV_BLOCK_SIZE,
    SplitKV=None,
    TotalCuCount=None,
    stream=None,
):
    batch, next_n, heads, head_dim = q_fp8.shape
    if heads not in SUPPORTED_HEADS or (head_dim, int(KVBlockSize)) != (HEAD_DIM, KV_BLOCK_SIZE):
        raise ValueError("requires H in {32, 64}, D=128, KVBlockSize=64")
    if next_n not in (1, 2):
        raise ValueError("requires next_n in {1, 2}")
    if q_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q_fp8 must be native FP8 E4M3, got {q_fp8.dtype}")
    if kv_cache.dtype != torch.uint8 or tuple(kv_cache.shape[1:]) != (KV_BLOCK_SIZE, 1, HEAD_DIM + 4):
        raise ValueError(f"unexpected KV cache shape {tuple(kv_cache.shape)}")
    context_lens = context_lens.reshape(batch)
    if SplitKV is None or int(SplitKV) <= 0:
        cus = TotalCuCount or 256
        SplitKV = max(1, min(-(-max_model_len // KV_BLOCK_SIZE), -(-cus * 8 // batch)))
    aiter.CALLS.append(("flydsl-gfx950-entry", {"SplitKV": SplitKV, "KVBlockSize": KVBlockSize}))
    return flydsl_contract_reference(
        q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len,
        Preshuffle=True, KVBlockSize=KVBlockSize,
    )  # fmt: skip
