# SPDX-License-Identifier: Apache-2.0
"""The agreement rule between the two arms, inside the columns vLLM reads.

Used by the tests, ``check``, ``bench``'s correctness gate and the
verify-on-enable canary, so that all of them judge by one rule:

* the ``-inf`` masks are identical inside every read window;
* ``1 - 2*sum(xy) / sum(x^2 + y^2) < 1e-3`` over the finite entries (exact
  equality between reference contracts);
* the top-k index sets over each read window are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_flydsl_indexer.target import INDEX_TOPK

__all__ = [
    "Agreement",
    "CHUNK_ELEMENTS",
    "DEFAULT_TOPK",
    "REAL_KERNEL_TOLERANCE",
    "compare_in_windows",
    "make_verifier",
    "read_window_ends",
    "relative_difference",
]

REAL_KERNEL_TOLERANCE = 1e-3
DEFAULT_TOPK = INDEX_TOPK


def read_window_ends(context_lens: torch.Tensor, rows: int, next_n: int) -> torch.Tensor:
    """Exclusive end of the columns vLLM's consumers read, per logits row.

    ``bounds.reshape(-1)`` when it holds one entry per row; otherwise one entry
    per sequence, repeated ``next_n`` times (as V4.1's candidate selection does).
    """
    flat = context_lens.reshape(-1).to(torch.int64)
    if flat.numel() != rows:
        flat = flat.repeat_interleave(next_n)
    return flat.clamp_min(0)


def relative_difference(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2*sum(xy) / sum(x^2 + y^2)`` in float64; 0 for two empty inputs."""
    x = x.double()
    y = y.double()
    denom = (x * x + y * y).sum()
    if denom.item() == 0:
        return 0.0 if torch.equal(x, y) else 1.0
    return float(1 - 2 * (x * y).sum() / denom)


@dataclass
class Agreement:
    rows: int
    read_columns: int
    max_rel_diff: float
    mask_equal: bool
    topk_equal: bool
    nan_free: bool

    def within(self, tolerance: float) -> bool:
        """The relative difference is inside the rule (exactly 0 when ``tolerance`` is 0)."""
        return self.max_rel_diff == 0.0 if tolerance == 0 else self.max_rel_diff < tolerance

    def ok(self, tolerance: float) -> bool:
        return self.mask_equal and self.topk_equal and self.nan_free and self.within(tolerance)

    def describe(self) -> str:
        return (
            f"max rel diff {self.max_rel_diff:.3e}, -inf mask "
            f"{'identical' if self.mask_equal else 'DIFFERENT'}, top-k "
            f"{'identical' if self.topk_equal else 'DIFFERENT'}"
            f"{'' if self.nan_free else ', NaN or unwritten values read'}"
        )


# Logits entries the comparison handles at once (whole rows, at least one): bounds its temporaries.
CHUNK_ELEMENTS = 1 << 16


def compare_in_windows(
    expected: torch.Tensor, actual: torch.Tensor, ends: torch.Tensor, topk: int = DEFAULT_TOPK
) -> Agreement:
    """Compare two logits buffers over ``[0, ends[r])`` of every row ``r``.

    Vectorised over rows, a chunk of rows at a time (:data:`CHUNK_ELEMENTS`),
    so the extra memory stays bounded whatever the row count; one host sync at
    the end. Rows whose window holds only ``-inf`` or nothing count as equal.
    """
    rows, width = expected.shape
    device = expected.device
    ends = ends.to(device).clamp(0, width)
    cols = torch.arange(width, device=device).view(1, -1)
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    k = min(topk, width)
    found_nan = torch.zeros((), dtype=torch.bool, device=device)
    mask_differs = torch.zeros((), dtype=torch.bool, device=device)
    topk_differs = torch.zeros((), dtype=torch.bool, device=device)
    max_rel = torch.zeros((), dtype=torch.float64, device=device)
    neg_inf = float("-inf")
    for start in range(0, rows, step):
        e = expected[start : start + step].float()
        a = actual[start : start + step].float()
        end = ends[start : start + step].view(-1, 1)
        inside = cols < end
        found_nan |= ((torch.isnan(e) | torch.isnan(a)) & inside).any()
        mask_differs |= ((torch.isneginf(e) != torch.isneginf(a)) & inside).any()
        finite = inside & torch.isfinite(e) & torch.isfinite(a)
        x = torch.where(finite, e, 0.0).double()
        y = torch.where(finite, a, 0.0).double()
        cross = (x * y).sum(dim=1)
        norms = (x * x + y * y).sum(dim=1)
        del x, y
        # 1 - 2*sum(xy) / sum(x^2 + y^2) per row; a zero denominator means both rows are all zero.
        rel = torch.where(norms > 0, 1 - 2 * cross / norms.clamp_min(1e-300), 0.0)
        max_rel = torch.maximum(max_rel, rel.max())
        if k == 0:
            continue
        # Each row's top min(topk, window) columns, NaN read as -inf, as index sets.
        er = torch.where(inside, torch.nan_to_num(e, nan=neg_inf), neg_inf)
        ar = torch.where(inside, torch.nan_to_num(a, nan=neg_inf), neg_inf)
        ev, ei = er.topk(k, dim=1)
        av, ai = ar.topk(k, dim=1)
        del er, ar
        taken = torch.arange(k, device=device).view(1, -1) < end.clamp_max(k)
        eset = torch.where(taken & torch.isfinite(ev), ei, -1).sort(dim=1).values
        aset = torch.where(taken & torch.isfinite(av), ai, -1).sort(dim=1).values
        topk_differs |= (eset != aset).any()
    return Agreement(
        rows=rows,
        read_columns=int(ends.sum()),
        max_rel_diff=float(max_rel),
        mask_equal=not bool(mask_differs),
        topk_equal=not bool(topk_differs),
        nan_free=not bool(found_nan),
    )


def make_verifier(tolerance: float = REAL_KERNEL_TOLERANCE, topk: int = DEFAULT_TOPK):
    """A verify-on-enable callback for :class:`~vllm_flydsl_indexer.router.FlyDSLRouter`:
    ``verify(stock_rows, flydsl_rows, ends)``, ``ends`` those rows' read-window ends."""

    def verify(stock: torch.Tensor, flydsl: torch.Tensor, ends: torch.Tensor) -> str | None:
        result = compare_in_windows(stock, flydsl, ends, topk)
        return None if result.ok(tolerance) else result.describe()

    return verify
