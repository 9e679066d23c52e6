# SPDX-License-Identifier: Apache-2.0
"""Double of aiter's tuned Gluon/FlyDSL dispatcher (aiter PR #6140).

Importable only with ``$AITER_DOUBLE_DISPATCHER=1`` (most aiter builds lack it).
Its table picks FlyDSL for heads 32, KVBlockSize 64 at batch >= 64 and Gluon
elsewhere. Its FlyDSL rows carry their own knobs, which differ by batch bucket
(``wg_per_cu`` 2 from batch 64, 1 from batch 256), so a test can tell which
row a launch used: ``run_paged_mqa_logits`` records the whole row it was given
in ``aiter.CALLS`` (``("dispatcher", row)``) before the kernel it launches.
"""

import os

import aiter

if os.environ.get("AITER_DOUBLE_DISPATCHER") != "1":
    raise ImportError("double: this aiter has no tuned paged MQA logits dispatcher")

from aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits import flydsl_fp8_paged_mqa_logits  # noqa: E402
from aiter.ops.triton.pa_mqa_logits import deepgemm_fp8_paged_mqa_logits  # noqa: E402


def get_paged_mqa_logits_config(batch_size, next_n, heads, head_dim, kv_block_size, preshuffle):
    if heads == 32 and kv_block_size == 64 and preshuffle and batch_size >= 64:
        return {"backend": "flydsl", "ChunkK": 0, "WavePerEU": 0, "wg_per_cu": 2 if batch_size < 256 else 1}
    return {"backend": "gluon", "ChunkK": 256, "WavePerEU": 2, "wg_per_cu": 0}


def flydsl_supports(q_fp8, kv_cache, weights, Preshuffle, KVBlockSize):
    # aiter's own check (1eb1a7b5): among others, contiguous q, cache and float32 weights.
    return bool(Preshuffle) and q_fp8.is_contiguous() and kv_cache.is_contiguous() and weights.is_contiguous()


def run_paged_mqa_logits(
    config,
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    kv_indices,
    max_model_len,
    Preshuffle,
    KVBlockSize,
):
    """Launch one explicit config, as aiter's tuner and dispatcher do (its ``backend`` decides)."""
    aiter.CALLS.append(("dispatcher", dict(config)))
    kernel = flydsl_fp8_paged_mqa_logits if config["backend"] == "flydsl" else deepgemm_fp8_paged_mqa_logits
    return kernel(
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


def paged_mqa_logits(
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    kv_indices,
    max_model_len,
    Preshuffle=False,
    KVBlockSize=1,
):
    batch, next_n, heads, head_dim = q_fp8.shape
    config = get_paged_mqa_logits_config(batch, next_n, heads, head_dim, KVBlockSize, Preshuffle)
    supported = flydsl_supports(q_fp8, kv_cache, weights, Preshuffle, KVBlockSize)
    if config["backend"] == "flydsl" and not supported:
        config = {"backend": "gluon", "ChunkK": 256, "WavePerEU": 2, "wg_per_cu": 0}
    return run_paged_mqa_logits(
        config,
        q_fp8,
        kv_cache,
        weights,
        out_logits,
        context_lens,
        kv_indices,
        max_model_len,
        Preshuffle,
        KVBlockSize,
    )
