# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer check``: prove the two arms agree on this machine.

Each case builds a synthetic paged problem in vLLM's layout, runs the stock
call and the plugin's patched call into a NaN-poisoned workspace, and applies
the agreement rule of :mod:`vllm_flydsl_indexer.agreement` inside the columns
vLLM's consumers read. Exit status is non-zero on any disagreement.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

import torch

from vllm_flydsl_indexer.agreement import REAL_KERNEL_TOLERANCE, compare_in_windows, read_window_ends
from vllm_flydsl_indexer.arms import (
    Arms,
    Workspace,
    detect_arms,
    from_defining_module,
    patched_call,
    stock_call,
)
from vllm_flydsl_indexer.progress import Progress
from vllm_flydsl_indexer.reference import make_paged_problem

# Indexer shapes of real models: name -> (heads, head_dim).
MODELS = {
    "deepseek-v3.2": (64, 128),
    "glm-5": (32, 128),  # GLM-5.x and DeepSeek-V4.1
}
MODEL_LABELS = {"deepseek-v3.2": "DeepSeek-V3.2", "glm-5": "GLM-5.x/DSV4.1"}
# (KVBlockSize, Preshuffle): vLLM's production layout, and the plain one.
BLOCKS = (64, 1)


@dataclass
class Case:
    model: str
    heads: int
    head_dim: int
    block_size: int
    next_n: int
    batch: int
    context_len: int

    @property
    def name(self) -> str:
        shuffle = "preshuffle" if self.block_size > 1 else "plain"
        return (
            f"{MODEL_LABELS[self.model]} KVB={self.block_size} {shuffle} next_n={self.next_n} "
            f"B={self.batch} ctx<={self.context_len}"
        )


@dataclass
class CaseResult:
    case: Case
    taken: bool
    rows: int
    read_columns: int
    written_columns: int
    max_rel_diff: float
    mask_equal: bool
    topk_equal: bool
    nan_free: bool
    ok: bool


def default_sizes(device: torch.device) -> tuple[int, int]:
    """(batch, context length): realistic on a GPU, scaled down on CPU."""
    return (32, 32768) if device.type == "cuda" else (4, 2048)


def build_cases(models, block_sizes, next_ns, batch, context_len) -> list[Case]:
    return [
        Case(m, *MODELS[m], bs, n, batch, context_len)
        for m, bs, n in itertools.product(models, block_sizes, next_ns)
    ]


def sequence_lengths(case: Case, gen: torch.Generator) -> list[int]:
    """Exact, varied lengths in ``[context_len / 2, context_len]``."""
    low = max(case.next_n, case.context_len // 2)
    return torch.randint(low, case.context_len + 1, (case.batch,), generator=gen).tolist()


def run_case(case: Case, arms: Arms, device: torch.device, seed: int, topk: int) -> CaseResult:
    gen = torch.Generator().manual_seed(seed)
    problem = make_paged_problem(
        sequence_lengths(case, gen),
        next_n=case.next_n,
        heads=case.heads,
        head_dim=case.head_dim,
        block_size=case.block_size,
        preshuffle=case.block_size > 1,
        max_model_len=case.context_len,
        generator=gen,
        device=device,
    )
    rows = problem.batch * problem.next_n
    workspace = Workspace(rows, problem.max_model_len, device)
    args = (
        problem.q_fp8,
        problem.kv_cache,
        problem.weights,
        problem.context_lens,
        problem.block_tables,
        None,
        problem.max_model_len,
    )
    stock = stock_call(arms.gluon, workspace)
    patched = patched_call(arms, workspace)

    workspace.buffer.fill_(float("nan"))
    stock_out = stock(*args).clone()
    workspace.buffer.fill_(float("nan"))
    patched_out = from_defining_module(patched)(*args).clone()

    ends = read_window_ends(problem.context_lens, rows, problem.next_n)
    agreement = compare_in_windows(stock_out, patched_out, ends, topk)
    tolerance = REAL_KERNEL_TOLERANCE if arms.real else 0.0
    written = int((~torch.isnan(patched_out)).sum())
    taken = patched.calls_taken == 1
    return CaseResult(
        case,
        taken,
        rows,
        agreement.read_columns,
        written,
        agreement.max_rel_diff,
        agreement.mask_equal,
        agreement.topk_equal,
        agreement.nan_free,
        ok=taken and agreement.ok(tolerance) and written == agreement.read_columns,
    )


def render(results: list[CaseResult], arms: Arms, device: torch.device) -> str:
    header = ("case", "arm", "rows", "read cols", "written", "max rel diff", "-inf mask", "top-k", "result")
    body = [
        (
            r.case.name,
            "FlyDSL" if r.taken else "stock",
            str(r.rows),
            str(r.read_columns),
            str(r.written_columns),
            f"{r.max_rel_diff:.2e}",
            "identical" if r.mask_equal else "DIFFERENT",
            "identical" if r.topk_equal else "DIFFERENT",
            "PASS" if r.ok else "FAIL",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def fmt(row):
        return "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))

    passed = sum(r.ok for r in results)
    lines = [
        f"arms:   stock = {'aiter Gluon' if arms.real else 'reference Gluon contract'}, "
        f"patched = plugin adapter -> {'aiter FlyDSL' if arms.real else 'reference FlyDSL contract'}",
        f"        {arms.label}" + (f" [{arms.why}]" if arms.why else ""),
        f"device: {device}; rule: identical -inf masks, rel diff "
        f"{'< 1e-3' if arms.real else '== 0 (exact)'}, identical top-k sets, written == read columns",
        "",
        fmt(header),
        fmt(tuple("-" * w for w in widths)),
        *[fmt(row) for row in body],
        "",
        f"{passed} passed, {len(results) - passed} failed",
    ]
    return "\n".join(lines)


def main(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch, context = default_sizes(device)
    batch = args.batch or batch
    context = args.context_len or context
    models = list(MODELS) if args.model == "all" else [args.model]
    cases = build_cases(models, args.block_size or BLOCKS, args.next_n or (1, 2), batch, context)
    arms = detect_arms(device, force_reference=args.reference)
    results = []
    with Progress(len(cases), "check") as progress:
        for i, case in enumerate(cases):
            progress.step(case.name)
            results.append(run_case(case, arms, device, args.seed + i, args.topk))
    print(render(results, arms, device))
    if not all(r.ok for r in results):
        print("check: the arms DISAGREE (see FAIL rows)", file=sys.stderr)
        return 1
    return 0
