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
* every column vLLM's consumers read agrees (the agreement rule,
  :func:`vllm_flydsl_indexer.selftest.compare_in_windows`);
* when FlyDSL ran, it wrote exactly the columns that are read.

On reference arms these cases run as the reference contract of the FlyDSL API
that :func:`~vllm_flydsl_indexer.kernels.find_kernel` found (the general
one when none, or aiter's dispatcher, was found).

Then the router-behaviour cases (:mod:`vllm_flydsl_indexer.tools.behaviour`),
each a fresh router over a few calls in order, once per FlyDSL API the plugin
knows (the found one first), always on reference contracts shaped like that
API: its limits, its SplitKV rule and launch knobs, bounds and callers, memo
collisions, Preshuffle, the i32 pool limit, a tuned table, the
per-configuration self-test passing and catching wrong, unwritten or reordered
columns, and a kernel that raises sent to stock for good.
Last, a self-test of the agreement rule itself.

The report reads: the scope, the found API, its cases, then the other APIs' cases.

Exit status is non-zero on any failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
from dataclasses import dataclass

import torch

from vllm_flydsl_indexer import envs
from vllm_flydsl_indexer.kernels import KernelVariant, find_kernel
from vllm_flydsl_indexer.router import FlyDSLRouter, describe
from vllm_flydsl_indexer.selftest import REAL_KERNEL_TOLERANCE, read_window_ends
from vllm_flydsl_indexer.target import caller_release
from vllm_flydsl_indexer.tools import behaviour, settings
from vllm_flydsl_indexer.tools.arms import Arms, detect_arms, simulated_callers, variant_order
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
from vllm_flydsl_indexer.tools.harness import compare_in_windows, device_of, quiet_logger
from vllm_flydsl_indexer.tools.interrupt import EXIT_INTERRUPTED, StopSignal, interrupted_note
from vllm_flydsl_indexer.tools.models import BY_NAME, ModelShape
from vllm_flydsl_indexer.tools.paths import Paths, build_paths
from vllm_flydsl_indexer.tools.progress import Progress
from vllm_flydsl_indexer.tools.reference import GENERAL, VARIANT_CONTRACTS, PagedProblem
from vllm_flydsl_indexer.tools.streams import safe_line
from vllm_flydsl_indexer.tools.table import WIDTH, format_table

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


def default_sizes(device: torch.device) -> tuple[int, int]:
    """(batch, context length): realistic on a GPU, scaled down on CPU."""
    return settings.CHECK_SIZES["cuda" if device.type == "cuda" else "cpu"]


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
    case: Case, problem: PagedProblem, paths: Paths, arms: Arms, topk: int, capture_router: FlyDSLRouter
) -> CaseResult:
    router = capture_router if case.capturing else paths.router
    variant = arms.flydsl_variant()
    expected, _ = expected_arm(case, variant)
    if expected == "FlyDSL" and case.next_n > 1 and not paths.stand_in(case.caller):
        expected = "FlyDSL" if caller_release(case.caller) else "stock"  # vLLM's own caller, unaudited
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
        kernel_error = f"FlyDSL failed here: {next(reversed(router.failed.values()))}"
    if isinstance(stock_out, Exception) or isinstance(patched_out, Exception):
        return raised_result(case, expected, arm, rows, kernel_error, stock_out, patched_out)

    ends = read_window_ends(problem.context_lens, rows, problem.next_n)
    agreement = compare_in_windows(stock_out, patched_out, ends, topk)
    tolerance = REAL_KERNEL_TOLERANCE if arms.real else 0.0
    written = int((~torch.isnan(patched_out)).sum())
    # aiter's dispatcher may pick Gluon, whose -inf prefill writes past the read windows.
    exact_writes = arm == "stock" or variant.own_table or written == agreement.read_columns
    ok = arm == expected and kernel_error is None and agreement.ok(tolerance) and exact_writes
    read = (agreement.read_columns, written, agreement.max_rel_diff)
    flags = (agreement.mask_equal, agreement.topk_equal, agreement.nan_free, agreement.within(tolerance))
    return CaseResult(case, expected, arm, rows, *read, *flags, kernel_error, ok)


def raised_result(case, expected, arm, rows, kernel_error, stock_out, patched_out) -> CaseResult:
    """A case where a call raised: it passes only if stock raised and the patched call, on stock, did too."""
    same = isinstance(stock_out, Exception) and type(stock_out) is type(patched_out) and arm == "stock"
    if same:
        note = (
            f"stock raised {type(stock_out).__name__} (vLLM's own answer); the patched call delegated alike"
        )
        # mask, top-k, NaN-free and tolerance all "same": both arms gave vLLM's own answer
        return CaseResult(
            case, expected, arm, rows, 0, 0, 0.0, *[True] * 4, kernel_error, arm == expected, note
        )
    raised = patched_out if isinstance(patched_out, Exception) else stock_out
    which = "the patched call" if raised is patched_out else "stock alone"
    error = kernel_error or f"{which} raised {type(raised).__name__}: {raised}"
    return CaseResult(case, expected, arm, rows, 0, 0, 0.0, *[False] * 4, error, ok=False)


Lookup = tuple[KernelVariant | None, str]  # find_kernel's answer: the variant (or None), and why


def found_line(lookup: Lookup, arms: Arms) -> str:
    """What :func:`find_kernel` found, and what the cases ran as."""
    posed = arms.flydsl_variant().name
    variant, reason = lookup
    if variant is None:
        why = reason.split("; ")[0]
        return f"found:   no FlyDSL API ({why}); the cases ran as the {posed} API's reference"
    where = f"{variant.name} ({variant.location})"
    if variant.own_table:
        return (
            f"found:   aiter's tuned dispatcher {where}: it picks Gluon or a FlyDSL API per shape by its own "
            f"table, so the router behaviour below runs on every FlyDSL API it may pick; the model and "
            f"bounds cases ran as {'the dispatcher' if arms.real else f'the {posed} API reference'}"
        )
    return f"found:   the {where} FlyDSL API; its cases come first"


SELF_TEST_SECTION = "per-configuration self-test (the patched router's, on each configuration's first call)"


def render(
    results: list[CaseResult],
    arms: Arms,
    paths: Paths,
    device: torch.device,
    note: str | None = None,
    behaviours: list[behaviour.BehaviourResult] | None = None,
    planned: int | None = None,
    lookup: Lookup | None = None,
    self_tests: list[behaviour.SelfTestResult] | None = None,
) -> str:
    """The report: scope, the found API and its cases, then the rest; ``planned``: how many
    cases were to run, when an interrupt left some out."""
    header = ("case", "caller", "bounds", "expected", "arm", "read/ written", "max rel diff")
    header += ("-inf mask, top-k", "result")  # the API is the section's heading
    variant = arms.flydsl_variant()
    body = [
        (
            r.case.label,
            CALLER_LABELS.get(r.case.caller, r.case.caller),
            r.case.bounds.replace("// ", "//"),  # wraps as "(B, 2)" and "//2"
            r.expected,
            r.arm,
            f"{r.read_columns}/{r.written_columns if r.arm == 'FlyDSL' else '-'}",
            f"{r.max_rel_diff:.2e}",
            "same"
            if r.mask_equal and r.topk_equal
            else ", ".join(
                f"{what} DIFFERENT"
                for what, same in (("mask", r.mask_equal), ("top-k", r.topk_equal))
                if not same
            ),
            "PASS" if r.ok else "FAIL",
        )
        for r in results
    ]
    dispatcher = variant.own_table
    scope = arms.label if arms.real else "reference contracts, not the real kernels"
    lines = [
        f"scope:   {arms.label}" + (f" [{arms.why}]" if arms.why else ""),
        found_line(lookup or (None, "not looked up"), arms),
        f"stock:   {paths.label}",
        "patched: the plugin's router as serving installs it, with no table (every eligible call), "
        "from each case's call site"
        + (
            "; its FlyDSL arm is aiter's tuned dispatcher (Gluon or FlyDSL per shape, by aiter's table)"
            if dispatcher
            else ""
        ),
        f"device:  {device}; rule: the expected arm, identical -inf masks, rel diff "
        f"{'< 1e-3' if arms.real else '== 0 (exact)'}, identical top-k sets, FlyDSL writes == read columns"
        + (" (not for the dispatcher)" if dispatcher else ""),
        "",
        f"model and bounds cases, as the {variant.name} API"
        + ("" if arms.real else " (its reference contract)"),
        *_table([header, *body]),
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
    enabled, error = envs.read_flag(envs.SELFTEST, default=True)
    if error:  # as doctor and register() say it; the variable's value echoed escaped and shortened
        lines += ["", safe_line(f"warning: {error}")]
    if not enabled:  # said, never a section dropped without a word
        lines += [
            "",
            SELF_TEST_SECTION,
            f"  off ({envs.SELFTEST}={os.environ.get(envs.SELFTEST, '').strip()}): the patched router ran "
            f"without it, as serving would; unset {envs.SELFTEST} to check it too",
        ]
    elif paths.router.self_tests:
        lines += ["", SELF_TEST_SECTION]
        for (shape, bounds, *context), problem in paths.router.self_tests.items():
            said = "passed" if problem is None else f"FAILED ({problem}): this configuration stays stock"
            at = f" at context {context[0]}" if context else ""
            lines.append(f"  {describe(shape)} bounds {bounds}{at}: {said}")
    behaviours = behaviours or []
    self_tests = self_tests or []
    if behaviours:
        lines += ["", behaviour.HEADER]
        found = lookup[0].name if lookup and lookup[0] else None
        for api in dict.fromkeys(r.variant for r in behaviours):  # the found API first
            ours = [r for r in behaviours if r.variant == api]
            lines += ["", f"as the {api} API" + (" (found)" if api == found else "")]
            lines += [*_table(behaviour.table(ours)), *behaviour.fail_lines(ours)]
    if self_tests:
        lines += ["", behaviour.SELF_TEST_HEADER, *_table(behaviour.self_test_table(self_tests))]
        lines += behaviour.self_test_fail_lines(self_tests)
    ran = len(results) + len(behaviours) + len(self_tests)
    passed = sum(r.ok for r in results) + sum(r.ok for r in behaviours) + sum(r.ok for r in self_tests)
    last = f"{passed} passed, {ran - passed} failed"
    if planned is not None and ran < planned:
        last += f", {planned - ran} not run ({interrupted_note(ran, planned)})"
    lines += ["", *meaning(arms.real), f"{last} ({scope})"]
    # The tables fit WIDTH; a longer line of text wraps, its continuation under its text.
    return "\n".join(part for line in lines for part in _fit(line))


class _TableLine(str):
    """A line of a table, fitted to WIDTH by :func:`format_table`: never wrapped again."""


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    return [_TableLine(line) for line in format_table(rows)]


def _fit(line: str) -> list[str]:
    if len(line) <= WIDTH or isinstance(line, _TableLine):
        return [line]
    head = line[:9]  # "scope:   ", "found:   ", ...: the text starts at column 9
    indent = " " * (9 if head.rstrip().endswith(":") and head.endswith(" ") else 2)
    return textwrap.wrap(
        line, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def meaning(real: bool) -> list[str]:
    """The lines above the count: what passed means, and where the real kernels are checked."""
    lines = ["passed means: each case took the arm the rules require, and both arms agreed on every column"]
    if real:
        return [*lines, "vLLM reads, here on the real kernels (aiter's Gluon and FlyDSL on this gfx950)"]
    return [
        *lines,
        "vLLM reads; here on the reference contracts (pure torch), not the real kernels; for those,",
        f"on an MI355X in vLLM's environment, run: {settings.REAL_CHECK}",
    ]


def lookup_kernel() -> Lookup:
    """:func:`find_kernel`, which never raises; a failure is reported as the reason."""
    try:
        return find_kernel()
    except Exception as e:  # noqa: BLE001 - check reports, never crashes on the lookup
        return None, f"lookup failed ({type(e).__name__}: {e})"


def pose_as_found(arms: Arms, lookup: Lookup) -> None:
    """Reference arms pose as the found API's reference contract (the general one if none, or the
    dispatcher, was found), unless they already carry an API."""
    if arms.real or arms.variant is not None:
        return
    name = lookup[0].name if lookup[0] is not None else None
    arms.pose_as(next((c for c in VARIANT_CONTRACTS if c.name == name), GENERAL))


def main(args) -> int:
    device = device_of(args)
    batch, context = default_sizes(device)
    batch = args.batch or batch
    context = args.context_len or context
    next_ns = args.next_n or settings.CHECK_NEXT_NS
    topk = args.topk or settings.DEFAULT_TOPK
    models = list(BY_NAME) if args.model == "all" else [args.model]
    cases = build_cases(models, args.block_size or BLOCKS, next_ns, batch, context)
    arms = detect_arms(device, force_reference=args.reference)
    lookup = lookup_kernel()
    pose_as_found(arms, lookup)
    contracts = variant_order(lookup[0].name if lookup[0] is not None else None)
    max_rows = max(c.batch * max(c.next_n, c.flattened) for c in cases)
    paths = build_paths(arms, device, max_rows, context, quiet_logger())
    capture_router = paths.make_router(is_capturing=lambda: True)
    results: list[CaseResult] = []
    behaviours: list[behaviour.BehaviourResult] = []
    self_tests: list[behaviour.SelfTestResult] = []
    problems: dict[str, PagedProblem] = {}
    planned = len(cases) + len(contracts) * len(behaviour.BEHAVIOURS) + len(behaviour.SELF_TESTS)
    with StopSignal("case") as stop, Progress(planned, "check") as progress:
        with paths.session():
            for i, case in enumerate(cases):
                if stop.requested:
                    break
                progress.step(case.label)
                gen = torch.Generator().manual_seed(args.seed + i)
                like = problems.get(case.same_shapes_as) if case.same_shapes_as else None
                problem = build_problem(case, gen, device, like)
                problems[case.label] = problem
                results.append(run_case(case, problem, paths, arms, topk, capture_router))
        shape = bounds_shape(models)
        inputs = behaviour.Problems(shape.heads, shape.head_dim, device, args.seed + len(cases))
        for contract in contracts:
            for case_ in behaviour.BEHAVIOURS:
                if stop.requested:
                    break
                progress.step(f"{case_.label} (as {contract.name})")
                with simulated_callers():  # the behaviour cases' call sites are the mirror's
                    outcome = behaviour.run_behaviour(case_, contract, inputs, device, topk, quiet_logger())
                behaviours.append(outcome)
        if not stop.requested:
            for label, _, _ in behaviour.SELF_TESTS:
                progress.step(f"agreement rule self-test: {label}")
            self_tests = behaviour.agreement_self_test(topk)
        ran = len(results) + len(behaviours) + len(self_tests)
        progress.stopped = ran < planned
    print(
        render(results, arms, paths, device, not_run_note(next_ns), behaviours, planned, lookup, self_tests)
    )
    failed = not all(r.ok for r in [*results, *behaviours, *self_tests])
    if failed:
        print("check: FAILED (see the FAIL rows)", file=sys.stderr)
    if ran < planned:
        print(interrupted_note(ran, planned), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 1 if failed else 0
