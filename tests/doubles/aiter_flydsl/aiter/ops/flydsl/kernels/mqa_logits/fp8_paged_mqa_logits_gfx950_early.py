# SPDX-License-Identifier: Apache-2.0
"""Double of the earlier revision of aiter's gfx950 ``flydsl_fp8_paged_mqa_logits``.

In aiter (e.g. commit 9661da3a) this lived at the same path as the later
revisions, ``fp8_paged_mqa_logits_gfx950.py``, and ``aiter.ops.flydsl`` mapped
``flydsl_fp8_paged_mqa_logits`` to it. Its contract as that source states it:

* module constants ``SUPPORTED_HEADS = (32, 64)``, ``HEAD_DIM = 128``,
  ``INDEX_DIM = HEAD_DIM + 4``, ``KV_BLOCK_SIZE = 64``; no ``NUM_HEADS``, no
  ``MAX_NN``;
* keyword-only ``Preshuffle=True, KVBlockSize=KV_BLOCK_SIZE, SplitKV=None,
  TotalCuCount=None, stream=None``: no ``next_n_lens``, ``ChunkK``,
  ``WavePerEU`` or ``variant`` (a TypeError if passed);
* ValueError unless Preshuffle, heads in ``SUPPORTED_HEADS``, head_dim and
  KVBlockSize the constants, ``next_n in (1, 2)``, q native e4m3, a uint8
  cache of shape ``(*, 64, 1, 132)``. It checks nothing else:
  ``context_lens.reshape(B)`` (raises for ``(B, 2)``), ``weights.reshape(B*next_n,
  heads)``, ``kv_cache.reshape(-1)`` (a strided cache is silently copied), and
  q is read at its own strides;
* automatic SplitKV ``max(1, min(pages(max_model_len), ceil(cu * 8 / B)))``,
  an explicit one clamped to ``[1, pages]``: shapes only, no host read;
* writes the same window as the general kernel.

The real wrapper also raises RuntimeError off gfx950; the doubles simulate gfx950.
"""

from functools import lru_cache

import torch

import aiter
from vllm_flydsl_indexer.tools.reference import flydsl_contract_reference

SUPPORTED_HEADS = (32, 64)
HEAD_DIM = 128
INDEX_DIM = HEAD_DIM + 4
KV_BLOCK_SIZE = 64


@lru_cache(maxsize=8)
def device_cu_count(device_index):
    try:
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    except Exception:  # noqa: BLE001 - as the real wrapper: 256 when it cannot ask
        return 256


def flydsl_fp8_paged_mqa_logits(
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    kv_indices,
    max_model_len,
    *,
    Preshuffle=True,
    KVBlockSize=KV_BLOCK_SIZE,
    SplitKV=None,
    TotalCuCount=None,
    stream=None,
):
    """Paged FP8 MQA logits (decode) for H in {32, 64}, next_n in {1, 2}, KVB=64."""
    if not Preshuffle:
        raise ValueError("requires Preshuffle=True")
    batch_size, next_n, heads, head_dim = q_fp8.shape
    if heads not in SUPPORTED_HEADS or (head_dim, int(KVBlockSize)) != (HEAD_DIM, KV_BLOCK_SIZE):
        raise ValueError("requires H in {32, 64}, D=128, KVBlockSize=64")
    if next_n not in (1, 2):
        raise ValueError("requires next_n in {1, 2}")
    if q_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q_fp8 must be native FP8 E4M3, got {q_fp8.dtype}")
    if kv_cache.dtype != torch.uint8:
        raise ValueError("kv_cache must contain preshuffled uint8 FP8 data")
    _, block_size, one, index_dim = kv_cache.shape
    if block_size != KV_BLOCK_SIZE or one != 1 or index_dim != INDEX_DIM:
        raise ValueError(f"unexpected KV cache shape {tuple(kv_cache.shape)}")

    context_lens = context_lens.reshape(batch_size)
    weights = weights.reshape(batch_size * next_n, heads)
    max_block_len = kv_indices.shape[-1]
    kv_indices = kv_indices.reshape(batch_size, max_block_len)
    total_cu = device_cu_count(q_fp8.device.index) if TotalCuCount is None else int(TotalCuCount)
    max_pages = max(1, (int(max_model_len) + KV_BLOCK_SIZE - 1) // KV_BLOCK_SIZE)
    split_kv = (
        max(1, min(max_pages, (total_cu * 4 * 2 + batch_size - 1) // batch_size))
        if SplitKV is None or int(SplitKV) <= 0
        else max(1, min(max_pages, int(SplitKV)))
    )
    flat = kv_cache.reshape(-1)  # a copy when the cache is strided, as in the real wrapper
    aiter.CALLS.append(
        (
            "flydsl-gfx950-early",
            {
                "SplitKV": split_kv,
                "KVBlockSize": KVBlockSize,
                "cache_copied": not kv_cache.is_contiguous(),
            },
        )
    )
    return flydsl_contract_reference(
        q_fp8,
        flat.view(-1, KV_BLOCK_SIZE, 1, INDEX_DIM),
        weights,
        out_logits,
        context_lens,
        kv_indices,
        max_model_len,
        Preshuffle=True,
        KVBlockSize=KVBlockSize,
    )


flydsl_fp8_paged_mqa_logits_gfx950 = flydsl_fp8_paged_mqa_logits
