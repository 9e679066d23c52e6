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


def compare_in_windows(
    expected: torch.Tensor, actual: torch.Tensor, ends: torch.Tensor, topk: int = DEFAULT_TOPK
) -> Agreement:
    """Compare two logits buffers over ``[0, ends[r])`` of every row ``r``."""
    rows = expected.shape[0]
    width = expected.shape[1]
    ends = ends.to(expected.device).clamp_max(width)
    cols = torch.arange(width, device=expected.device).view(1, -1)
    inside = cols < ends.view(-1, 1)
    e = expected.float()
    a = actual.float()
    nan_free = not bool(torch.isnan(e[inside]).any() or torch.isnan(a[inside]).any())
    e_ninf = torch.isneginf(e) & inside
    a_ninf = torch.isneginf(a) & inside
    mask_equal = torch.equal(e_ninf, a_ninf)
    finite = inside & torch.isfinite(e) & torch.isfinite(a)
    per_row = []
    max_rel = 0.0
    for r in range(rows):
        sel = finite[r]
        if bool(sel.any()):
            max_rel = max(max_rel, relative_difference(e[r][sel], a[r][sel]))
        per_row.append(int(ends[r]))
    topk_equal = True
    neg_inf = torch.tensor(float("-inf"), device=e.device)
    for r, end in enumerate(per_row):
        if end == 0:
            continue
        k = min(topk, end)
        er = torch.where(inside[r], torch.nan_to_num(e[r], nan=float("-inf")), neg_inf)
        ar = torch.where(inside[r], torch.nan_to_num(a[r], nan=float("-inf")), neg_inf)
        ev, ei = er.topk(k)
        av, ai = ar.topk(k)
        eset = set(ei[torch.isfinite(ev)].tolist())
        aset = set(ai[torch.isfinite(av)].tolist())
        if eset != aset:
            topk_equal = False
            break
    return Agreement(
        rows=rows,
        read_columns=int(sum(per_row)),
        max_rel_diff=max_rel,
        mask_equal=mask_equal,
        topk_equal=topk_equal,
        nan_free=nan_free,
    )


def make_verifier(tolerance: float = REAL_KERNEL_TOLERANCE, topk: int = DEFAULT_TOPK):
    """A verify-on-enable callback for :class:`~vllm_flydsl_indexer.router.FlyDSLRouter`."""

    def verify(
        stock: torch.Tensor, flydsl: torch.Tensor, context_lens: torch.Tensor, next_n: int
    ) -> str | None:
        ends = read_window_ends(context_lens, stock.shape[0], next_n)
        result = compare_in_windows(stock, flydsl, ends, topk)
        return None if result.ok(tolerance) else result.describe()

    return verify
