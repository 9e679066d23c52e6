# SPDX-License-Identifier: Apache-2.0
"""The self-test: FlyDSL proves itself against stock, once per shape, before a call depends on it.

The router runs :func:`run` on :func:`synthetic`'s small problem at a shape's first launch outside graph
capture. **The agreement rule** (:func:`compare_in_windows`, shared with ``check``, ``bench`` and ``tune``),
inside the columns vLLM reads: identical ``-inf`` masks; ``1 - 2*sum(xy) / sum(x^2 + y^2) < 1e-3`` over the
finite entries (exact between reference contracts); identical top-k index sets. No vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_flydsl_indexer.target import INDEX_TOPK, SCALE_BYTES

REAL_KERNEL_TOLERANCE = 1e-3
# Logits entries the comparison handles at once (whole rows, at least one): bounds its temporaries.
CHUNK_ELEMENTS = 1 << 16
# What one self-test may allocate, inputs and both outputs included (tests/test_selftest.py holds it).
MAX_BYTES = 4 << 20
SEED = 20251205


def read_window_ends(context_lens: torch.Tensor, rows: int, next_n: int) -> torch.Tensor:
    """Exclusive end of the columns vLLM's consumers read, per logits row: ``bounds.reshape(-1)`` where it
    holds one entry per row, else one entry per sequence repeated ``next_n`` times (V4.1's selection)."""
    flat = context_lens.reshape(-1).to(torch.int64)
    return (flat if flat.numel() == rows else flat.repeat_interleave(next_n)).clamp_min(0)


def disagreement(found: dict, tolerance: float) -> str | None:
    """What :func:`compare_in_windows` found outside the rule, or ``None`` (``tolerance`` 0: exact)."""
    close = found["max_rel_diff"] == 0.0 if tolerance == 0 else found["max_rel_diff"] < tolerance
    agree = close and found["mask_equal"] and found["topk_equal"] and found["nan_free"]
    return None if agree else describe_agreement(found)


def describe_agreement(found: dict) -> str:
    mask, topk = ("identical" if found[key] else "DIFFERENT" for key in ("mask_equal", "topk_equal"))
    nan = "" if found["nan_free"] else ", NaN or unwritten values read"
    return f"max rel diff {found['max_rel_diff']:.3e}, -inf mask {mask}, top-k {topk}{nan}"


def compare_in_windows(
    expected: torch.Tensor, actual: torch.Tensor, ends: torch.Tensor, topk: int = INDEX_TOPK
) -> dict:
    """Compare two logits buffers over ``[0, ends[r])`` of every row ``r``, a chunk of rows at a time
    (:data:`CHUNK_ELEMENTS`: bounded memory), one host sync at the end. Rows whose window holds only
    ``-inf`` or nothing count as equal."""
    (rows, width), device = expected.shape, expected.device
    ends = ends.to(device).clamp(0, width)
    cols = torch.arange(width, device=device).view(1, -1)
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    k = min(topk, width)
    found_nan, mask_differs, topk_differs = torch.zeros(3, dtype=torch.bool, device=device)
    max_rel = torch.zeros((), dtype=torch.float64, device=device)

    def top_set(t: torch.Tensor, inside: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
        """Each row's top min(topk, window) columns, NaN read as -inf, as a sorted index set."""
        values, index = torch.where(inside, torch.nan_to_num(t, nan=-torch.inf), -torch.inf).topk(k, dim=1)
        return torch.where(taken & torch.isfinite(values), index, -1).sort(dim=1).values

    for start in range(0, rows, step):
        e, a = expected[start : start + step].float(), actual[start : start + step].float()
        end = ends[start : start + step].view(-1, 1)
        inside = cols < end
        found_nan |= ((torch.isnan(e) | torch.isnan(a)) & inside).any()
        mask_differs |= ((torch.isneginf(e) != torch.isneginf(a)) & inside).any()
        finite = inside & torch.isfinite(e) & torch.isfinite(a)
        x, y = torch.where(finite, e, 0.0).double(), torch.where(finite, a, 0.0).double()
        cross, norms = (x * y).sum(dim=1), (x * x + y * y).sum(dim=1)
        del x, y
        # 1 - 2*sum(xy) / sum(x^2 + y^2) per row; a zero denominator means both rows are all zero.
        rel = torch.where(norms > 0, 1 - 2 * cross / norms.clamp_min(1e-300), 0.0)
        max_rel = torch.maximum(max_rel, rel.max())
        if k == 0:
            continue
        taken = torch.arange(k, device=device).view(1, -1) < end.clamp_max(k)
        topk_differs |= (top_set(e, inside, taken) != top_set(a, inside, taken)).any()
    return {
        "rows": rows,
        "read_columns": int(ends.sum()),
        "max_rel_diff": float(max_rel),
        "mask_equal": not bool(mask_differs),
        "topk_equal": not bool(topk_differs),
        "nan_free": not bool(found_nan),
    }


def synthetic_lengths(block_size: int, next_n: int) -> list[int]:
    """Sequence lengths (new tokens included): empty, a partial block, whole blocks, several blocks."""
    block = max(block_size, 16)  # KVBlockSize 1: still several tokens per "block" of work
    partial = max(next_n + 1, block // 2 + 1)  # every sequence's rows but the first see columns
    partial += partial % block == 0
    return [0, partial, 2 * block, 3 * block + partial]


def synthetic(
    heads: int,
    head_dim: int,
    block_size: int,
    next_n: int,
    index_dim: int,
    *,
    per_row_bounds: bool,
    device: torch.device,
    lengths: list[int] | tuple = (),
) -> tuple:
    """The target's positional arguments for a problem of this shape, drawn on the CPU from a fixed seed
    (vLLM's device RNG is left alone): :func:`synthetic_lengths`'s small one, else sequences of
    ``lengths``. ``per_row_bounds``: vLLM's ``(B, next_n)`` bounds ``[b, j] = max(0, L_b - next_n + j + 1)``,
    else one length per sequence."""
    gen = torch.Generator().manual_seed(SEED)
    lengths = torch.tensor(lengths or synthetic_lengths(block_size, next_n), dtype=torch.int64)
    batch, blocks = lengths.numel(), -(-int(lengths.max()) // block_size) + 1  # and a spare block
    max_model_len = blocks * block_size
    pool, key_bytes = batch * blocks, block_size * head_dim
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
    per_row = (lengths.view(-1, 1) - next_n + torch.arange(next_n).view(1, -1) + 1).clamp_min(0)
    context_lens = (per_row if per_row_bounds else lengths).to(torch.int32)
    tensors = (q_fp8, kv_cache, weights, context_lens, block_tables)
    return (*(t.to(device) for t in tensors), None, max_model_len)


def run(
    args: tuple,
    stock: Callable[[tuple], torch.Tensor],
    stock_buffer: Callable[[int, int], torch.Tensor],
    launches: dict[str, Callable[[tuple, torch.Tensor], object]],
    live: tuple[int, int] = (0, 0),
) -> str | None:
    """Stock, then each FlyDSL launch (``{name: launch(args, out)}``), on the synthetic ``args``: ``None``
    when every launch agrees and writes exactly the columns read, else what differed; raises what an arm
    raises. ``stock`` writes vLLM's workspace (``stock_buffer``): its bytes are put back for the live call."""
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
        if problem := disagreement(result, REAL_KERNEL_TOLERANCE):
            return f"FlyDSL {name}: {problem}"
        if (written := int((~torch.isnan(actual)).sum())) != result["read_columns"]:
            return f"FlyDSL {name} wrote {written} columns, the consumers read {result['read_columns']}"
    return None
