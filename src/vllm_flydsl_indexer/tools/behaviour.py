# SPDX-License-Identifier: Apache-2.0
"""``check``'s router-behaviour cases: the paths that depend on a router's API, options and history.

The model and bounds cases share one router and ask which arm each call
takes. These cases each build a fresh router with
:class:`~vllm_flydsl_indexer.router.FlyDSLRouter`'s public constructor, as the
patch builds it, and make a few calls in order, because what they test is what
earlier calls leave behind. Every case runs once per FlyDSL API the plugin
knows (general, gfx950; the found one first), on a reference
contract shaped like that API (:func:`~vllm_flydsl_indexer.tools.arms.reference_variant`):
its limits, its SplitKV rule, and a pure-torch kernel that raises as its
wrapper does for what it refuses.

* **API limits**: heads, KVBlockSize, next_n, a strided q.
* **bounds and callers**: an unknown caller at next_n 2, next_n 1 with (B, 2) bounds.
* **memo collisions**: a strided cache after a contiguous one, with identical shapes: the memo key
  must tell them apart.
* **Preshuffle differs from stock's**: hooks whose ``preshuffle`` says plain.
* **pool at the i32 offset limit**: shapes only, through the router's rules
  with meta tensors (no launch, no 2 GiB allocated).
* **tuned table**: next_n 1 and 2 rows, several batch buckets, rows of another
  gfx, and FlyDSL rows whose ``wg_per_cu`` sets SplitKV.
* **built-in table**: the built-in table's rows (AMD's MI355X buckets and knobs,
  next_n up to 8, wg_per_cu 2 and 3) re-keyed to the case's GPU and shape.
* **FlyDSL kernel raises**: from its second paged launch on.
* **this node's measurement** (no table covers the shapes; the node cache in a private temporary
  directory): a FlyDSL made slower than stock is kept on stock and one made faster taken, each timed once
  per bucket (one untimed and :data:`~vllm_flydsl_indexer.measure.ROUNDS` timed launches) and cached as
  measured; ``VLLM_FLYDSL_INDEXER_TUNE=0`` keeps stock and caches nothing; a cached row is honoured only
  at the context it was timed at; a FlyDSL that fails its self-test is never timed nor cached.

A step's written arm is for an API that takes the call; where the API's
reference contract refuses it (or cannot launch the tuned row's knob) the step
expects stock and no launch. Every launch's knobs (Preshuffle, KVBlockSize,
SplitKV) are compared with what that API must receive, computed here from
aiter's rule. A case passes when every call took the expected arm, launched
FlyDSL the expected number of times with the expected knobs, returned stock's
answer exactly in the read windows.

Last, a self-test of the agreement rule: arm pairs that differ only by a NaN,
only by one ``-inf`` column, or only by one value must each be reported as
disagreeing, by that name.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_flydsl_indexer import envs, measure, selftest, tuning
from vllm_flydsl_indexer.kernels import TUNER_WG_PER_CU, cu_count
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.selftest import REAL_KERNEL_TOLERANCE, read_window_ends
from vllm_flydsl_indexer.tools import tuned
from vllm_flydsl_indexer.tools.arms import (
    Workspace,
    mirror_hooks,
    per_sequence_context_lens,
    reference_arms,
    reference_variant,
    stock_call,
)
from vllm_flydsl_indexer.tools.cases import INDEXER, Case, build_problem
from vllm_flydsl_indexer.tools.harness import compare_in_windows
from vllm_flydsl_indexer.tools.reference import (
    PagedProblem,
    VariantContract,
    contract_violation,
    expected_split_kv,
    mtp_bounds,
)

__all__ = [
    "AITER_COLUMNS",
    "BEHAVIOURS",
    "Behaviour",
    "BehaviourResult",
    "CACHED_ROWS",
    "CONTEXT_LEN",
    "HEADER",
    "I32_LIMIT",
    "MEASURED",
    "MEASURE_DELAY_S",
    "OTHER_GFX",
    "PlantedKernel",
    "Problems",
    "SELF_TESTS",
    "SELF_TEST_HEADER",
    "SelfTestResult",
    "Step",
    "TABLE_GFX",
    "TABLE_ROWS",
    "TABLE_SOURCE",
    "agreement_self_test",
    "expect",
    "expected_knobs",
    "fail_lines",
    "pool_args",
    "run_behaviour",
    "self_test_fail_lines",
    "self_test_table",
    "table",
    "tuned_table",
]

FLYDSL, STOCK = "FlyDSL", "stock"
CONTEXT_LEN = 256
# FlyDSL's i32 byte offsets, written out for the same reason (the plugin's is target.I32_OFFSET_LIMIT).
I32_LIMIT = 2**31
# aiter's tuned-CSV columns, as aiter's tuner writes them. Written out, not imported: check writes its
# table as aiter would and reads it with the plugin's parser, so a column the plugin names wrong fails
# check instead of agreeing with itself (tests pin the two equal).
AITER_COLUMNS = (
    *("gfx", "cu_num", "batch_size", "next_n", "heads", "head_dim", "kv_block_size", "preshuffle"),
    *("context_len", "backend", "ChunkK", "WavePerEU", "wg_per_cu", "us", "gluon_us", "flydsl_us"),
)
# A measured bucket's FlyDSL launches: one untimed (the compile), then one per round (one context: the
# case's max_model_len is below AMD's tuner contexts).
MEASURED = 1 + measure.ROUNDS
# Made slower (or stock made slower): each call then waits this long plus twice its own run, so the slower
# arm takes over 3x the other's time whatever the machine's load (both arms run the same reference work).
MEASURE_DELAY_S = 0.02
# The "cached" case's planted rows: (batch bucket, context_len), FlyDSL 2x faster; the first at a context
# no call of the case has (never honoured), the second at the case's own.
CACHED_ROWS = ((2, "999"), (4, str(CONTEXT_LEN)))
# The in-memory table: (gfx, batch at least, next_n, backend, wg_per_cu), all at KVB 64; none for KVB 1.
TABLE_GFX = "reference"
OTHER_GFX = "gfx942"
TABLE_ROWS = (
    (TABLE_GFX, 1, 1, "flydsl", 2),  # FlyDSL with SplitKV from wg_per_cu 2
    (TABLE_GFX, 2, 1, "flydsl", 0),  # FlyDSL, the API's default launch
    (TABLE_GFX, 3, 1, "gluon", 0),
    (TABLE_GFX, 1, 2, "gluon", 0),  # next_n 2: stock faster
    (OTHER_GFX, 2, 1, "gluon", 0),  # another GPU's row: never read here
)
TABLE_SOURCE = "check's in-memory table"
# One line of check's 120 columns; the table's calls column lists the calls in order
# (batch/KVBlockSize, then what differs).
HEADER = (
    "router behaviour, a fresh router per case and API: on its reference contract (pure torch), "
    "even where real kernels exist"
)
SELF_TEST_HEADER = "agreement rule self-test: arm pairs that differ in one way only must disagree, by name"


@dataclass(frozen=True)
class Step:
    """One call of a case, and what the router must do with it where the API takes the call."""

    batch: int
    block_size: int
    arm: str
    launches: int  # FlyDSL launches this call makes
    next_n: int = 1
    heads: int | None = None  # None: the case's head count
    caller: str | None = INDEXER
    # "": plain; "strided" cache or "q-strided" (same shapes); "bounds2": next_n 1 with (B, 2)
    # bounds; "pool-at"/"pool-below": a pool at / just below 2**31 bytes (shapes only).
    form: str = ""
    dcp: int = 1
    wg: int = 0  # the tuned row's wg_per_cu that the launch must carry

    @property
    def shape(self) -> str:
        parts = [f"{self.batch}/{self.block_size}"]
        parts += [f"n{self.next_n}"] if self.next_n != 1 else []
        parts += [f"H{self.heads}"] if self.heads else []
        parts += ["unknown"] if self.caller is None else []
        parts += [self.form] if self.form else []
        parts += [f"dcp{self.dcp}"] if self.dcp != 1 else []
        return " ".join(parts)


@dataclass(frozen=True)
class Behaviour:
    label: str
    steps: tuple[Step, ...]
    # Of the FlyDSL arm: "wrong", "unwritten", "raises", or "reversed" (a sequence's rows in reverse
    # order when next_n > 1).
    fault: str | None = None
    self_test: bool = False  # the router's self-test (off: the other cases test the rules alone)
    table: str = ""  # "check": check's in-memory table; "built-in": the built-in table's rows
    plain_stock: bool = False  # stock's hooks read every cache without Preshuffle
    shapes_only: bool = False  # the router's verdict on meta tensors; nothing launched
    # This node's measurement decides (no table): "slower"/"faster" (FlyDSL made slower or faster than
    # stock), "off" (VLLM_FLYDSL_INDEXER_TUNE=0), "cached" (off, over planted rows: CACHED_ROWS).
    measure: str = ""
    cached: tuple[str, ...] = ()  # the node cache's backends, by batch bucket, once the case has run


# A self-test that fails: each shape's first call launches FlyDSL once (its self-test) and stays stock.
FAILED_SELF_TEST = (Step(2, 64, STOCK, 1), Step(2, 64, STOCK, 0), Step(2, 1, STOCK, 1))
# One row per case: cases of one kind share their shape, data, not code.
BEHAVIOURS = (
    Behaviour(
        "API limits",
        (
            Step(2, 64, FLYDSL, 1),
            Step(2, 64, FLYDSL, 1, heads=64),
            Step(2, 16, FLYDSL, 1),
            Step(2, 1, FLYDSL, 1),
            Step(2, 64, FLYDSL, 1, next_n=3),
            Step(2, 64, FLYDSL, 1, next_n=9),
            Step(2, 64, FLYDSL, 1, form="q-strided"),
        ),
    ),
    Behaviour(
        "bounds and callers",
        (
            Step(2, 64, FLYDSL, 1, next_n=2),
            Step(2, 64, STOCK, 0, next_n=2, caller=None),
            Step(2, 64, STOCK, 0, form="bounds2"),
            Step(2, 64, FLYDSL, 1, caller=None),
        ),
    ),
    Behaviour(
        "memo: strided cache after contiguous, same shapes",
        (Step(2, 64, FLYDSL, 1), Step(2, 64, STOCK, 0, form="strided"), Step(2, 64, FLYDSL, 1)),
    ),
    Behaviour(
        "Preshuffle differs from stock's", (Step(2, 64, STOCK, 0), Step(2, 1, FLYDSL, 1)), plain_stock=True
    ),
    Behaviour(
        "pool at the i32 offset limit (shapes only)",
        (Step(2, 64, STOCK, 0, form="pool-at"), Step(2, 64, FLYDSL, 0, form="pool-below")),
        shapes_only=True,
    ),
    Behaviour(
        "tuned table",
        (
            Step(1, 64, FLYDSL, 1, wg=2),
            Step(2, 64, FLYDSL, 1),
            Step(3, 64, STOCK, 0),
            Step(2, 64, STOCK, 0, next_n=2),
            Step(2, 1, FLYDSL, 1),
        ),
        table="check",
    ),
    Behaviour(
        "built-in table (AMD's MI355X rows)",
        (
            Step(1, 64, STOCK, 0),  # batch 1, next_n 1: Gluon measured faster
            Step(64, 64, FLYDSL, 1, wg=3),  # batch 64, next_n 1: FlyDSL at wg_per_cu 3
            Step(128, 64, STOCK, 0),
            Step(16, 64, STOCK, 0, next_n=8),
            Step(32, 64, FLYDSL, 1, next_n=8, wg=2),  # batch 32, next_n 8: FlyDSL at wg_per_cu 2
        ),
        table="built-in",
    ),
    Behaviour(
        "self-test, arms agree",
        (Step(2, 64, FLYDSL, 2), Step(2, 64, FLYDSL, 1), Step(2, 1, FLYDSL, 2)),
        self_test=True,
    ),
    Behaviour("self-test, FlyDSL wrong", FAILED_SELF_TEST, fault="wrong", self_test=True),
    Behaviour(
        "self-test, FlyDSL leaves a column unwritten", FAILED_SELF_TEST, fault="unwritten", self_test=True
    ),
    Behaviour(
        "self-test, FlyDSL reverses a sequence's rows",
        (
            Step(2, 64, STOCK, 1, next_n=2),
            Step(2, 64, STOCK, 0, next_n=2),
            Step(2, 64, FLYDSL, 2),
            Step(2, 64, FLYDSL, 1),
        ),
        fault="reversed",
        self_test=True,
    ),
    Behaviour(
        "measured: FlyDSL slower than stock",
        (Step(2, 64, STOCK, MEASURED), Step(2, 64, STOCK, 0), Step(3, 64, STOCK, 0)),
        measure="slower",
        cached=("gluon",),
    ),
    Behaviour(
        "measured: FlyDSL faster than stock",
        (Step(2, 64, FLYDSL, MEASURED + 1), Step(3, 64, FLYDSL, 1), Step(4, 64, FLYDSL, MEASURED + 1)),
        measure="faster",
        cached=("flydsl", "flydsl"),
    ),
    Behaviour(
        "measured: VLLM_FLYDSL_INDEXER_TUNE=0", (Step(2, 64, STOCK, 0), Step(4, 64, STOCK, 0)), measure="off"
    ),
    Behaviour(
        "measured: cached rows at their own context only",
        (Step(2, 64, STOCK, 0), Step(4, 64, FLYDSL, 1)),
        measure="cached",
        cached=("flydsl", "flydsl"),
    ),
    Behaviour(
        "measured: a failed self-test is not cached",
        (Step(2, 64, STOCK, 1), Step(2, 64, STOCK, 0), Step(4, 64, STOCK, 0)),
        fault="wrong",
        self_test=True,
        measure="faster",
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
    variant: str
    expected: list[str]
    taken: list[str]
    launches: list[int]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


class PlantedKernel:
    """An API's reference contract, counted (with each launch's knobs), and wrong or raising on purpose."""

    def __init__(self, fault: str | None, reference: Callable[..., torch.Tensor]):
        self.fault = fault
        self.reference = reference
        self.launches = 0
        self.paged_launches = 0
        self.knobs: list[dict[str, object]] = []
        # A FlyDSL made slower: each launch waits this plus twice its own run (MEASURE_DELAY_S).
        self.delay = 0.0

    def __call__(self, q_fp8, kv_cache, weights, out, lens, block_tables, max_model_len, **kwargs):
        self.launches += 1
        self.knobs.append(dict(kwargs))
        launch = _slowed(self._launch, self.delay)
        return launch(q_fp8, kv_cache, weights, out, lens, block_tables, max_model_len, **kwargs)

    def _launch(self, q_fp8, kv_cache, weights, out, lens, block_tables, max_model_len, **kwargs):
        if self.fault == "raises" and kv_cache.shape[1] > 1:
            self.paged_launches += 1
            if self.paged_launches > 1:
                raise RuntimeError("planted by check: the FlyDSL launch failed")
        before = out[-1, 0].clone()
        result = self.reference(q_fp8, kv_cache, weights, out, lens, block_tables, max_model_len, **kwargs)
        if self.fault == "wrong":
            out.neg_()  # wrong under any tolerance: values, -inf masks and top-k sets all differ
        elif self.fault == "unwritten":
            # One read column left as it was: the last row's first (the self-test's first sequence is empty,
            # its last the longest); the self-test's NaN poison shows it.
            out[-1, 0] = before
        elif self.fault == "reversed" and q_fp8.shape[1] > 1:
            rows = out.view(q_fp8.shape[0], q_fp8.shape[1], -1)
            rows.copy_(rows.flip(1))
        return result


def _slowed(fn: Callable[..., torch.Tensor], delay: float) -> Callable[..., torch.Tensor]:
    """``fn``, each call then waiting ``delay`` plus twice its own run (none with ``delay`` 0)."""

    def call(*args, **kwargs) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if delay:
                time.sleep(delay + 2 * (time.perf_counter() - started))

    return call


def tuned_table(cus: int, heads: int, head_dim: int) -> tuning.TunedTable:
    """:data:`TABLE_ROWS` in aiter's CSV format (:data:`AITER_COLUMNS`), read by the plugin's parser."""
    rows = []
    for gfx, batch, next_n, backend, wg_per_cu in TABLE_ROWS:
        gluon = backend == "gluon"
        # As aiter's tuner writes them: each backend's own knobs, 0 for the other's.
        knobs = (256, 2, wg_per_cu) if gluon else (0, 0, wg_per_cu)
        times = (1.0, 1.0, 2.0) if gluon else (1.0, 2.0, 1.0)  # us, gluon_us, flydsl_us
        values = (gfx, cus, batch, next_n, heads, head_dim, 64, 1, CONTEXT_LEN, backend, *knobs, *times)
        rows.append(dict(zip(AITER_COLUMNS, values, strict=True)))
    return _read_back(rows, TABLE_SOURCE)


def builtin_table(cus: int, heads: int, head_dim: int) -> tuning.TunedTable:
    """The built-in table's rows, every cell as AMD measured it but the GPU (``gfx``, ``cu_num``) and
    the shape (``heads``, ``head_dim``): this case's, so its buckets and knobs decide here."""
    with open(tuning.BUILTIN_PATH, encoding="utf-8", newline="") as f:
        rows = tuned.read_rows(f, tuning.BUILTIN_LABEL)
    shape = {"gfx": TABLE_GFX, "cu_num": cus, "heads": heads, "head_dim": head_dim}
    return _read_back([{**row.text, **shape} for row in rows], tuning.BUILTIN_LABEL, "built-in")


def _read_back(rows: list[dict], label: str, *origin: str) -> tuning.TunedTable:
    """``rows`` written as aiter's CSV (:data:`AITER_COLUMNS`) and read back by the plugin's parser."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=AITER_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    return tuned.table_of(tuned.read_rows(io.StringIO(text.getvalue()), label), label, TABLE_GFX, *origin)


class Problems:
    """The paged problem of each step, built once; a step's variants share its plain problem's shapes."""

    def __init__(self, heads: int, head_dim: int, device: torch.device, seed: int):
        self.heads, self.head_dim, self.device, self.seed = heads, head_dim, device, seed
        self._built: dict[tuple, PagedProblem] = {}

    def plain(self, step: Step) -> PagedProblem:
        key = (step.batch, step.block_size, step.next_n, step.heads or self.heads)
        if key not in self._built:
            batch, block_size, next_n, heads = key
            case = Case(heads, self.head_dim, block_size, next_n, batch, CONTEXT_LEN, label="")
            case = dataclasses.replace(case, preshuffle=block_size > 1)
            gen = torch.Generator().manual_seed(self.seed + len(self._built))
            self._built[key] = build_problem(case, gen, self.device)
        return self._built[key]

    def get(self, step: Step) -> PagedProblem:
        p = self.plain(step)
        if step.form == "strided":
            # Another layer's page interleaved in every block (a block-outer layout): same shapes.
            both = torch.zeros((p.kv_cache.shape[0], 2, *p.kv_cache.shape[1:]), dtype=torch.uint8)
            both = both.to(p.kv_cache.device)
            both[:, 0] = p.kv_cache
            return dataclasses.replace(p, kv_cache=both[:, 0])
        if step.form == "q-strided":
            padded = torch.zeros((*p.q_fp8.shape[:3], 2 * self.head_dim), dtype=torch.uint8)
            padded = padded.to(p.q_fp8.device)
            padded[..., : self.head_dim] = p.q_fp8.view(torch.uint8)
            return dataclasses.replace(p, q_fp8=padded[..., : self.head_dim].view(torch.float8_e4m3fn))
        if step.form == "bounds2":
            lens = per_sequence_context_lens(p.context_lens).reshape(-1)
            return dataclasses.replace(p, context_lens=mtp_bounds(lens, 2).to(p.context_lens.device))
        return p


def pool_args(step: Step, heads: int, head_dim: int, contract: VariantContract) -> tuple:
    """Meta tensors (shapes only, nothing allocated) of a call whose pool is at or just below 2**31
    bytes: exactly 2**31 where the API takes any index_dim (256 here), else the first pool of its
    fixed index_dim at or above 2**31."""
    index_dim = contract.index_dim or 256
    row = step.block_size * index_dim
    blocks = -(-I32_LIMIT // row) - (step.form == "pool-below")
    meta = torch.device("meta")
    rows = step.batch * step.next_n
    return (
        torch.empty(step.batch, step.next_n, heads, head_dim, dtype=torch.float8_e4m3fn, device=meta),
        torch.empty(blocks, step.block_size, 1, index_dim, dtype=torch.uint8, device=meta),
        torch.empty(rows, heads, dtype=torch.float32, device=meta),
        torch.empty(step.batch, step.next_n, dtype=torch.int32, device=meta),
        torch.empty(step.batch, -(-CONTEXT_LEN // step.block_size), dtype=torch.int32, device=meta),
        None,
        CONTEXT_LEN,
    )


def expected_knobs(
    contract: VariantContract, batch: int, block_size: int, max_model_len: int, cus: int, wg: int
):
    """What ``contract``'s API must be launched with, written from aiter's rule."""
    knobs: dict[str, object] = {"Preshuffle": block_size > 1, "KVBlockSize": block_size}
    if contract.split_kv_wg_per_cu is not None:
        wg_per_cu = wg or contract.split_kv_wg_per_cu
        knobs["SplitKV"] = expected_split_kv(cus, batch, max_model_len, block_size, wg_per_cu)
    return knobs


def self_test_pages(block_size: int, next_n: int) -> int:
    """The self-test problem's block-table width: one spare block past its longest sequence."""
    return -(-max(selftest.synthetic_lengths(block_size, next_n)) // block_size) + 1


def self_test_knobs(
    contract: VariantContract, knobs: dict, block_size: int, next_n: int, max_model_len: int, cus: int
) -> list[dict]:
    """The self-test's FlyDSL launches of a shape first taken with ``knobs``: SplitKV 1 and the largest
    SplitKV a live launch of the shape reaches (batch 1 at aiter's tuner's largest wg_per_cu, or the
    API's own default if larger), clamped to the self-test problem's pages; once, as ``knobs``, where
    the API takes no SplitKV."""
    if contract.split_kv_wg_per_cu is None:
        return [knobs]
    most = max(contract.split_kv_wg_per_cu, *TUNER_WG_PER_CU)
    top = expected_split_kv(cus, 1, max_model_len, block_size, most)
    top = min(self_test_pages(block_size, next_n), top)
    return [{**knobs, "SplitKV": split} for split in sorted({1, top})]


def expect(step: Step, contract: VariantContract, args: tuple, cus: int) -> tuple[str, int, dict | None]:
    """(arm, launches, knobs) that ``contract``'s API must see for ``step``."""
    q, kv, weights, lens, tables, _, max_model_len = args
    if step.arm == STOCK and step.launches == 0:
        return STOCK, 0, None
    if step.wg and contract.split_kv_wg_per_cu is None:
        return STOCK, 0, None  # the tuned row's SplitKV cannot be launched on this API
    knobs = expected_knobs(contract, q.shape[0], kv.shape[1], max_model_len, cus, step.wg)
    out = torch.empty(q.shape[0] * q.shape[1], max_model_len, device="meta")
    refused = contract_violation(
        contract, q, kv, weights, out, per_sequence_context_lens(lens), tables, max_model_len, **knobs
    )
    if refused is not None:
        return STOCK, 0, None
    return step.arm, step.launches, knobs


def run_behaviour(
    behaviour: Behaviour,
    contract: VariantContract,
    problems: Problems,
    device: torch.device,
    topk: int,
    logger: logging.Logger,
) -> BehaviourResult:
    """``behaviour`` on a fresh router whose FlyDSL API is ``contract``'s reference."""
    result = BehaviourResult(behaviour, contract.name, [], [], [], [])
    with contextlib.ExitStack() as stack:
        if behaviour.measure:  # the node cache in a private temporary directory, never the user's
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-flydsl-indexer-check-"))
            stack.enter_context(_environment(VLLM_CACHE_ROOT=root, **{envs.TUNE: None}))
        _run_behaviour(behaviour, contract, problems, device, topk, logger, result)
    return result


@contextlib.contextmanager
def _environment(**values: str | None):
    """``os.environ`` with ``values`` set (``None``: unset) inside, as it was after."""
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
        yield
    finally:
        for name, value in before.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def _node_cache(device: torch.device) -> tuple[str, object]:
    """The node cache's key and path this process's router uses (the case's temporary directory)."""
    key = measure.cache_key(device, "gfx950", cu_count(device))
    return key, measure.cache_path("gfx950", cu_count(device), key) if key else None


def _plant_rows(device: torch.device, heads: int, head_dim: int) -> None:
    """:data:`CACHED_ROWS` in the node cache, as the plugin writes them."""
    key, path = _node_cache(device)
    rows = [
        dict(zip(AITER_COLUMNS, ("gfx950", cu_count(device), batch, 1, heads, head_dim, 64, True, context,
                                 "flydsl", 0, 0, 0, 5.0, 10.0, 5.0), strict=True))
        for batch, context in CACHED_ROWS
    ]  # fmt: skip
    why = measure.write_cache(path, key, rows)
    if why:
        raise RuntimeError(f"the planted node cache was not written: {why}")


def _run_behaviour(behaviour, contract, problems, device, topk, logger, result) -> None:
    try:
        workspace = Workspace(8, CONTEXT_LEN, device)
        stock = stock_call(reference_arms().gluon, workspace)
        reference = reference_variant(contract)
        kernel = PlantedKernel(behaviour.fault, reference.fn)

        cus = cu_count(device)
        heads, head_dim = problems.heads, problems.head_dim
        tables = {"check": tuned_table, "built-in": builtin_table}
        table = tables[behaviour.table](cus, heads, head_dim) if behaviour.table else None
        hooks = mirror_hooks(workspace)
        if behaviour.plain_stock:
            hooks = dataclasses.replace(hooks, preshuffle=lambda block_size: False)
        variant = dataclasses.replace(reference, fn=kernel)
        # tune=None: a shape the behaviour's table does not cover takes FlyDSL, never this node's measurement.
        tune = None if not behaviour.measure else behaviour.measure in ("slower", "faster")
        if behaviour.measure == "cached":
            _plant_rows(device, heads, head_dim)
        kernel.delay = MEASURE_DELAY_S if behaviour.measure == "slower" else 0.0
        # "faster": stock as the router sees it is made slower instead.
        router_stock = _slowed(stock, MEASURE_DELAY_S) if behaviour.measure == "faster" else stock
        router = FlyDSLRouter(
            router_stock, variant, hooks, logger, table=table, self_test=behaviour.self_test, tune=tune
        )
        tag = f"as {contract.name}"
        self_tested: set[tuple] = set()  # the shapes (and bounds) whose self-test ran
        for number, step in enumerate(behaviour.steps, start=1):
            where = f"{tag}, call {number} ({step.shape})"
            if behaviour.shapes_only:
                args = pool_args(step, step.heads or heads, head_dim, contract)
            else:
                args = problems.get(step).call_args()
            # The CUs the router sees are those of the call's own device (meta tensors: 1), as serving's.
            arm_wanted, launches_wanted, knobs_wanted = expect(step, contract, args, cu_count(args[0].device))
            result.expected.append(arm_wanted)
            router.hooks = dataclasses.replace(hooks, dcp_world_size=lambda dcp=step.dcp: dcp)
            if behaviour.shapes_only:
                # The memoised rules' verdict and launch, as a call of these shapes gets them:
                # no tensor is read.
                route = router._memoise(("shapes only", number), args, 1, step.caller)
                arm = FLYDSL if route.reason is None else STOCK
                result.taken.append(arm)
                result.launches.append(0)
                if arm != arm_wanted:
                    result.problems.append(f"{where} took {arm}, the case requires {arm_wanted}")
                elif arm == FLYDSL and route.kwargs != knobs_wanted:
                    result.problems.append(
                        f"{where} would launch {route.kwargs}, the API must get {knobs_wanted}"
                    )
                continue
            q = args[0]
            knobs_seq = [knobs_wanted] * launches_wanted
            shape = (step.block_size, step.next_n, step.heads, step.form)
            if behaviour.self_test and launches_wanted and shape not in self_tested:
                # A shape's first call: its self-test's launches (a failing one stops at its first),
                # then the live launch where it passed.
                self_tested.add(shape)
                tests = self_test_knobs(contract, knobs_wanted, step.block_size, q.shape[1], args[6], cus)
                knobs_seq = [*tests, knobs_wanted] if arm_wanted == FLYDSL else tests[:1]
                launches_wanted = len(knobs_seq)
            rows = q.shape[0] * q.shape[1]
            poison = workspace.get(rows, args[6])
            poison.fill_(float("nan"))
            expected = stock(*args).clone()
            poison.fill_(float("nan"))
            taken, launched = router.calls_taken, kernel.launches
            try:
                out = router.call_from(step.caller, *args).clone()
            except Exception as e:  # noqa: BLE001 - reported as this case's failure
                out = None
                result.problems.append(f"{where} raised {type(e).__name__}: {e}")
            router.hooks = hooks
            arm = FLYDSL if router.calls_taken > taken else STOCK
            result.taken.append(arm if out is not None else "raised")
            result.launches.append(kernel.launches - launched)
            if out is not None and arm != arm_wanted:
                result.problems.append(f"{where} took {arm}, the case requires {arm_wanted}")
            if result.launches[-1] != launches_wanted:
                result.problems.append(
                    f"{where} launched FlyDSL {result.launches[-1]} time(s), "
                    f"the case requires {launches_wanted}"
                )
            for knobs, wanted in zip(kernel.knobs[launched:], knobs_seq, strict=False):
                if knobs != wanted:
                    result.problems.append(f"{where} launched with {knobs}, the API must get {wanted}")
            if out is not None:
                # next_n 1 with (B, 2) bounds: stock's answer is over one length per sequence, its last.
                lens = per_sequence_context_lens(args[3]) if step.form == "bounds2" else args[3]
                ends = read_window_ends(lens, rows, q.shape[1])
                agreement = compare_in_windows(expected, out, ends, topk)
                if not agreement.ok(0.0):
                    result.problems.append(f"{where} did not return stock's answer ({agreement.describe()})")
        if behaviour.measure:
            _, path = _node_cache(device)
            found = measure.load_cache(path, _node_cache(device)[0], "gfx950", cus)[0] if path else {}
            backends = tuple(row["backend"] for _, row in sorted(found.items(), key=lambda kv: kv[0][1]))
            if backends != behaviour.cached:
                result.problems.append(
                    f"as {contract.name}: the node cache holds {backends or 'nothing'}, "
                    f"the case requires {behaviour.cached or 'nothing'}"
                )
    except Exception as e:  # noqa: BLE001 - a case that cannot run fails; check goes on
        result.problems.append(f"as {contract.name}: the case raised {type(e).__name__}: {e}")


def table(results: list[BehaviourResult]) -> list[tuple[str, ...]]:
    """The section's table (one API's, which its heading names): its header row, then one row per case."""
    header = ("case", "calls, in order", "expected", "taken", "FlyDSL launches", "result")
    return [
        header,
        *[
            (
                r.behaviour.label,
                ", ".join(s.shape for s in r.behaviour.steps),
                " ".join(r.expected),
                "as expected" if r.taken == r.expected else " ".join(r.taken),  # the FAIL lines say where
                " ".join(map(str, r.launches)),
                "PASS" if r.ok else "FAIL",
            )
            for r in results
        ],
    ]


def fail_lines(results: list[BehaviourResult]) -> list[str]:
    return [f"FAIL {r.behaviour.label}: {problem}" for r in results for problem in r.problems]


@dataclass
class SelfTestResult:
    label: str
    part: str  # the part of the rule that must report it
    ok: bool
    said: str

    @property
    def problems(self) -> list[str]:
        return [] if self.ok else [f"not reported as {self.part}: the rule said {self.said}"]


def _pair(fault: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two logits rows of 16 read columns (of 20) that differ in one way only, and the window ends."""
    expected = torch.linspace(1.0, 2.5, 20).view(1, 20).repeat(2, 1)
    expected[:, 16:] = float("-inf")
    actual = expected.clone()
    if fault == "nan":
        actual[1, 3] = float("nan")
    elif fault == "-inf":
        actual[1, 3] = float("-inf")
    else:
        actual[1, 3] = -actual[1, 3]
    return expected, actual, torch.tensor([16, 16])


SELF_TESTS = (
    ("a NaN inside a read window", "nan", "NaN read"),
    ("one -inf column inside a read window", "-inf", "-inf mask DIFFERENT"),
    ("one value", "value", "rel diff above the rule"),
)


def agreement_self_test(topk: int) -> list[SelfTestResult]:
    """Each pair of :data:`SELF_TESTS` must disagree, by the named part, under the real-kernel rule."""
    results = []
    for label, fault, part in SELF_TESTS:
        expected, actual, ends = _pair(fault)
        found = compare_in_windows(expected, actual, ends, topk)
        named = {
            "nan": not found.nan_free,
            "-inf": not found.mask_equal,
            "value": not found.within(REAL_KERNEL_TOLERANCE),
        }[fault]
        results.append(
            SelfTestResult(label, part, named and not found.ok(REAL_KERNEL_TOLERANCE), found.describe())
        )
    return results


def self_test_table(results: list[SelfTestResult]) -> list[tuple[str, ...]]:
    header = ("arms differ by", "must be reported as", "the rule said", "result")
    return [header, *[(r.label, r.part, r.said, "PASS" if r.ok else "FAIL") for r in results]]


def self_test_fail_lines(results: list[SelfTestResult]) -> list[str]:
    return [f"FAIL agreement self-test, {r.label}: {p}" for r in results for p in r.problems]
