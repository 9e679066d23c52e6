# SPDX-License-Identifier: Apache-2.0
"""``check``'s cases: every bounds shape vLLM builds, and the arm the rules require for each.

Two kinds of case:

* **Model cases:** each model's indexer shape at KVBlockSize 64 (preshuffled,
  vLLM's layout) and 1, next_n 1 and 2, from the defining module's indexer.
* **Bounds cases** (at the 32-head shape, KVBlockSize 64): native and
  flattened MTP, padding rows of length 0, DeepSeek-V4.1's compressed bounds
  (ratio 1 then ratio 2 with identical shapes, and C4A), GLM-5-next's kpool
  pooled bounds (also with every shape of DeepSeek-V4.1's ratio-1 MTP call, so
  only the caller differs), simulated DCP 2, a strided cache, a first call during graph
  capture, ``next_n`` 2 with ``(B, 1)`` bounds, and a head count no kernel takes.
  Those of MTP run at the largest ``next_n`` above 1 that ``check`` was given
  (2 by default), and not at all when it was given ``next_n`` 1 only.

The expected arm is written here from what each case is, independently of the
router in :mod:`vllm_flydsl_indexer.router`: a router bug shows as a case
whose arm differs from the expected one.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from vllm_flydsl_indexer.kernels import KernelVariant
from vllm_flydsl_indexer.target import SCALE_BYTES
from vllm_flydsl_indexer.tools.models import BY_NAME, ModelShape
from vllm_flydsl_indexer.tools.reference import PagedProblem, make_paged_problem, mtp_bounds
from vllm_flydsl_indexer.tools.settings import CHECK_BLOCKS, CHECK_BOUNDS_BLOCK

__all__ = [
    "BLOCKS",
    "CALLER_LABELS",
    "Case",
    "DCP_SIZE",
    "DSV41",
    "INDEXER",
    "KPOOL",
    "KPOOL_RATIO",
    "ONE_APART_CALLERS",
    "Shape",
    "UNSUPPORTED_HEADS",
    "bounds_cases",
    "build_problem",
    "expected_arm",
    "model_cases",
    "mtp_next_n",
    "sequence_lengths",
]

# (KVBlockSize, Preshuffle): vLLM's production layout, and the plain one.
BLOCKS = CHECK_BLOCKS

INDEXER = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"
DSV41 = "vllm.models.deepseek_v41.amd.ops.sparse_indexer"
KPOOL = "vllm.models.glm5next.amd.sparse_indexer"
CALLER_LABELS = {INDEXER: "indexer", DSV41: "DSV4.1", KPOOL: "GLM-5-next kpool"}
# Call sites whose (B, next_n) bounds are vLLM's one-apart native-MTP table
# when they pass compress_ratio 1 (written from vLLM's source, not from callers.py).
ONE_APART_CALLERS = frozenset({INDEXER, DSV41})
KPOOL_RATIO = 4
DCP_SIZE = 2
UNSUPPORTED_HEADS = 24


@dataclass(frozen=True)
class Shape:
    """One problem's sizes: what check's cases and bench's grid both vary."""

    heads: int
    head_dim: int
    block_size: int
    next_n: int
    batch: int
    context_len: int


@dataclass(frozen=True, kw_only=True)
class Case(Shape):
    label: str
    caller: str = INDEXER
    bounds: str = "per row"
    # What the call passes, and the simulated process around it.
    compress_ratio: int = 1
    dcp: int = 1
    capturing: bool = False
    strided: bool = False
    # How the problem's bounds are built.
    kind: str = "mtp"
    cache_ratio: int = 1
    preshuffle: bool = True
    padding: bool = False
    same_shapes_as: str | None = None
    flattened: int = 2  # tokens per sequence of the flattened case

    @property
    def per_row_table(self) -> bool:
        return self.kind != "per-sequence"


def expected_arm(case: Case, variant: KernelVariant) -> tuple[str, str]:
    """``("FlyDSL" | "stock", why)``: the arm the rules require for ``case``."""
    if case.compress_ratio == 4 and case.block_size > 1:
        return "stock", "C4A: vLLM's own Triton route"
    if case.strided:
        return "stock", "strided cache (block-outer layout)"
    limit = variant.shape_violation(
        case.heads,
        case.head_dim,
        case.block_size,
        variant.index_dim or case.head_dim + SCALE_BYTES,
        case.next_n,
    )
    if limit is not None:
        return "stock", f"the {variant.name} kernel does not take it"
    if case.next_n > 1:
        if not case.per_row_table:
            return "stock", "one bound per sequence over next_n rows"
        if case.caller not in ONE_APART_CALLERS:
            return "stock", "bounds not one apart (unaudited caller)"
        if case.compress_ratio != 1:
            return "stock", "compressed bounds"
        if case.dcp != 1:
            return "stock", "DCP-localised bounds"
    if variant.dispatch_objection is not None and variant.dispatch_objection(
        _shapes_only(case), case.block_size > 1
    ):
        return "stock", "aiter's dispatcher picks Gluon: vLLM's own call runs"
    if case.capturing:
        return "stock", "first seen during graph capture"
    return "FlyDSL", "eligible"


def _shapes_only(case: Case) -> tuple:
    """The case's call as contiguous meta tensors: what aiter's dispatcher reads (shapes, dtypes, strides)."""
    rows = case.batch * case.next_n

    def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    return (
        meta(case.batch, case.next_n, case.heads, case.head_dim, dtype=torch.float8_e4m3fn),
        meta(1, case.block_size, 1, case.head_dim + SCALE_BYTES, dtype=torch.uint8),
        meta(rows, case.heads, dtype=torch.float32),
        meta(case.batch, case.next_n, dtype=torch.int32),
        meta(case.batch, 1, dtype=torch.int32),
        None,
        case.context_len,
    )


def model_cases(models, block_sizes, next_ns, batch: int, context_len: int) -> list[Case]:
    return [
        Case(
            BY_NAME[m].heads,
            BY_NAME[m].head_dim,
            bs,
            n,
            batch,
            context_len,
            label=f"{BY_NAME[m].label} KVB={bs} {'preshuffle' if bs > 1 else 'plain'} next_n={n}",
            bounds=f"(B, {n}) one apart" if n > 1 else "(B, 1)",
            preshuffle=bs > 1,
        )
        for m, bs, n in itertools.product(models, block_sizes, next_ns)
    ]


def bounds_cases(model: ModelShape, batch: int, context_len: int, mtp: int | None = 2) -> list[Case]:
    """Every bounds shape vLLM builds; those of MTP (``next_n > 1``) at ``next_n = mtp``, none if ``None``."""
    base = Case(
        model.heads, model.head_dim, CHECK_BOUNDS_BLOCK, 1, batch, context_len, label="", bounds="(B, 1)"
    )
    n = mtp or 2  # the flattened case calls with next_n 1 whatever MTP's next_n was

    def case(label: str, **changes) -> Case:
        return dataclasses.replace(base, label=label, **changes)

    mtp_cases = [
        case("padding rows of length 0", next_n=n, padding=True, bounds=f"(B, {n}), zeros"),
        case(f"DSV4.1 ratio 1 next_n={n}", next_n=n, caller=DSV41, bounds=f"(B, {n}) one apart"),
        case(
            f"DSV4.1 ratio 2 next_n={n} (same shapes)",
            next_n=n,
            caller=DSV41,
            compress_ratio=2,
            cache_ratio=2,
            same_shapes_as=f"DSV4.1 ratio 1 next_n={n}",
            bounds=f"(B, {n}) // 2",
        ),
        case(
            f"GLM-5-next kpool next_n={n}",
            next_n=n,
            caller=KPOOL,
            cache_ratio=KPOOL_RATIO,
            bounds=f"(B, {n}) // 4",
        ),
        case(
            f"DCP 2 next_n={n} (simulated)", next_n=n, dcp=DCP_SIZE, kind="dcp", bounds=f"(B, {n}) localised"
        ),
        case(f"next_n={n} with (B, 1) bounds", next_n=n, kind="per-sequence", bounds="(B, 1) per sequence"),
        # The kpool caller with every tensor shape and argument of an audited caller's call that
        # FlyDSL took: only the caller tells them apart, so a verdict memoised without it shows.
        case(
            f"GLM-5-next kpool next_n={n} (DSV4.1's shapes)",
            next_n=n,
            caller=KPOOL,
            cache_ratio=KPOOL_RATIO,
            same_shapes_as=f"DSV4.1 ratio 1 next_n={n}",
            bounds=f"(B, {n}) // 4",
        ),
    ]
    cases = [
        case(
            "flattened MTP (one row per token)", kind="flattened", flattened=n, bounds=f"({n}B, 1) per token"
        ),
        *mtp_cases[:3],
        case("DSV4.1 ratio 2 next_n=1", caller=DSV41, compress_ratio=2, cache_ratio=2, bounds="(B, 1) // 2"),
        case(
            "DSV4.1 C4A ratio 4 (block-flat)",
            caller=DSV41,
            compress_ratio=4,
            cache_ratio=4,
            preshuffle=False,
            bounds="(B, 1) // 4",
        ),
        mtp_cases[3],
        mtp_cases[6],
        case("GLM-5-next kpool next_n=1", caller=KPOOL, cache_ratio=KPOOL_RATIO, bounds="(B, 1) // 4"),
        mtp_cases[4],
        case("DCP 2 next_n=1 (simulated)", dcp=DCP_SIZE, kind="dcp", bounds="(B, 1) localised"),
        case("strided cache (block-outer layout)", strided=True),
        case("first call during graph capture", capturing=True),
        mtp_cases[5],
        case(f"heads={UNSUPPORTED_HEADS} (no kernel takes it)", heads=UNSUPPORTED_HEADS),
    ]
    return [c for c in cases if mtp is not None or c.next_n == 1]


def mtp_next_n(next_ns) -> int | None:
    """The ``next_n`` of the MTP bounds cases: the largest asked for above 1, or ``None`` (none asked)."""
    above_one = [n for n in next_ns if n > 1]
    return max(above_one) if above_one else None


def sequence_lengths(case: Case, gen: torch.Generator) -> torch.Tensor:
    """Exact, varied lengths in ``[context_len / 2, context_len]``; the last quarter 0 with ``padding``."""
    low = max(case.next_n, case.context_len // 2)
    lens = torch.randint(low, case.context_len + 1, (case.batch,), generator=gen)
    if case.padding:
        lens[case.batch - max(1, case.batch // 4) :] = 0
    return lens


def build_problem(
    case: Case, gen: torch.Generator, device: torch.device, like: PagedProblem | None = None
) -> PagedProblem:
    """``case``'s paged problem in vLLM's argument layout; with ``like``, the same tensor shapes."""
    lens = sequence_lengths(case, gen)
    common = dict(
        heads=case.heads, head_dim=case.head_dim, block_size=case.block_size, preshuffle=case.preshuffle
    )
    common |= dict(generator=gen, device=device, max_model_len=-(-case.context_len // case.cache_ratio))
    if like is not None:
        common |= dict(pool_blocks=like.kv_cache.shape[0], block_table_width=like.block_tables.shape[1])
        common |= dict(max_model_len=like.max_model_len)
    if case.kind == "dcp":
        # Rank 0 of 2 holds every other token: local lengths ceil(L / 2), bounds
        # localised per row after expansion (not one apart).
        problem = make_paged_problem((lens + 1) // DCP_SIZE, next_n=case.next_n, **common)
        table = (mtp_bounds(lens, case.next_n).to(torch.int64) + 1) // DCP_SIZE
        return dataclasses.replace(problem, context_lens=table.to(torch.int32).to(device))
    if case.kind == "flattened":
        problem = make_paged_problem(lens, next_n=case.flattened, **common)
        batch, next_n, heads, head_dim = problem.q_fp8.shape
        return dataclasses.replace(
            problem,
            q_fp8=problem.q_fp8.reshape(batch * next_n, 1, heads, head_dim),
            context_lens=problem.context_lens.reshape(batch * next_n, 1),
            block_tables=problem.block_tables.repeat_interleave(next_n, dim=0),
        )
    problem = make_paged_problem(
        lens, next_n=case.next_n, per_row_bounds=case.per_row_table, compress_ratio=case.cache_ratio, **common
    )
    if case.strided:
        # Another layer's page interleaved in every block, as block-outer layouts do.
        kv = problem.kv_cache
        both = torch.randint(0, 256, (kv.shape[0], 2, *kv.shape[1:]), dtype=torch.uint8, device=device)
        both[:, 0] = kv
        problem = dataclasses.replace(problem, kv_cache=both[:, 0])
    return problem
