# SPDX-License-Identifier: Apache-2.0
"""Double of aiter's gfx950-specialised ``flydsl_fp8_paged_mqa_logits``.

Its contract as the public aiter source states it: fixed shapes from the module
constants below, Preshuffle required, contiguous q/cache/weights, keyword-only
``next_n_lens``, ``SplitKV``, ``TotalCuCount``, ``stream`` and no ``ChunkK``,
``WavePerEU`` or ``variant`` (a TypeError if passed). Every other input raises
ValueError. Like the real wrapper, an automatic ``SplitKV`` reads
``context_lens.max().item()`` on the host, so a router that leaves it to the
default issues a host sync the tests can see. Writes the same window as the
general kernel. Tests may monkeypatch the constants to model other revisions.
"""

import torch

import aiter
from vllm_flydsl_indexer.tools.reference import flydsl_contract_reference

NUM_HEADS = 32
HEAD_DIM = 128
KV_BLOCK_SIZE = 64
INDEX_DIM = 132
MAX_NN = 8


def _allowed(value, constant):
    return value in constant if isinstance(constant, tuple) else value == constant


def flydsl_fp8_paged_mqa_logits_gfx950(
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
    KVBlockSize=64,
    SplitKV=None,
    TotalCuCount=None,
    stream=None,
):
    if not Preshuffle:
        raise ValueError("Preshuffle=False is not supported")
    if q_fp8.dim() != 4:
        raise ValueError("q_fp8 must be 4-D")
    batch, next_n, heads, head_dim = q_fp8.shape
    if not 1 <= next_n <= MAX_NN:
        raise ValueError(f"next_n={next_n} outside 1..{MAX_NN}")
    if not _allowed(heads, NUM_HEADS) or head_dim != HEAD_DIM or KVBlockSize != KV_BLOCK_SIZE:
        raise ValueError(f"unsupported heads={heads} head_dim={head_dim} KVBlockSize={KVBlockSize}")
    if not q_fp8.is_contiguous() or q_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError("q_fp8 must be contiguous native e4m3")
    if (
        kv_cache.dtype != torch.uint8
        or not kv_cache.is_contiguous()
        or tuple(kv_cache.shape[1:]) != (KV_BLOCK_SIZE, 1, INDEX_DIM)
    ):
        raise ValueError(f"kv_cache must be contiguous uint8 (*, {KV_BLOCK_SIZE}, 1, {INDEX_DIM})")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (batch * next_n, heads):
        raise ValueError("weights must be fp32 (B*next_n, heads)")
    if not weights.is_contiguous():
        raise ValueError("weights must be contiguous")
    if out_logits.shape[0] != batch * next_n:
        raise ValueError("out_logits has the wrong number of rows")
    if context_lens.numel() != batch:
        raise ValueError("context_lens must hold one length per sequence")
    if SplitKV is None:
        SplitKV = max(1, int(context_lens.max().item()) // 4096)  # the real wrapper's host read
    if SplitKV < 1:
        raise ValueError("SplitKV must be >= 1")
    aiter.CALLS.append(("flydsl-gfx950", {"SplitKV": SplitKV, "KVBlockSize": KVBlockSize}))
    return flydsl_contract_reference(
        q_fp8,
        kv_cache,
        weights,
        out_logits,
        context_lens.reshape(batch),
        kv_indices,
        max_model_len,
        Preshuffle=True,
        KVBlockSize=KVBlockSize,
    )


flydsl_fp8_paged_mqa_logits = flydsl_fp8_paged_mqa_logits_gfx950
