# SPDX-License-Identifier: Apache-2.0
"""The self-test: FlyDSL itself proves itself against stock, once per shape, before a call depends on it.

The router runs :func:`run` the first time it would launch a shape (heads,
head_dim, KVBlockSize, next_n and the bounds' kind: one length per sequence, or
vLLM's ``(B, next_n)`` table) outside graph capture; vLLM's eager warm-up does
this before it captures, and with breakable graphs the op's first eager run
does. Not per batch size, not per SplitKV: the launches cover the knob's
range instead (SplitKV 1 and the largest any live launch of the shape can
reach, clamped to this problem's pages, as FlyDSL clamps it), and they run
FlyDSL itself (with aiter's dispatcher, forced through its own
``run_paged_mqa_logits``), never a kernel chosen for it.

:func:`synthetic` builds a small problem of that shape on the call's device:
four sequences whose lengths cover an empty sequence, a partial block and
several blocks; for ``next_n > 1`` vLLM's native ``(B, next_n)`` bounds; finite
fp8 values and positive finite scales everywhere the kernels read (both arms
read the same bytes, so the cache layout's shuffle does not matter). Its
``max_model_len`` is a few blocks, so the self-test costs well under
:data:`MAX_BYTES` whatever the served ``max_model_len`` is. Imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_flydsl_indexer.agreement import REAL_KERNEL_TOLERANCE, compare_in_windows, read_window_ends
from vllm_flydsl_indexer.target import SCALE_BYTES

__all__ = ["MAX_BYTES", "SEED", "run", "synthetic", "synthetic_lengths", "width"]

# What one self-test may allocate, inputs and both outputs included (tests/test_selftest.py holds it).
MAX_BYTES = 4 << 20
SEED = 20251205


def synthetic_lengths(block_size: int, next_n: int) -> list[int]:
    """Sequence lengths (new tokens included): empty, a partial block, whole blocks, several blocks."""
    block = max(block_size, 16)  # KVBlockSize 1: still several tokens per "block" of work
    partial = max(next_n + 1, block // 2 + 1)  # every sequence's rows but the first see columns
    partial += partial % block == 0
    return [0, partial, 2 * block, 3 * block + partial]


def width(block_size: int, next_n: int) -> tuple[int, int]:
    """``(max_model_len, block table width)``: one spare block past the longest sequence."""
    longest = max(synthetic_lengths(block_size, next_n))
    blocks = -(-longest // block_size) + 1
    return blocks * block_size, blocks


def synthetic(
    heads: int,
    head_dim: int,
    block_size: int,
    next_n: int,
    index_dim: int,
    *,
    per_row_bounds: bool,
    device: torch.device,
) -> tuple:
    """``rocm_fp8_paged_mqa_logits``'s positional arguments for a small problem of this configuration.

    Drawn on the CPU from a fixed seed (vLLM's device RNG is left alone), then
    copied to ``device``. ``per_row_bounds``: vLLM's ``(B, next_n)`` bounds
    ``[b, j] = max(0, L_b - next_n + j + 1)``, else one length per sequence ``(B,)``.
    """
    gen = torch.Generator().manual_seed(SEED)
    lengths = torch.tensor(synthetic_lengths(block_size, next_n), dtype=torch.int64)
    batch = lengths.numel()
    max_model_len, blocks = width(block_size, next_n)
    pool = batch * blocks
    key_bytes = block_size * head_dim
    flat = torch.zeros(pool, block_size * index_dim, dtype=torch.uint8)
    keys = torch.randn(pool, key_bytes, generator=gen).mul(64).to(torch.float8_e4m3fn)
    flat[:, :key_bytes] = keys.view(torch.uint8)
    scales = torch.rand(pool, block_size, generator=gen).mul(0.02).add(1e-3)
    flat[:, key_bytes : key_bytes + block_size * SCALE_BYTES] = scales.view(torch.uint8)
    kv_cache = flat.view(pool, block_size, 1, index_dim)
    # Every logical block of every sequence is a distinct physical block, in shuffled order.
    block_tables = torch.randperm(pool, generator=gen).to(torch.int32).view(batch, blocks)
    q_fp8 = torch.randn(batch, next_n, heads, head_dim, generator=gen).mul(2).to(torch.float8_e4m3fn)
    weights = torch.randn(batch * next_n, heads, generator=gen).mul(heads**-0.5)
    if per_row_bounds:
        j = torch.arange(next_n).view(1, -1)
        context_lens = (lengths.view(-1, 1) - next_n + j + 1).clamp_min(0).to(torch.int32)
    else:
        context_lens = lengths.to(torch.int32)
    tensors = (q_fp8, kv_cache, weights, context_lens, block_tables)
    q_fp8, kv_cache, weights, context_lens, block_tables = (t.to(device) for t in tensors)
    return q_fp8, kv_cache, weights, context_lens, block_tables, None, max_model_len


def run(
    args: tuple,
    stock: Callable[[tuple], torch.Tensor],
    stock_buffer: Callable[[int, int], torch.Tensor],
    launches: dict[str, Callable[[tuple, torch.Tensor], object]],
    live: tuple[int, int] = (0, 0),
) -> str | None:
    """Stock, then each FlyDSL launch, on the synthetic ``args``: ``None`` when every launch agrees.

    ``stock(args)`` is vLLM's original, which takes its output from vLLM's
    workspace (``stock_buffer(rows, max_model_len)`` is that same view, poisoned
    first); its small answer is copied out and the workspace bytes it used are
    put back, so the live call's output, obtained after from the same workspace,
    finds it as it was. Each of ``launches`` (``{name: launch(args, out)}``)
    writes a buffer of its own, poisoned with NaN, and must agree with stock
    and write exactly the columns the consumers read. Else a message naming the
    launch and what differed. Raises what an arm raises.
    """
    q_fp8, _, _, context_lens, _, _, max_model_len = args
    batch, next_n = q_fp8.shape[:2]
    rows = batch * next_n
    # The smaller of the live call's view (``live``: its rows and max_model_len) and ours is kept and
    # put back: ours when it fits inside the live view, else the live view (the workspace may grow).
    keep = live if live[0] * live[1] <= rows * max_model_len else (rows, max_model_len)
    saved = stock_buffer(*keep).clone()
    stock_buffer(rows, max_model_len).fill_(float("nan"))
    expected = stock(args).clone()
    stock_buffer(*keep).copy_(saved)
    ends = read_window_ends(context_lens, rows, next_n)
    actual = torch.empty((rows, max_model_len), dtype=torch.float32, device=q_fp8.device)
    for name, launch in launches.items():
        actual.fill_(float("nan"))
        launch(args, actual)
        result = compare_in_windows(expected, actual, ends)
        if not result.ok(REAL_KERNEL_TOLERANCE):
            return f"FlyDSL {name}: {result.describe()}"
        written = int((~torch.isnan(actual)).sum())
        if written != result.read_columns:
            return f"FlyDSL {name} wrote {written} columns, the consumers read {result.read_columns}"
    return None
