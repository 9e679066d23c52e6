# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer check``: prove the two arms agree on this machine.

Each case (:mod:`vllm_flydsl_indexer.tools.cases`) builds a paged problem in vLLM's
layout and runs it twice into a NaN-poisoned output buffer: through the stock
function, and through the patched function as serving installs it, called
from the case's call site (:mod:`vllm_flydsl_indexer.tools.paths`: vLLM's own
function where vLLM would run aiter's Gluon here, else the mirror). One router
serves every case, as one process serves every layer, so a verdict memoised
wrongly shows. A case passes only when:

* the arm the router took is the one the rules require;
* the FlyDSL kernel did not raise (the router's exception net would hide it);
* every column vLLM's consumers read agrees (:mod:`vllm_flydsl_indexer.agreement`);
* when FlyDSL ran, it wrote exactly the columns that are read.

Then the router-behaviour cases (:mod:`vllm_flydsl_indexer.tools.behaviour`),
each a fresh router over a few calls in order, always on the reference
contracts: a tuned table followed, the verify-on-enable canary passing and
catching a wrong FlyDSL arm, and a kernel that raises sent to stock for good.

Exit status is non-zero on any failure.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass

import torch

from vllm_flydsl_indexer.agreement import REAL_KERNEL_TOLERANCE, compare_in_windows, read_window_ends
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.tools import behaviour, cli_args
from vllm_flydsl_indexer.tools.arms import Arms, detect_arms
from vllm_flydsl_indexer.tools.cases import (
    BLOCKS,
    CALLER_LABELS,
    Case,
    bounds_cases,
    build_problem,
    expected_arm,
    model_cases,
    mtp_next_n,
)
from vllm_flydsl_indexer.tools.models import BY_NAME, ModelShape
from vllm_flydsl_indexer.tools.paths import Paths, build_paths
from vllm_flydsl_indexer.tools.progress import Progress
from vllm_flydsl_indexer.tools.reference import PagedProblem
from vllm_flydsl_indexer.tools.table import format_table

__all__ = ["main"]

BOUNDS_CASE_MODEL = "glm-5"


@dataclass
class CaseResult:
    case: Case
    expected: str
    arm: str
    rows: int
    read_columns: int
    written_columns: int
    max_rel_diff: float
    mask_equal: bool
    topk_equal: bool
    nan_free: bool
    within_tolerance: bool
    kernel_error: str | None
    ok: bool
    note: str = ""


def quiet_logger() -> logging.Logger:
    """The routers' logger in ``check``: the table reports what they would log."""
    logger = logging.getLogger("vllm_flydsl_indexer.tools.check.router")
    logger.propagate = False
    logger.addHandler(logging.NullHandler())
    return logger


def default_sizes(device: torch.device) -> tuple[int, int]:
    """(batch, context length): realistic on a GPU, scaled down on CPU."""
    return cli_args.CHECK_SIZES["cuda" if device.type == "cuda" else "cpu"]


def bounds_shape(models) -> ModelShape:
    """The model shape of the bounds and router-behaviour cases."""
    return BY_NAME[BOUNDS_CASE_MODEL if BOUNDS_CASE_MODEL in models else models[0]]


def build_cases(models, block_sizes, next_ns, batch: int, context_len: int) -> list[Case]:
    """The model cases at each of ``next_ns``; the bounds cases of MTP at the largest above 1, if any."""
    cases = model_cases(models, block_sizes, next_ns, batch, context_len)
    return cases + bounds_cases(bounds_shape(models), batch, context_len, mtp_next_n(next_ns))


def not_run_note(next_ns) -> str | None:
    """One line naming the bounds cases that ``next_ns`` leaves out, or ``None``."""
    if mtp_next_n(next_ns) is not None:
        return None
    every = bounds_cases(BY_NAME[BOUNDS_CASE_MODEL], 1, 2)
    left_out = [c.label for c in every if c.next_n > 1]
    return (
        f"note: --next-n {','.join(map(str, next_ns))} asks for no MTP, so the {len(left_out)} bounds cases "
        f"of MTP (next_n > 1) were not run ({'; '.join(left_out)}); the flattened MTP case calls with "
        "next_n 1 and ran"
    )


def run_case(
    case: Case,
    problem: PagedProblem,
    paths: Paths,
    arms: Arms,
    topk: int,
    capture_router: FlyDSLRouter,
) -> CaseResult:
    router = capture_router if case.capturing else paths.router
    variant = arms.flydsl_variant()
    expected, _ = expected_arm(case, variant)
    args = problem.call_args()
    kwargs = {"compress_ratio": case.compress_ratio} if case.compress_ratio != 1 else {}
    rows = problem.batch * problem.next_n
    poison = paths.output_buffer

    poison(rows, problem.max_model_len).fill_(float("nan"))
    try:
        stock_out = paths.stock(*args, **kwargs).clone()
    except Exception as e:  # noqa: BLE001 - vLLM's own answer to a shape no kernel takes
        stock_out = e

    taken, failed = router.calls_taken, len(router.failed)
    poison(rows, problem.max_model_len).fill_(float("nan"))
    with paths.with_dcp(router, case.dcp) if case.dcp != 1 else contextlib.nullcontext():
        try:
            patched_out = paths.patched_from(case.caller, router)(*args, **kwargs).clone()
        except Exception as e:  # noqa: BLE001
            patched_out = e
    arm = "FlyDSL" if router.calls_taken > taken else "stock"
    kernel_error = None
    if len(router.failed) > failed:
        kernel_error = f"the FlyDSL kernel raised: {next(reversed(router.failed.values()))}"
    if isinstance(stock_out, Exception) or isinstance(patched_out, Exception):
        return raised_result(case, expected, arm, rows, kernel_error, stock_out, patched_out)

    ends = read_window_ends(problem.context_lens, rows, problem.next_n)
    agreement = compare_in_windows(stock_out, patched_out, ends, topk)
    tolerance = REAL_KERNEL_TOLERANCE if arms.real else 0.0
    written = int((~torch.isnan(patched_out)).sum())
    # aiter's dispatcher may pick Gluon, whose -inf prefill writes past the read windows.
    exact_writes = arm == "stock" or variant.own_table or written == agreement.read_columns
    return CaseResult(
        case,
        expected,
        arm,
        rows,
        agreement.read_columns,
        written,
        agreement.max_rel_diff,
        agreement.mask_equal,
        agreement.topk_equal,
        agreement.nan_free,
        agreement.within(tolerance),
        kernel_error,
        ok=arm == expected and kernel_error is None and agreement.ok(tolerance) and exact_writes,
    )


def raised_result(case, expected, arm, rows, kernel_error, stock_out, patched_out) -> CaseResult:
    """A case where a call raised: it passes only if stock raised and the patched call, on stock, did too."""
    same = (
        isinstance(stock_out, Exception)
        and isinstance(patched_out, Exception)
        and type(stock_out) is type(patched_out)
        and arm == "stock"
    )
    error = kernel_error
    note = ""
    if same:
        note = (
            f"stock raised {type(stock_out).__name__} (vLLM's own answer); the patched call delegated alike"
        )
    else:
        raised = patched_out if isinstance(patched_out, Exception) else stock_out
        which = "the patched call" if raised is patched_out else "stock alone"
        error = error or f"{which} raised {type(raised).__name__}: {raised}"
    return CaseResult(
        case,
        expected,
        arm,
        rows,
        0,
        0,
        0.0,
        same,
        same,
        same,
        same,
        error,
        ok=same and arm == expected,
        note=note,
    )


def render(
    results: list[CaseResult],
    arms: Arms,
    paths: Paths,
    device: torch.device,
    note: str | None = None,
    behaviours: list[behaviour.BehaviourResult] | None = None,
) -> str:
    header = (
        "case",
        "caller",
        "bounds",
        "expected",
        "arm",
        "rows",
        "read cols",
        "written",
        "max rel diff",
        "-inf mask",
        "top-k",
        "result",
    )
    body = [
        (
            r.case.label,
            CALLER_LABELS.get(r.case.caller, r.case.caller),
            r.case.bounds,
            r.expected,
            r.arm,
            str(r.rows),
            str(r.read_columns),
            str(r.written_columns) if r.arm == "FlyDSL" else "-",
            f"{r.max_rel_diff:.2e}",
            "identical" if r.mask_equal else "DIFFERENT",
            "identical" if r.topk_equal else "DIFFERENT",
            "PASS" if r.ok else "FAIL",
        )
        for r in results
    ]
    dispatcher = arms.flydsl_variant().own_table
    lines = [
        f"stock:   {paths.label}",
        "patched: the plugin's router as serving installs it, called from each case's call site"
        + (
            "; its FlyDSL arm is aiter's tuned dispatcher (Gluon or FlyDSL per shape, by aiter's table)"
            if dispatcher
            else ""
        ),
        f"kernels: {arms.label}" + (f" [{arms.why}]" if arms.why else ""),
        f"device:  {device}; rule: the expected arm, identical -inf masks, rel diff "
        f"{'< 1e-3' if arms.real else '== 0 (exact)'}, identical top-k sets, FlyDSL writes == read columns"
        + (" (not for the dispatcher)" if dispatcher else ""),
        "",
        *format_table([header, *body]),
    ]
    for r in results:
        if r.note:
            lines.append(f"note {r.case.label}: {r.note}")
        if r.kernel_error:
            lines.append(f"FAIL {r.case.label}: {r.kernel_error}")
        elif r.arm != r.expected:
            lines.append(f"FAIL {r.case.label}: took {r.arm}, the rules require {r.expected}")
        elif not r.ok:
            problems = [
                "" if r.within_tolerance else "max rel diff above the rule",
                "" if r.mask_equal else "-inf masks differ",
                "" if r.topk_equal else "top-k sets differ",
                "" if r.nan_free else "NaN (unwritten) values read",
                "" if r.arm == "stock" or r.written_columns == r.read_columns else "written != read columns",
            ]
            lines.append(f"FAIL {r.case.label}: the arms disagree ({', '.join(p for p in problems if p)})")
    if note:
        lines.append(note)
    behaviours = behaviours or []
    if behaviours:
        lines += ["", behaviour.HEADER, *format_table(behaviour.table(behaviours))]
        lines += behaviour.fail_lines(behaviours)
    passed = sum(r.ok for r in results) + sum(r.ok for r in behaviours)
    lines += ["", f"{passed} passed, {len(results) + len(behaviours) - passed} failed"]
    return "\n".join(lines)


def main(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch, context = default_sizes(device)
    batch = args.batch or batch
    context = args.context_len or context
    next_ns = args.next_n or cli_args.CHECK_NEXT_NS
    topk = args.topk or cli_args.DEFAULT_TOPK
    models = list(BY_NAME) if args.model == "all" else [args.model]
    cases = build_cases(models, args.block_size or BLOCKS, next_ns, batch, context)
    arms = detect_arms(device, force_reference=args.reference)
    max_rows = max(c.batch * max(c.next_n, c.flattened) for c in cases)
    paths = build_paths(arms, device, max_rows, context, quiet_logger())
    capture_router = paths.make_router(is_capturing=lambda: True)
    results: list[CaseResult] = []
    problems: dict[str, PagedProblem] = {}
    with Progress(len(cases) + len(behaviour.BEHAVIOURS), "check") as progress:
        with paths.session():
            for i, case in enumerate(cases):
                progress.step(case.label)
                gen = torch.Generator().manual_seed(args.seed + i)
                like = problems.get(case.same_shapes_as) if case.same_shapes_as else None
                problem = build_problem(case, gen, device, like)
                problems[case.label] = problem
                results.append(run_case(case, problem, paths, arms, topk, capture_router))
        shape = bounds_shape(models)
        behaviours = behaviour.run_behaviours(
            shape.heads, shape.head_dim, device, topk, args.seed + len(cases), quiet_logger(), progress.step
        )
    print(render(results, arms, paths, device, not_run_note(next_ns), behaviours))
    if not all(r.ok for r in results) or not all(r.ok for r in behaviours):
        print("check: FAILED (see the FAIL rows)", file=sys.stderr)
        return 1
    return 0
