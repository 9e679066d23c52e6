# SPDX-License-Identifier: Apache-2.0
"""Pure-torch reference of the fp8 paged MQA logits, and a paged-cache builder.

The math, for every column ``t`` inside row ``r = b * next_n + i``'s window::

    logits[r, t] = sum_h relu(q[b, i, h, :] . k[t, :]) * kv_scale[t] * w[r, h]

Two write contracts are offered, matching the two aiter kernels:

* ``"flydsl"`` writes exactly columns ``[0, ctx_b - next_n + i]`` of row
  ``(b, i)`` and leaves every other column untouched.
* ``"gluon"`` writes the same values, then ``-inf`` from the causal bound up to
  ``ctx_b`` (or up to ``ctx_b`` rounded up to a whole KV block when the cache
  is preshuffled), and leaves the rest untouched.

Everything is vectorised and data-independent given static shapes: no host
syncs, so the reference can run inside a CUDA graph. It runs on CPU and CUDA.
This module is an oracle for tests, ``check`` and ``bench``; it is never
routed to by the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from vllm_flydsl_indexer.target import SCALE_BYTES

__all__ = [
    "Contract",
    "FLYDSL_KNOBS",
    "FP8_E4M3FN_MAX",
    "GENERAL",
    "GFX950",
    "GFX950_KNOBS",
    "PagedProblem",
    "SCALE_FLOOR",
    "SHUFFLE_TILE",
    "VARIANT_CONTRACTS",
    "VariantContract",
    "contract_violation",
    "expected_split_kv",
    "flydsl_contract_reference",
    "flydsl_contract_violation",
    "fp8_paged_mqa_logits_reference",
    "fp8_paged_mqa_logits_values",
    "gfx950_contract_violation",
    "gluon_contract_reference",
    "make_paged_problem",
    "mtp_bounds",
    "pack_blocks",
    "per_sequence_lens",
    "quantize_keys",
    "row_windows",
    "shuffled_offsets",
    "unpack_keys",
    "variant_reference",
]

Contract = Literal["flydsl", "gluon"]

FP8_E4M3FN_MAX = 448.0
# vLLM's per-token scale floor for the indexer K cache.
SCALE_FLOOR = 1e-4
# Preshuffle tile edge (tokens x dims) of vLLM's ROCm indexer cache layout.
SHUFFLE_TILE = 16


def shuffled_offsets(block_size: int, head_dim: int, device=None) -> torch.Tensor:
    """Byte offset, inside one block, of (token t, dim d) in the 16x16 layout.

    Returns a ``(block_size, head_dim)`` int64 tensor: entry ``[t, d]`` is
    ``(t//16)*16*D + (d//16)*256 + (t%16)*16 + d%16``.
    """
    if block_size % SHUFFLE_TILE or head_dim % SHUFFLE_TILE:
        raise ValueError(
            f"preshuffle needs block_size and head_dim divisible by {SHUFFLE_TILE}, "
            f"got {block_size} and {head_dim}"
        )
    t = torch.arange(block_size, device=device).view(-1, 1)
    d = torch.arange(head_dim, device=device).view(1, -1)
    tile = SHUFFLE_TILE
    return (t // tile) * tile * head_dim + (d // tile) * tile * tile + (t % tile) * tile + d % tile


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3fn quantisation with vLLM's scale rule.

    ``keys`` is ``(..., head_dim)`` float. Returns ``(k_fp8, scale)`` where
    ``scale = max(amax, 1e-4) / 448`` has shape ``keys.shape[:-1]``.
    """
    amax = keys.float().abs().amax(dim=-1)
    scale = amax.clamp_min(SCALE_FLOOR) / FP8_E4M3FN_MAX
    k_fp8 = (keys.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return k_fp8, scale


def pack_blocks(k_fp8: torch.Tensor, scale: torch.Tensor, *, preshuffle: bool) -> torch.Tensor:
    """Pack ``(nb, KVB, D)`` fp8 keys and ``(nb, KVB)`` scales into cache blocks.

    Returns ``(nb, KVB, 1, D + 4)`` uint8: per block, ``KVB*D`` key bytes
    (plain or 16x16-shuffled), then ``KVB`` fp32 scales in token order.
    """
    nb, kvb, d = k_fp8.shape
    key_bytes = k_fp8.contiguous().view(torch.uint8).reshape(nb, kvb * d)
    if preshuffle:
        offsets = shuffled_offsets(kvb, d, device=k_fp8.device).reshape(-1)
        shuffled = torch.empty_like(key_bytes)
        shuffled[:, offsets] = key_bytes
        key_bytes = shuffled
    scale_bytes = scale.float().contiguous().view(torch.uint8).reshape(nb, kvb * SCALE_BYTES)
    blocks = torch.cat([key_bytes, scale_bytes], dim=1)
    return blocks.view(nb, kvb, 1, d + SCALE_BYTES)


def unpack_keys(
    kv_cache: torch.Tensor, head_dim: int, *, preshuffle: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_blocks`: float32 keys ``(nb, KVB, D)``, scales ``(nb, KVB)``."""
    nb, kvb = kv_cache.shape[0], kv_cache.shape[1]
    flat = kv_cache.reshape(nb, -1)
    key_bytes = flat[:, : kvb * head_dim]
    if preshuffle:
        offsets = shuffled_offsets(kvb, head_dim, device=kv_cache.device).reshape(-1)
        key_bytes = key_bytes[:, offsets]
    keys = key_bytes.contiguous().view(torch.float8_e4m3fn).float().view(nb, kvb, head_dim)
    scale_bytes = flat[:, kvb * head_dim : kvb * (head_dim + SCALE_BYTES)]
    scales = scale_bytes.contiguous().view(torch.float32).view(nb, kvb)
    return keys, scales


def per_sequence_lens(context_lens: torch.Tensor, batch: int) -> torch.Tensor:
    """One length per sequence: the last column of a 2-D table, else the values."""
    if context_lens.dim() == 2:
        return context_lens[:, -1]
    return context_lens.reshape(batch)


def row_windows(context_lens: torch.Tensor, batch: int, next_n: int) -> torch.Tensor:
    """Exclusive causal end of each row, ``(B*next_n,)``: ``ctx_b - next_n + i + 1``."""
    ctx = per_sequence_lens(context_lens, batch).to(torch.int64)
    i = torch.arange(next_n, device=ctx.device)
    return (ctx.view(-1, 1) - next_n + i.view(1, -1) + 1).reshape(-1)


def fp8_paged_mqa_logits_values(
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    block_tables: torch.Tensor,
    width: int,
    *,
    preshuffle: bool,
    rows_per_chunk: int = 8,
) -> torch.Tensor:
    """Dense logits ``(B*next_n, width)`` for every column, in float32.

    Columns beyond the block table's capacity are ``nan``; callers mask.
    Work is chunked over sequences to bound memory.
    """
    batch, next_n, heads, head_dim = q_fp8.shape
    kv_u8 = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
    keys, scales = unpack_keys(kv_u8, head_dim, preshuffle=preshuffle)
    kvb = kv_u8.shape[1]
    capacity = block_tables.shape[1] * kvb
    cols = min(width, capacity)
    out = torch.full((batch * next_n, width), float("nan"), dtype=torch.float32, device=q_fp8.device)
    w = weights.float().view(batch, next_n, heads)
    q = q_fp8.float()
    for start in range(0, batch, rows_per_chunk):
        stop = min(start + rows_per_chunk, batch)
        bt = block_tables[start:stop].long()
        k = keys[bt].reshape(stop - start, capacity, head_dim)[:, :cols]
        s = scales[bt].reshape(stop - start, capacity)[:, :cols]
        scores = torch.einsum("bnhd,btd->bnht", q[start:stop], k).relu()
        logits = torch.einsum("bnht,bnh->bnt", scores, w[start:stop]) * s.unsqueeze(1)
        out[start * next_n : stop * next_n, :cols] = logits.reshape(-1, cols)
    return out


def fp8_paged_mqa_logits_reference(
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    out_logits: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_model_len: int,
    *,
    preshuffle: bool,
    contract: Contract,
) -> torch.Tensor:
    """Write ``out_logits`` in place under one kernel's contract; return it.

    ``context_lens`` is ``(B,)``, ``(B, 1)`` or ``(B, next_n)``; as both
    kernels do, only one length per sequence is read (the last column).
    """
    batch, next_n = q_fp8.shape[:2]
    width = out_logits.shape[1]
    values = fp8_paged_mqa_logits_values(q_fp8, kv_cache, weights, block_tables, width, preshuffle=preshuffle)
    cols = torch.arange(width, device=out_logits.device).view(1, -1)
    causal_end = row_windows(context_lens, batch, next_n).view(-1, 1)
    write_values = cols < causal_end
    result = torch.where(write_values, values, out_logits)
    if contract == "gluon":
        ctx = per_sequence_lens(context_lens, batch).to(torch.int64)
        if preshuffle:
            kvb = kv_cache.shape[1]
            ctx = (ctx + kvb - 1) // kvb * kvb
        limit = ctx.repeat_interleave(next_n).view(-1, 1)
        write_ninf = (cols >= causal_end) & (cols < limit)
        result = torch.where(write_ninf, torch.full_like(result, float("-inf")), result)
    elif contract != "flydsl":
        raise ValueError(f"unknown contract {contract!r}")
    out_logits.copy_(result)
    return out_logits


@dataclass
class PagedProblem:
    """A synthetic decode-logits problem in vLLM's argument layout."""

    q_fp8: torch.Tensor  # (B, next_n, H, D) e4m3fn
    kv_cache: torch.Tensor  # (num_blocks, KVB, 1, D + 4) uint8
    weights: torch.Tensor  # (B*next_n, H) float32
    context_lens: torch.Tensor  # (B, next_n) or (B, 1) int32
    block_tables: torch.Tensor  # (B, max_blocks) int32
    max_model_len: int
    block_size: int
    preshuffle: bool

    @property
    def batch(self) -> int:
        return self.q_fp8.shape[0]

    @property
    def next_n(self) -> int:
        return self.q_fp8.shape[1]

    def call_args(self) -> tuple:
        """``rocm_fp8_paged_mqa_logits``'s positional arguments for this problem."""
        return (
            self.q_fp8,
            self.kv_cache,
            self.weights,
            self.context_lens,
            self.block_tables,
            None,
            self.max_model_len,
        )

    def reference_logits(self, out: torch.Tensor, contract: Contract) -> torch.Tensor:
        """This problem's logits into ``out`` under one kernel's write contract."""
        q, kv, weights, lens, tables, _, max_model_len = self.call_args()
        return fp8_paged_mqa_logits_reference(
            q, kv, weights, out, lens, tables, max_model_len, preshuffle=self.preshuffle, contract=contract
        )

    @property
    def kv_bytes(self) -> int:
        """Distinct KV bytes the problem's block tables reference."""
        kvb = self.block_size
        lens = per_sequence_lens(self.context_lens, self.batch).tolist()
        blocks = sum((n + kvb - 1) // kvb for n in lens)
        return blocks * self.kv_cache.shape[1] * self.kv_cache.shape[-1]


def mtp_bounds(seq_lens: torch.Tensor, next_n: int, compress_ratio: int = 1) -> torch.Tensor:
    """vLLM's native-MTP bounds table: ``[b, j] = max(0, L_b - next_n + j + 1) // ratio``."""
    j = torch.arange(next_n, device=seq_lens.device).view(1, -1)
    table = (seq_lens.view(-1, 1).to(torch.int64) - next_n + j + 1).clamp_min(0)
    return (table // compress_ratio).to(torch.int32)


def make_paged_problem(
    seq_lens: list[int] | torch.Tensor,
    *,
    next_n: int,
    heads: int,
    head_dim: int,
    block_size: int,
    preshuffle: bool,
    max_model_len: int | None = None,
    spare_blocks: int = 2,
    per_row_bounds: bool = True,
    compress_ratio: int = 1,
    pool_blocks: int | None = None,
    block_table_width: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> PagedProblem:
    """Build a paged indexer problem from random float keys.

    * one distinct physical block per logical block, under a shuffled table;
    * ``spare_blocks`` extra physical blocks filled with random bytes;
    * ``context_lens`` is vLLM's ``(B, next_n)`` table when ``per_row_bounds``,
      else ``(B, 1)`` per-sequence lengths. ``seq_lens`` are the lengths
      including the new tokens; with ``compress_ratio > 1`` the cache holds
      ``L_b // ratio`` compressed tokens and the bounds are floor-divided, as
      vLLM's DeepSeek V4 path does.
    * ``pool_blocks`` and ``block_table_width`` fix the cache and table shapes
      (for graph replay on fresh inputs); by default they fit the lengths.
    """
    device = torch.device(device)
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    full_lens = torch.as_tensor(seq_lens, dtype=torch.int64).cpu()
    lens = full_lens // compress_ratio
    batch = lens.numel()
    blocks_per_seq = ((lens + block_size - 1) // block_size).clamp_min(1)
    max_blocks = int(blocks_per_seq.max()) if block_table_width is None else block_table_width
    if max_model_len is None:
        max_model_len = max_blocks * block_size
    needed = int(blocks_per_seq.sum())
    num_blocks = needed + spare_blocks if pool_blocks is None else pool_blocks
    if num_blocks < needed or max_blocks < int(blocks_per_seq.max()):
        raise ValueError("pool_blocks or block_table_width too small for these lengths")

    # Bulk random data is drawn on the target device (fast on a GPU), seeded from ``gen``.
    bulk = gen
    if device.type != "cpu":
        bulk = torch.Generator(device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    keys = torch.randn(needed, block_size, head_dim, generator=bulk, device=device)
    # Vary magnitudes per token so scales differ.
    keys = keys * torch.rand(needed, block_size, 1, generator=bulk, device=device).mul(4).add(0.25)
    k_fp8, scale = quantize_keys(keys)
    used = pack_blocks(k_fp8, scale, preshuffle=preshuffle)
    pool = (num_blocks, block_size, 1, head_dim + SCALE_BYTES)
    cache = torch.randint(0, 256, pool, dtype=torch.uint8, generator=bulk, device=device)
    physical = torch.randperm(num_blocks, generator=gen)[:needed]
    cache[physical.to(device)] = used

    block_tables = torch.randint(0, num_blocks, (batch, max_blocks), dtype=torch.int32, generator=gen)
    cursor = 0
    for b in range(batch):
        n = int(blocks_per_seq[b])
        block_tables[b, :n] = physical[cursor : cursor + n].to(torch.int32)
        cursor += n

    q = torch.randn(batch, next_n, heads, head_dim, generator=gen)
    q_fp8 = q.clamp(-FP8_E4M3FN_MAX, FP8_E4M3FN_MAX).to(torch.float8_e4m3fn)
    weights = torch.randn(batch * next_n, heads, generator=gen) * heads**-0.5
    if per_row_bounds:
        context_lens = mtp_bounds(full_lens, next_n, compress_ratio)
    else:
        context_lens = lens.to(torch.int32).view(batch, 1)

    return PagedProblem(
        q_fp8=q_fp8.to(device),
        kv_cache=cache.to(device),
        weights=weights.to(device),
        context_lens=context_lens.to(device),
        block_tables=block_tables.to(device),
        max_model_len=max_model_len,
        block_size=block_size,
        preshuffle=preshuffle,
    )


# The two contracts below repeat the kernels' signatures and argument checks on purpose (duplicates lists
# them as a pair): each is a faithful, separate witness of one kernel, not shared code.
def gluon_contract_reference(
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    kv_indices,
    max_model_len,
    Preshuffle=False,
    KVBlockSize=1,
    **_tuning,
) -> torch.Tensor:
    """Gluon's contract with ``deepgemm_fp8_paged_mqa_logits``'s signature (reference, not a kernel)."""
    return fp8_paged_mqa_logits_reference(
        q_fp8,
        kv_cache,
        weights,
        out_logits,
        context_lens,
        kv_indices,
        max_model_len,
        preshuffle=Preshuffle,
        contract="gluon",
    )


FLYDSL_KNOBS = frozenset({"ChunkK", "WavePerEU", "SplitKV", "TotalCuCount", "variant", "stream"})


# The general kernel's limits below are its wrapper's own asserts, written here
# apart from kernels.Limits on purpose: this reference is the witness that
# check and the tests hold the router's rules to, so it must not share them.
def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def flydsl_contract_violation(
    q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len, *, KVBlockSize: int
) -> str | None:
    """Why the general FlyDSL kernel (aiter PR #4221) would not take these arguments, or ``None``.

    What its wrapper takes: fp8 ``q`` ``(B, next_n, H, D)`` with ``H`` a power of
    two multiple of 32 and ``D`` a power of two multiple of 64; a contiguous
    uint8 cache ``(blocks, KVBlockSize, 1, >= D + 4)``; contiguous float32
    weights ``(B*next_n, H)``; ONE int32 length per sequence (``(B,)`` or
    ``(B, 1)``); int32 block tables ``(B, max_blocks)``; a float32 output
    ``(B*next_n, max_model_len)``.
    """
    if q_fp8.dim() != 4 or q_fp8.dtype != torch.float8_e4m3fn:
        return f"q_fp8 must be float8_e4m3fn (B, next_n, H, D), got {q_fp8.dtype} {tuple(q_fp8.shape)}"
    batch, next_n, heads, head_dim = q_fp8.shape
    if not (_pow2(heads) and heads % 32 == 0 and _pow2(head_dim) and head_dim % 64 == 0):
        return f"heads={heads}, head_dim={head_dim}: not powers of two multiple of 32 and 64"
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4:
        return f"kv_cache must be uint8 (blocks, KVB, 1, dim), got {kv_cache.dtype} {tuple(kv_cache.shape)}"
    if tuple(kv_cache.shape[1:3]) != (KVBlockSize, 1) or kv_cache.shape[3] < head_dim + SCALE_BYTES:
        return (
            f"kv_cache shape {tuple(kv_cache.shape)} does not match KVBlockSize={KVBlockSize}, D={head_dim}"
        )
    if not kv_cache.is_contiguous():
        return "kv_cache is not contiguous (the kernel assumes a block stride of KVBlockSize * dim)"
    if weights.dtype != torch.float32 or tuple(weights.shape) != (batch * next_n, heads):
        return (
            f"weights must be float32 ({batch * next_n}, {heads}), got {weights.dtype} {tuple(weights.shape)}"
        )
    if not weights.is_contiguous():
        return "weights are not contiguous"
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) not in ((batch,), (batch, 1)):
        return (
            f"context_lens must be one int32 length per sequence ({batch},) or ({batch}, 1), "
            f"got {context_lens.dtype} {tuple(context_lens.shape)}"
        )
    if kv_indices.dtype != torch.int32 or kv_indices.dim() != 2 or kv_indices.shape[0] != batch:
        return (
            f"block tables must be int32 ({batch}, max_blocks), "
            f"got {kv_indices.dtype} {tuple(kv_indices.shape)}"
        )
    if out_logits.dtype != torch.float32 or tuple(out_logits.shape) != (batch * next_n, max_model_len):
        return (
            f"out_logits must be float32 ({batch * next_n}, {max_model_len}), "
            f"got {out_logits.dtype} {tuple(out_logits.shape)}"
        )
    return None


def flydsl_contract_reference(
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
    **knobs,
) -> torch.Tensor:
    """FlyDSL's contract with ``flydsl_fp8_paged_mqa_logits``'s signature (reference, not a kernel).

    Strict: it takes exactly what the general kernel's wrapper takes
    (:func:`flydsl_contract_violation`) and raises ``ValueError`` otherwise, so a
    caller that hands it the wrong thing fails instead of being fixed up.
    """
    unknown = set(knobs) - FLYDSL_KNOBS
    if unknown:
        raise TypeError(f"flydsl_fp8_paged_mqa_logits got unexpected keyword(s) {sorted(unknown)}")
    problem = flydsl_contract_violation(
        q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len, KVBlockSize=KVBlockSize
    )
    if problem is not None:
        raise ValueError(f"FlyDSL contract: {problem}")
    return fp8_paged_mqa_logits_reference(
        q_fp8,
        kv_cache,
        weights,
        out_logits,
        context_lens,
        kv_indices,
        max_model_len,
        preshuffle=Preshuffle,
        contract="flydsl",
    )


# The gfx950 kernels' contracts, as aiter's wrappers state them (module constants and asserts of
# aiter's ``fp8_paged_mqa_logits_gfx950.py``, later and earlier revisions), written here apart from
# kernels.Limits and identification on purpose: tests/test_check_variants.py pins them against the
# doubles and what identification reads from them.
@dataclass(frozen=True)
class VariantContract:
    """One FlyDSL API's contract: what its wrapper refuses, and the SplitKV its launch must carry."""

    name: str
    heads: frozenset[int] | None  # None: a power of two multiple of 32 (the general kernel)
    head_dim: int | None
    block_size: int | None
    index_dim: int | None
    max_next_n: int | None
    # Workgroups per CU of the SplitKV every graph-safe launch passes; None: it takes no SplitKV.
    split_kv_wg_per_cu: int | None
    # The later wrapper: only an explicit SplitKV (its automatic one reads device memory on the
    # host), contiguous q and cache. The earlier one reads q at its strides and copies the cache.
    strict: bool = False


GENERAL = VariantContract("general", None, None, None, None, None, None)
GFX950 = VariantContract("gfx950", frozenset({32}), 128, 64, 132, 8, 3, strict=True)
VARIANT_CONTRACTS = (GENERAL, GFX950)
GFX950_KNOBS = frozenset({"next_n_lens", "SplitKV", "TotalCuCount", "stream"})


def gfx950_contract_violation(
    contract: VariantContract,
    q_fp8,
    kv_cache,
    weights,
    out_logits,
    context_lens,
    kv_indices,
    max_model_len,
    **knobs,
) -> str | None:
    """Why a gfx950 wrapper (``contract``) would refuse these arguments, or ``None``.

    Its asserts: Preshuffle, fixed heads/head_dim/KVBlockSize/index_dim, ``1 <= next_n <=``
    its maximum, native e4m3 q (contiguous for the later revision), a uint8 cache, float32
    ``(B*next_n, H)`` weights, one length per sequence; no ChunkK/WavePerEU/variant; the later
    one also a contiguous cache and an explicit SplitKV.
    """
    unknown = set(knobs) - GFX950_KNOBS - {"Preshuffle", "KVBlockSize"}
    if unknown:
        return f"unexpected keyword(s) {sorted(unknown)} (TypeError)"
    if not knobs.get("Preshuffle", True):
        return "Preshuffle=False is not supported"
    if q_fp8.dim() != 4 or q_fp8.dtype != torch.float8_e4m3fn:
        return "q_fp8 must be native e4m3 (B, next_n, H, D)"
    batch, next_n, heads, head_dim = q_fp8.shape
    block_size = knobs.get("KVBlockSize", contract.block_size)
    if not 1 <= next_n <= contract.max_next_n:
        return f"next_n={next_n} outside 1..{contract.max_next_n}"
    if heads not in contract.heads or head_dim != contract.head_dim or block_size != contract.block_size:
        return f"unsupported heads={heads} head_dim={head_dim} KVBlockSize={block_size}"
    if not q_fp8.is_contiguous():
        # The earlier wrapper does not refuse it, but reads q in dwords at its strides assuming a
        # dense head_dim: wrong values, so its reference refuses it too.
        return "q_fp8 must be contiguous"
    block = (contract.block_size, 1, contract.index_dim)
    if kv_cache.dtype != torch.uint8 or tuple(kv_cache.shape[1:]) != block:
        return f"kv_cache must be uint8 (*, {contract.block_size}, 1, {contract.index_dim})"
    if contract.strict and not kv_cache.is_contiguous():
        return "kv_cache must be contiguous"
    if weights.dtype != torch.float32 or weights.numel() != batch * next_n * heads:
        return "weights must be float32 (B*next_n, heads)"
    if context_lens.numel() != batch:
        return "context_lens must hold one length per sequence"
    if out_logits.shape[0] != batch * next_n:
        return "out_logits has the wrong number of rows"
    split_kv = knobs.get("SplitKV")
    if split_kv is None and contract.strict:
        return "no explicit SplitKV: the automatic one reads context_lens on the host (a sync)"
    if split_kv is not None and split_kv < 1:
        return "SplitKV must be >= 1"
    return None


def contract_violation(contract: VariantContract, *args, **knobs) -> str | None:
    """Why ``contract``'s wrapper would refuse this launch, or ``None`` (kernel arguments, then knobs)."""
    if contract.split_kv_wg_per_cu is None:
        unknown = set(knobs) - FLYDSL_KNOBS - {"Preshuffle", "KVBlockSize"}
        if unknown:
            return f"unexpected keyword(s) {sorted(unknown)} (TypeError)"
        return flydsl_contract_violation(*args, KVBlockSize=knobs.get("KVBlockSize", 1))
    return gfx950_contract_violation(contract, *args, **knobs)


def variant_reference(contract: VariantContract):
    """A reference kernel shaped like ``contract``'s wrapper: it raises ``ValueError`` for what that
    wrapper refuses, else writes the FlyDSL contract (pure torch, not a kernel)."""

    def reference(
        q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len, **knobs
    ) -> torch.Tensor:
        problem = contract_violation(
            contract, q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len, **knobs
        )
        if problem is not None:
            raise ValueError(f"{contract.name} FlyDSL contract: {problem}")
        return fp8_paged_mqa_logits_reference(
            q_fp8,
            kv_cache.contiguous(),  # the earlier gfx950 wrapper copies a strided cache
            weights,
            out_logits,
            context_lens.reshape(q_fp8.shape[0]),
            kv_indices,
            max_model_len,
            preshuffle=knobs.get("Preshuffle", False),
            contract="flydsl",
        )

    reference.__name__ = f"{contract.name.replace('-', '_')}_contract_reference"
    return reference


def expected_split_kv(cus: int, batch: int, max_model_len: int, block_size: int, wg_per_cu: int) -> int:
    """aiter's dispatcher's SplitKV, written from its source: ``max(1, min(pages, ceil(cus*wg/batch)))``."""
    pages = (max_model_len + block_size - 1) // block_size
    return max(1, min(pages, (cus * wg_per_cu + batch - 1) // batch))
