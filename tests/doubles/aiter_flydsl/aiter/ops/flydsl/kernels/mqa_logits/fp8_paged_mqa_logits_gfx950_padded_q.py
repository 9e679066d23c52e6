# SPDX-License-Identifier: Apache-2.0
"""Double of the padded-q revision of aiter's gfx950 ``flydsl_fp8_paged_mqa_logits``.

In aiter (e.g. commit f5b390371d) this lived at the same path as the other
revision, ``fp8_paged_mqa_logits_gfx950.py``, with the same signature and the
same module constants; only its wrapper's checks differ. Its contract as that
source states it: q must be ``(B, MAX_NN, NUM_HEADS, HEAD_DIM)`` (padded to
``MAX_NN`` rows whatever the real next_n), weights ``(B*MAX_NN, NUM_HEADS)``,
``next_n_lens`` (default: ``MAX_NN`` for every sequence) says which rows are
live, and row ``i`` of sequence ``b`` is written to output row ``b*MAX_NN + i``.
Anything else raises ValueError. Like the real wrapper, an automatic
``SplitKV`` reads ``context_lens.max().item()`` on the host.
"""

import torch

import aiter
from vllm_flydsl_indexer.tools.reference import flydsl_contract_reference

MAX_NN = 8
NUM_HEADS = 32
HEAD_DIM = 128
INDEX_DIM = HEAD_DIM + 4
KV_BLOCK_SIZE = 64


def flydsl_fp8_paged_mqa_logits(
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    kv_indices,
    max_model_len,
    *,
    next_n_lens=None,
    Preshuffle=True,
    KVBlockSize=KV_BLOCK_SIZE,
    SplitKV=None,
    TotalCuCount=None,
    stream=None,
):
    """Ragged paged FP8 MQA logits for padded Q ``[B, 8, 32, 128]``."""
    if not Preshuffle:
        raise ValueError("requires Preshuffle=True")
    if q_fp8.ndim != 4:
        raise ValueError(f"q_fp8 must be rank 4, got shape {tuple(q_fp8.shape)}")
    batch_size, max_nn, heads, head_dim = q_fp8.shape
    if (max_nn, heads, head_dim, int(KVBlockSize)) != (MAX_NN, NUM_HEADS, HEAD_DIM, KV_BLOCK_SIZE):
        raise ValueError("requires Q shape [B, 8, 32, 128] and KVBlockSize=64")
    if not q_fp8.is_contiguous() or q_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError("q_fp8 must be contiguous native FP8 E4M3")
    if (
        kv_cache.dtype != torch.uint8
        or not kv_cache.is_contiguous()
        or tuple(kv_cache.shape[1:]) != (KV_BLOCK_SIZE, 1, INDEX_DIM)
    ):
        raise ValueError(f"unexpected KV cache shape {tuple(kv_cache.shape)}")
    if tuple(weights.shape) != (batch_size * MAX_NN, NUM_HEADS):
        raise ValueError(f"weights must have shape {(batch_size * MAX_NN, NUM_HEADS)}")
    if not weights.is_contiguous() or weights.dtype != torch.float32:
        raise ValueError("weights must be contiguous float32")
    context_lens = context_lens.reshape(batch_size)
    if next_n_lens is None:
        next_n_lens = torch.full((batch_size,), MAX_NN, dtype=torch.int32)
    if SplitKV is None or int(SplitKV) <= 0:
        SplitKV = max(1, int(context_lens.max().item()) // 4096)  # the real wrapper's host read
    aiter.CALLS.append(("flydsl-gfx950-padded-q", {"SplitKV": SplitKV, "KVBlockSize": KVBlockSize}))
    for b, nn in enumerate(next_n_lens.tolist()):
        rows = slice(b * MAX_NN, b * MAX_NN + nn)
        flydsl_contract_reference(
            q_fp8[b : b + 1, :nn].contiguous(),
            kv_cache,
            weights[rows],
            out_logits[rows],
            context_lens[b : b + 1],
            kv_indices[b : b + 1],
            max_model_len,
            Preshuffle=True,
            KVBlockSize=KVBlockSize,
        )
    return out_logits


flydsl_fp8_paged_mqa_logits_gfx950 = flydsl_fp8_paged_mqa_logits
