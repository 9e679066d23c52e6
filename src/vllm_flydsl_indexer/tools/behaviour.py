# SPDX-License-Identifier: Apache-2.0
"""``check``'s router-behaviour cases: the paths that depend on a router's options and history.

The model and bounds cases share one router and ask which arm each call
takes. These cases each build a fresh router with
:class:`~vllm_flydsl_indexer.router.FlyDSLRouter`'s public constructor, as the
patch builds it, and make a few calls in order, because what they test is what
earlier calls leave behind:

* **tuned table**: a small table, parsed from memory by
  :func:`vllm_flydsl_indexer.tuning.parse`, measured FlyDSL faster at batch 1
  and stock (Gluon) faster from batch 3 at KVB 64, and has no row for KVB 1.
  Batch 2 takes FlyDSL, batch 3 stays stock, KVB 1 (not covered) takes FlyDSL.
* **verify-on-enable canary, arms agree**: the canary runs once, on the first
  call, passes, and every call takes FlyDSL.
* **verify-on-enable canary, FlyDSL wrong**: a FlyDSL arm that negates every
  value it writes. The canary catches it on the first call, which returns
  stock's answer; later calls, of any configuration, stay stock and launch nothing.
* **FlyDSL kernel raises**: a kernel that raises from its second KVB-64 launch
  on. That call returns stock's answer; later calls of that configuration, at
  any batch, stay stock and launch nothing; another configuration still takes FlyDSL.

Every call is at next_n 1 from the defining module's indexer, at the bounds
cases' head shape. Both arms are always the reference contracts (pure torch)
over the mirror of stock, even where real kernels exist: these cases test the
router, and a planted fault must never reach a real kernel. A case passes when
every call took the arm written here, launched FlyDSL the number of times
written here, and returned stock's answer exactly in the read windows, and the
canary ran as often as written here.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_flydsl_indexer import tuning
from vllm_flydsl_indexer.agreement import compare_in_windows, make_verifier, read_window_ends
from vllm_flydsl_indexer.kernels import cu_count
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.tools.arms import Workspace, mirror_hooks, reference_arms, stock_call
from vllm_flydsl_indexer.tools.cases import INDEXER, Case, build_problem
from vllm_flydsl_indexer.tools.reference import PagedProblem, flydsl_contract_reference

FLYDSL, STOCK = "FlyDSL", "stock"
CONTEXT_LEN = 256
# The in-memory table: (batch at least, backend) at KVB 64, next_n 1; nothing for KVB 1.
TABLE_ROWS = ((1, "flydsl"), (3, "gluon"))
TABLE_GFX = "reference"
TABLE_SOURCE = "check's in-memory table"
HEADER = (
    "router behaviour: a fresh router per case, calls in order (batch/KVBlockSize, next_n 1); "
    "always the reference contracts (pure torch), even where real kernels exist"
)


@dataclass(frozen=True)
class Step:
    """One call of a case, and what the router must do with it."""

    batch: int
    block_size: int
    arm: str
    launches: int  # FlyDSL launches this call makes

    @property
    def shape(self) -> str:
        return f"{self.batch}/{self.block_size}"


@dataclass(frozen=True)
class Behaviour:
    label: str
    steps: tuple[Step, ...]
    fault: str | None = None  # of the FlyDSL arm: "wrong" or "raises"
    canary: bool = False
    table: bool = False


BEHAVIOURS = (
    Behaviour(
        "tuned table",
        (Step(2, 64, FLYDSL, 1), Step(3, 64, STOCK, 0), Step(2, 1, FLYDSL, 1)),
        table=True,
    ),
    Behaviour(
        "verify-on-enable canary, arms agree",
        (Step(2, 64, FLYDSL, 1), Step(2, 64, FLYDSL, 1), Step(2, 1, FLYDSL, 1)),
        canary=True,
    ),
    Behaviour(
        "verify-on-enable canary, FlyDSL wrong",
        (Step(2, 64, STOCK, 1), Step(2, 64, STOCK, 0), Step(2, 1, STOCK, 0)),
        fault="wrong",
        canary=True,
    ),
    Behaviour(
        "FlyDSL kernel raises",
        (
            Step(2, 64, FLYDSL, 1),
            Step(2, 64, STOCK, 1),
            Step(2, 64, STOCK, 0),
            Step(3, 64, STOCK, 0),
            Step(2, 1, FLYDSL, 1),
        ),
        fault="raises",
    ),
)


@dataclass
class BehaviourResult:
    behaviour: Behaviour
    taken: list[str]
    launches: list[int]
    canary_runs: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


class PlantedKernel:
    """The reference FlyDSL contract, counted, and wrong or raising on purpose."""

    def __init__(self, fault: str | None):
        self.fault = fault
        self.launches = 0
        self.paged_launches = 0

    def __call__(self, q_fp8, kv_cache, weights, out, lens, block_tables, max_model_len, **kwargs):
        self.launches += 1
        if self.fault == "raises" and kv_cache.shape[1] > 1:
            self.paged_launches += 1
            if self.paged_launches > 1:
                raise RuntimeError("planted by check: the FlyDSL launch failed")
        result = flydsl_contract_reference(
            q_fp8, kv_cache, weights, out, lens, block_tables, max_model_len, **kwargs
        )
        if self.fault == "wrong":
            out.neg_()  # wrong under any tolerance: values, -inf masks and top-k sets all differ
        return result


def tuned_table(cus: int, heads: int, head_dim: int) -> tuning.TunedTable:
    """:data:`TABLE_ROWS` in aiter's CSV format, read by the plugin's own parser."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=tuning.COLUMNS)
    writer.writeheader()
    for batch, backend in TABLE_ROWS:
        writer.writerow(
            dict(
                gfx=TABLE_GFX,
                cu_num=cus,
                batch_size=batch,
                next_n=1,
                heads=heads,
                head_dim=head_dim,
                kv_block_size=64,
                preshuffle=1,
                context_len=CONTEXT_LEN,
                backend=backend,
                ChunkK=256,
                WavePerEU=2,
                wg_per_cu=8,
                us=1.0,
                gluon_us=1.0 if backend == "gluon" else 2.0,
                flydsl_us=1.0 if backend == "flydsl" else 2.0,
            )
        )
    return tuning.parse(io.StringIO(text.getvalue()), TABLE_SOURCE, TABLE_GFX)


def problems_for(
    heads: int, head_dim: int, device: torch.device, seed: int
) -> dict[tuple[int, int], PagedProblem]:
    """One problem per (batch, KVBlockSize) the cases call with."""
    shapes = sorted({(s.batch, s.block_size) for b in BEHAVIOURS for s in b.steps})
    problems = {}
    for i, (batch, block_size) in enumerate(shapes):
        case = Case(
            heads,
            head_dim,
            block_size,
            1,
            batch,
            CONTEXT_LEN,
            label=f"{batch}/{block_size}",
            preshuffle=block_size > 1,
        )
        problems[batch, block_size] = build_problem(case, torch.Generator().manual_seed(seed + i), device)
    return problems


def run_behaviour(
    behaviour: Behaviour,
    problems: dict[tuple[int, int], PagedProblem],
    heads: int,
    head_dim: int,
    device: torch.device,
    topk: int,
    logger: logging.Logger,
) -> BehaviourResult:
    rows = max(p.batch for p in problems.values())
    workspace = Workspace(rows, CONTEXT_LEN, device)
    stock = stock_call(reference_arms().gluon, workspace)
    kernel = PlantedKernel(behaviour.fault)
    canary_runs = []
    verifier = None
    if behaviour.canary:
        agree = make_verifier(tolerance=0.0, topk=topk)  # the reference contracts agree exactly

        def verifier(*args):
            canary_runs.append(1)
            return agree(*args)

    table = tuned_table(cu_count(device), heads, head_dim) if behaviour.table else None
    variant = dataclasses.replace(reference_arms().flydsl_variant(), fn=kernel)
    router = FlyDSLRouter(stock, variant, mirror_hooks(workspace), logger, verifier=verifier, table=table)
    result = BehaviourResult(behaviour, [], [], 0, [])
    for number, step in enumerate(behaviour.steps, start=1):
        where = f"call {number} ({step.shape})"
        problem = problems[step.batch, step.block_size]
        args = problem.call_args()
        poison = workspace.get(problem.batch, problem.max_model_len)
        poison.fill_(float("nan"))
        expected = stock(*args).clone()
        poison.fill_(float("nan"))
        taken, launched = router.calls_taken, kernel.launches
        try:
            out = router.call_from(INDEXER, *args).clone()
        except Exception as e:  # noqa: BLE001 - reported as this case's failure
            out = None
            result.problems.append(f"{where} raised {type(e).__name__}: {e}")
        arm = FLYDSL if router.calls_taken > taken else STOCK
        result.taken.append(arm if out is not None else "raised")
        result.launches.append(kernel.launches - launched)
        if out is not None and arm != step.arm:
            result.problems.append(f"{where} took {arm}, the case requires {step.arm}")
        if result.launches[-1] != step.launches:
            result.problems.append(
                f"{where} launched FlyDSL {result.launches[-1]} time(s), the case requires {step.launches}"
            )
        if out is not None:
            ends = read_window_ends(problem.context_lens, problem.batch, 1)
            agreement = compare_in_windows(expected, out, ends, topk)
            if not agreement.ok(0.0):
                result.problems.append(f"{where} did not return stock's answer ({agreement.describe()})")
    result.canary_runs = len(canary_runs)
    wanted = 1 if behaviour.canary else 0
    if result.canary_runs != wanted:
        result.problems.append(f"the canary ran {result.canary_runs} time(s), the case requires {wanted}")
    return result


def run_behaviours(
    heads: int,
    head_dim: int,
    device: torch.device,
    topk: int,
    seed: int,
    logger: logging.Logger,
    step: Callable[[str], None] = lambda label: None,
) -> list[BehaviourResult]:
    """Every case of :data:`BEHAVIOURS`, in order; ``step`` announces each."""
    problems = problems_for(heads, head_dim, device, seed)
    results = []
    for behaviour in BEHAVIOURS:
        step(behaviour.label)
        results.append(run_behaviour(behaviour, problems, heads, head_dim, device, topk, logger))
    return results


def table(results: list[BehaviourResult]) -> list[tuple[str, ...]]:
    """The section's table: its header row, then one row per case."""
    header = ("case", "calls", "expected", "taken", "FlyDSL launches", "canary", "result")
    return [
        header,
        *[
            (
                r.behaviour.label,
                " ".join(s.shape for s in r.behaviour.steps),
                " ".join(s.arm for s in r.behaviour.steps),
                " ".join(r.taken),
                " ".join(map(str, r.launches)),
                f"{r.canary_runs} run" if r.behaviour.canary else "-",
                "PASS" if r.ok else "FAIL",
            )
            for r in results
        ],
    ]


def fail_lines(results: list[BehaviourResult]) -> list[str]:
    return [f"FAIL {r.behaviour.label}: {problem}" for r in results for problem in r.problems]
