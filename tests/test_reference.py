# SPDX-License-Identifier: Apache-2.0
"""The reference against a naive per-row, per-token oracle written from the math."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_flydsl_indexer.tools import reference as ref

POISON = 12345.0


def naive_logits(problem: ref.PagedProblem, contract: str, width: int) -> torch.Tensor:
    """Loop over rows and tokens, decoding bytes one token at a time."""
    q = problem.q_fp8.float()
    batch, next_n, heads, head_dim = q.shape
    kvb = problem.block_size
    ctx = ref.per_sequence_lens(problem.context_lens, batch).tolist()
    out = torch.full((batch * next_n, width), POISON)
    cache = problem.kv_cache.view(problem.kv_cache.shape[0], -1)
    for b in range(batch):
        for i in range(next_n):
            r = b * next_n + i
            end = ctx[b] - next_n + i + 1
            limit = ctx[b]
            if contract == "gluon" and problem.preshuffle:
                limit = math.ceil(ctx[b] / kvb) * kvb
            for t in range(width):
                if t < end:
                    blk = int(problem.block_tables[b, t // kvb])
                    tok = t % kvb
                    if problem.preshuffle:
                        idx = [
                            (tok // 16) * 16 * head_dim + (d // 16) * 256 + (tok % 16) * 16 + d % 16
                            for d in range(head_dim)
                        ]
                    else:
                        idx = [tok * head_dim + d for d in range(head_dim)]
                    k = cache[blk, idx].view(torch.float8_e4m3fn).float()
                    s0 = kvb * head_dim + tok * 4
                    scale = cache[blk, s0 : s0 + 4].view(torch.float32).item()
                    dots = (q[b, i] @ k).relu()
                    out[r, t] = (dots * problem.weights[r]).sum() * scale
                elif contract == "gluon" and t < limit:
                    out[r, t] = float("-inf")
    return out


CASES = [
    # seq_lens, next_n, kvb, preshuffle, per_row
    ([5, 0, 17], 1, 1, False, False),
    ([33, 2, 1, 40], 2, 16, True, True),
    ([20, 9], 3, 16, False, True),
    ([70, 64, 3], 2, 64, True, True),
    ([1, 4], 4, 1, False, True),
]


@pytest.mark.parametrize("contract", ["flydsl", "gluon"])
@pytest.mark.parametrize("seq_lens,next_n,kvb,preshuffle,per_row", CASES)
def test_reference_matches_naive_oracle(seq_lens, next_n, kvb, preshuffle, per_row, contract):
    gen = torch.Generator().manual_seed(hash((tuple(seq_lens), next_n, kvb, contract)) % 2**31)
    problem = ref.make_paged_problem(
        seq_lens,
        next_n=next_n,
        heads=4,
        head_dim=32,
        block_size=kvb,
        preshuffle=preshuffle,
        per_row_bounds=per_row,
        generator=gen,
    )
    width = problem.max_model_len
    expected = naive_logits(problem, contract, width)
    out = torch.full((problem.batch * next_n, width), POISON)
    ref.fp8_paged_mqa_logits_reference(
        problem.q_fp8,
        problem.kv_cache,
        problem.weights,
        out,
        problem.context_lens,
        problem.block_tables,
        problem.max_model_len,
        preshuffle=preshuffle,
        contract=contract,
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Something was written, and columns past every window kept the poison.
    assert (out != POISON).any()
    assert (out == POISON).any()


def test_pack_unpack_round_trip_and_shuffle_positions():
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(3, 32, 64, generator=gen)
    k_fp8, scale = ref.quantize_keys(keys)
    assert torch.all(scale >= ref.SCALE_FLOOR / ref.FP8_E4M3FN_MAX)
    # vLLM's rule: scale = max(amax, 1e-4) / 448.
    torch.testing.assert_close(scale, keys.abs().amax(-1).clamp_min(1e-4) / 448)
    for preshuffle in (False, True):
        blocks = ref.pack_blocks(k_fp8, scale, preshuffle=preshuffle)
        assert blocks.shape == (3, 32, 1, 68) and blocks.dtype == torch.uint8
        back, back_scale = ref.unpack_keys(blocks, 64, preshuffle=preshuffle)
        torch.testing.assert_close(back, k_fp8.float())
        torch.testing.assert_close(back_scale, scale)
    shuffled = ref.pack_blocks(k_fp8, scale, preshuffle=True).view(3, -1)
    # Token 17, dim 35 sits at (17//16)*16*64 + (35//16)*256 + (17%16)*16 + 35%16.
    pos = 1 * 16 * 64 + 2 * 256 + 1 * 16 + 3
    assert shuffled[1, pos] == k_fp8[1, 17, 35].view(torch.uint8)


def test_builder_uses_distinct_blocks_under_a_shuffled_table():
    gen = torch.Generator().manual_seed(3)
    problem = ref.make_paged_problem(
        [100, 64, 1, 0],
        next_n=2,
        heads=4,
        head_dim=64,
        block_size=16,
        preshuffle=True,
        spare_blocks=5,
        generator=gen,
    )
    used = []
    for b, n in enumerate([100, 64, 1, 0]):
        used += problem.block_tables[b, : max(1, -(-n // 16))].tolist()
    assert len(used) == len(set(used)), "a physical block is shared"
    assert used != sorted(used), "block table is not shuffled"
    assert problem.kv_cache.shape[0] == len(used) + 5
    expected = ref.mtp_bounds(torch.tensor([100, 64, 1, 0]), 2)
    assert torch.equal(problem.context_lens, expected)
    assert problem.context_lens.tolist() == [[99, 100], [63, 64], [0, 1], [0, 0]]


def test_mtp_bounds_compressed():
    bounds = ref.mtp_bounds(torch.tensor([10, 3]), 2, compress_ratio=4)
    assert bounds.tolist() == [[2, 2], [0, 0]]


class _SyncAudit(TorchDispatchMode):
    SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::equal"}

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNC_OPS:
            self.syncs.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("contract", ["flydsl", "gluon"])
def test_reference_has_no_host_sync_ops(contract):
    gen = torch.Generator().manual_seed(11)
    problem = ref.make_paged_problem(
        [40, 7],
        next_n=2,
        heads=4,
        head_dim=32,
        block_size=16,
        preshuffle=True,
        generator=gen,
    )
    out = torch.randn(4, problem.max_model_len, generator=gen)
    with _SyncAudit() as audit:
        ref.fp8_paged_mqa_logits_reference(
            problem.q_fp8,
            problem.kv_cache,
            problem.weights,
            out,
            problem.context_lens,
            problem.block_tables,
            problem.max_model_len,
            preshuffle=True,
            contract=contract,
        )
    assert audit.syncs == []


# --- the strict FlyDSL reference: it takes exactly what the general kernel's wrapper takes ---


def _flydsl_args(heads=32, next_n=2, kvb=16):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p = ref.make_paged_problem(
        [40, 23], next_n=next_n, heads=heads, head_dim=64, block_size=kvb, preshuffle=kvb > 1, generator=gen
    )
    out = torch.full((p.batch * p.next_n, p.max_model_len), float("nan"))
    lens = ref.per_sequence_lens(p.context_lens, p.batch).contiguous()
    return p, [p.q_fp8, p.kv_cache, p.weights, out, lens, p.block_tables, p.max_model_len]


def test_strict_flydsl_reference_takes_per_sequence_lengths_and_writes_the_window():
    p, args = _flydsl_args()
    out = ref.flydsl_contract_reference(*args, Preshuffle=True, KVBlockSize=16, ChunkK=128)
    ends = ref.row_windows(p.context_lens, p.batch, p.next_n)
    written = ~torch.isnan(out)
    cols = torch.arange(out.shape[1]).view(1, -1)
    assert torch.equal(written, cols < ends.view(-1, 1))
    args[4] = args[4].view(-1, 1)  # (B, 1) is one length per sequence too
    ref.flydsl_contract_reference(*args, Preshuffle=True, KVBlockSize=16)


def _break(name):
    def apply(args):
        q, kv, w, out, lens, bt, mml = args
        if name == "2-D lens":
            lens = torch.stack([lens - 1, lens], dim=1)
        elif name == "int64 lens":
            lens = lens.long()
        elif name == "strided cache":
            both = torch.stack([kv, kv], dim=1)
            kv = both[:, 0]
        elif name == "wrong KVBlockSize":
            return [q, kv, w, out, lens, bt, mml], {"KVBlockSize": 1}
        elif name == "bf16 weights":
            w = w.bfloat16()
        elif name == "weights per sequence":
            w = w[: q.shape[0]]
        elif name == "short output":
            out = out[:, :-1]
        elif name == "int64 block tables":
            bt = bt.long()
        return [q, kv, w, out, lens, bt, mml], {}

    return apply


@pytest.mark.parametrize(
    "bad",
    [
        "2-D lens",
        "int64 lens",
        "strided cache",
        "wrong KVBlockSize",
        "bf16 weights",
        "weights per sequence",
        "short output",
        "int64 block tables",
    ],
)
def test_strict_flydsl_reference_raises_on_what_the_wrapper_rejects(bad):
    _, args = _flydsl_args()
    args, override = _break(bad)(args)
    with pytest.raises(ValueError, match="FlyDSL contract"):
        ref.flydsl_contract_reference(*args, **{"Preshuffle": True, "KVBlockSize": 16, **override})


@pytest.mark.parametrize("heads", [24, 16])
def test_strict_flydsl_reference_rejects_heads_the_general_kernel_does_not_take(heads):
    _, args = _flydsl_args(heads=heads)
    with pytest.raises(ValueError, match="heads="):
        ref.flydsl_contract_reference(*args, Preshuffle=True, KVBlockSize=16)


def test_strict_flydsl_reference_rejects_unknown_keywords():
    _, args = _flydsl_args()
    with pytest.raises(TypeError, match="NextN"):
        ref.flydsl_contract_reference(*args, Preshuffle=True, KVBlockSize=16, NextN=2)
