# SPDX-License-Identifier: Apache-2.0
"""The route: the rules of the decode step, the memo, the guards and the one net. Imports no vLLM.

:class:`FlyDSLRouter` replaces ``rocm_fp8_paged_mqa_logits``: a call is launched on the identified FlyDSL
API, or handed to the original unchanged. It reads shapes, dtypes, strides, Python arguments and the
calling module, never a tensor value: no host sync, the same inside graph capture.

* **The rules** (:func:`objection`), in order, the first reason logged once; the last asks the table, else
  this node's measurement (:mod:`~vllm_flydsl_indexer.measure`). The verdict is memoised on the call's
  key and a FlyDSL verdict is launched only while the call's facts are the same
  (:meth:`FlyDSLRouter.call_from` says what a warm call reads).
* **The guards**: no first-time compile, self-test or measurement inside capture; a shape proves itself
  (:mod:`~vllm_flydsl_indexer.selftest`) at its first call outside capture; a failed shape stays stock.
* **One net**: everything the router does runs in one ``try``; any exception gives stock's answer, one
  ERROR, and the shape stays stock: a kernel that rejects a call its identified contract admits has a
  contract this package does not know, so none of the shape is trusted.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from vllm_flydsl_indexer import measure, selftest
from vllm_flydsl_indexer.envs import HEAD, STOCK_CALL_LINE, TABLE_IGNORED_LINE
from vllm_flydsl_indexer.kernels import (
    BLOCK_OUTER_NOTE,
    TUNER_WG_PER_CU,
    KernelVariant,
    cu_count,
    describe,
    explicit_split_kv,
    shape_of,
)
from vllm_flydsl_indexer.target import StockHooks, multi_row_objection
from vllm_flydsl_indexer.tuning import TunedTable

# Distinct call signatures (mostly batch sizes) whose verdicts are memoised.
MAX_MEMOISED_VERDICTS = 4096
STAYS_STOCK = "This call and every later call of this shape use the stock path until vLLM restarts"


def objection(router: FlyDSLRouter, args: tuple, compress_ratio: int, caller: str | None) -> str | None:
    """The rules in order: why this call stays stock, or ``None``; reasons name shapes, not batches. They
    read the call's shapes and the plugin's start-up state (the DCP size too: vLLM sets up its parallel
    groups before it loads the model), the same on every rank of a TP group."""
    q, kv, w, lens, bt, _, _ = args
    variant, block_size = router.variant, kv.shape[1]
    reason = router.hooks.gluon_objection(compress_ratio, block_size)
    if reason is not None:
        return f"stock does not use aiter's Gluon kernel here: {reason}"
    if not kv.is_contiguous():
        return (
            f"kv_cache is strided (block stride {kv.stride(0)} bytes, not KVBlockSize*index_dim = "
            f"{block_size * kv.shape[-1]}), so this layer stays on the stock path. {BLOCK_OUTER_NOTE}"
        )
    reason = variant.violation(q, kv, w, lens, bt)
    if reason is not None:
        return reason
    # Written columns equal read columns: FlyDSL writes [0, ctx_b - next_n + i] of row (b, i), ctx_b the last
    # column of vLLM's bounds; the consumers read row r over [0, bounds.reshape(-1)[r]). They agree for
    # next_n == 1 with one bound per row, and for a (B, next_n) native table from an audited caller,
    # compress_ratio 1 and DCP 1. Anything else can read a column FlyDSL never writes (Gluon writes -inf).
    next_n = q.shape[1]
    if next_n == 1 and lens.dim() == 2 and lens.shape[1] != 1:
        return f"next_n=1 with {lens.shape[1]} bounds per sequence"
    if next_n > 1:
        if lens.dim() != 2 or lens.shape[1] != next_n:
            return f"next_n={next_n} without a (B, next_n) bounds table: consumers read columns FlyDSL leaves"
        reason = multi_row_objection(caller)
        if reason is not None:
            return reason
        if compress_ratio != 1:
            return (
                f"next_n={next_n} with compress_ratio={compress_ratio}: compressed bounds are not one apart"
            )
        if (dcp := router.hooks.dcp_world_size()) != 1:
            return f"next_n={next_n} with decode context parallel size {dcp}: localised bounds"
    layout = router.hooks.preshuffle(block_size)
    if layout != (block_size > 1):
        return (
            f"stock reads this KVBlockSize={block_size} cache with Preshuffle={layout}, "
            f"FlyDSL would be launched with Preshuffle={block_size > 1}"
        )
    if variant.dispatch_objection is not None:
        # Where aiter's dispatcher picks Gluon it would re-tune Gluon's knobs: vLLM's original runs instead.
        return variant.dispatch_objection(args, block_size > 1)
    return None


def pick_objection(router: FlyDSLRouter, pick: tuple | str | None, args: tuple) -> str | None:
    """Why the agreed ``pick`` (:meth:`FlyDSLRouter.decide`) keeps this call on stock, or ``None``."""
    if pick is None or isinstance(pick, str):
        return pick
    backend, bucket, wg_per_cu, conflict, where = pick
    shape = describe(shape_of(args[0], args[1]))
    if backend == "gluon":
        return f"{where} measured stock (Gluon) faster at batch {bucket} of {shape}"
    if conflict is not None:
        return f"{where}: {conflict} for {shape}"
    problem = router.variant.knob_problem(wg_per_cu)
    return f"{where} measured FlyDSL with {problem}" if problem else None


@dataclass(slots=True)
class Route:
    """The memoised verdict for one call signature: a reason to stay stock, or how to launch."""

    reason: str | None
    shape: tuple | None = None  # (heads, head_dim, KVBlockSize, next_n): what FlyDSL compiles
    caller: str | None = None
    kwargs: dict[str, object] = field(default_factory=dict)
    facts: tuple = ()  # the call's facts (FlyDSLRouter.call_from) the verdict was decided on
    bounds: str = ""  # the kind of bounds: "(B,)" or "(B, next_n)"
    source: str = "no table: FlyDSL wherever eligible"  # what decided FlyDSL
    ready: bool = False  # compiled outside capture and announced: the plain fast path applies
    rows: int = 0  # the logits buffer's rows, batch * next_n (q's shape is in the memo key)


def _is_capturing() -> bool:
    # Nothing captures before CUDA/HIP is initialised; is_initialized() is a cheap flag read.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class FlyDSLRouter:
    """Callable with ``rocm_fp8_paged_mqa_logits``'s signature; the patch calls :meth:`call_from` with the
    calling module (a plain call: unknown, ``next_n == 1`` only). ``logger`` is vLLM's (``*_once``)."""

    def __init__(
        self,
        original: Callable[..., torch.Tensor],
        variant: KernelVariant,
        hooks: StockHooks,
        logger: logging.Logger,
        is_capturing: Callable[[], bool] = _is_capturing,
        table: TunedTable | None = None,
        self_test: bool = True,
        tune: bool | None = None,
        gfx: str = "gfx950",
    ) -> None:
        self.original, self.variant, self.hooks, self.logger = original, variant, hooks, logger
        self.is_capturing, self.table, self.self_test = is_capturing, table, self_test
        # Shapes no table covers: None, FlyDSL (no table at all); True, measured (measure.py); False, this
        # node's cache, else stock.
        self.tune, self.gfx, self.node, self.spent, self.gave_up = tune, gfx, None, 0.0, None
        self.swept: set[tuple] = set()  # (shape key, contexts) whose every bucket was decided (measure.local)
        self.verdicts: dict[tuple, tuple | str | None] = {}  # call signature -> agreed pick or reason
        self.failed: dict[tuple, str] = {}  # shapes whose self-test, launch or routing failed
        self.self_tests: dict[tuple, str | None] = {}
        self.compiled: set[tuple] = set()
        self.routes: dict[tuple, Route] = {}
        self.calls_taken = self.calls_delegated = 0

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.call_from(None, *args, **kwargs)

    def call_from(
        self, caller, q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata,
        max_model_len, *, compress_ratio=1,
    ) -> torch.Tensor:  # fmt: skip
        """Route one call made from module ``caller`` (``None``: unknown).

        A warm call builds the memo key (q's, the cache's and the bounds' shapes, the cache's contiguity,
        ``max_model_len``, ``compress_ratio``, the caller) and looks it up; a stock verdict reads nothing
        more. A FlyDSL verdict reads the call's facts too (the dtypes, the weights' and block tables' shapes,
        q's and the weights' contiguity, q's device) and is launched only while they are the ones it was
        decided on. The DCP size is read when a key is decided, never on a warm call.

        A call site no batch can take to FlyDSL (its layout, heads or C4A: a verdict on every key) costs
        stock's own time plus the wrapper's frame read, this key and one lookup: the floor of a per-call
        memo. The key's three ``.shape`` reads each build a ``torch.Size``; no cheaper object tells the
        shapes apart (vLLM's caller passes a new cache view every call: see
        ``benchmarks/results/2026-12-07-issue51-cpu``)."""
        key = None
        try:
            key = (
                q_fp8.shape, kv_cache_fp8.shape, kv_cache_fp8.is_contiguous(), context_lens.shape,
                max_model_len, compress_ratio, caller,
            )  # fmt: skip
            route = self.routes.get(key)
            if route is None or route.reason is None:
                args = (q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata,
                        max_model_len)  # fmt: skip
                facts = (
                    q_fp8.dtype, kv_cache_fp8.dtype, weights.dtype, weights.shape, context_lens.dtype,
                    block_tables.dtype, block_tables.shape, q_fp8.is_contiguous(), weights.is_contiguous(),
                    q_fp8.device,
                )  # fmt: skip
                if route is not None and route.ready and route.facts == facts:  # the warm FlyDSL path
                    out = self._launch(route, args)
                else:
                    out = self._flydsl_or_none(key, route, args, facts, compress_ratio, caller)
                if out is not None:
                    return out
        except Exception as e:  # noqa: BLE001 - nothing the router does may reach vLLM
            self._router_failed(e, key, q_fp8, kv_cache_fp8)
        self.calls_delegated += 1
        return self.original(
            q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata, max_model_len,
            compress_ratio=compress_ratio,
        )  # fmt: skip

    def decide(self, args: tuple, compress_ratio: int) -> tuple | str | None:
        """The verdict on this call's signature, ``(backend, bucket, wg_per_cu, conflict, source)`` or why
        stock (``None``: no table, FlyDSL wherever eligible), decided once at its first eager call: this
        rank's (:meth:`_local`), then agreed across the TP group (:meth:`_agree`, the one collective)."""
        q, kv, _, lens, _, _, max_model_len = args
        signature = (q.shape, kv.shape[1:], lens.dim(), max_model_len, compress_ratio, q.device)
        if signature not in self.verdicts:
            group, capturing = self.hooks.tp_group()[0], self.is_capturing()
            if capturing and group is not None:  # no collective inside capture: an eager call agrees later
                return measure.IN_CAPTURE
            local, ratio = self._local(args, compress_ratio, capturing)
            if local == measure.IN_CAPTURE:
                return local
            self.verdicts[signature] = local if group is None else self._agree(group, local, ratio)
        return self.verdicts[signature]

    def _local(self, args: tuple, compress_ratio: int, capturing: bool) -> tuple[tuple | str | None, float]:
        """This rank's verdict and the ratio it brings to the agreement: the table's (dropped, with one
        line, if none of its rows are for this CU count), else this node's cache or measurement."""
        q, kv, _, lens, _, _, max_model_len = args
        table, cus = self.table, cu_count(q.device)
        if table is not None and cus not in (counts := sorted(table.cu_counts())):
            line = (
                f"{table.name} has {table.gfx} rows for CU count(s) {counts}, none for this GPU's {cus} CUs"
            )
            level = logging.INFO if table.origin == "built-in" else logging.WARNING
            self.logger.log(level, "%s %s", TABLE_IGNORED_LINE, line)
            self.table = table = None
        batch, next_n, heads, head_dim = q.shape
        pick = table.choice(cus, batch, next_n, heads, head_dim, kv.shape[1]) if table is not None else None
        if pick is not None:
            pick = (*pick, f"{table.name} on {table.gfx} with {cus} CUs")
        elif self.tune is not None:
            if capturing:
                return measure.IN_CAPTURE, math.inf
            bounds, block = "(B, next_n)" if lens.dim() == 2 else "(B,)", kv.shape[1]
            kwargs = functools.partial(
                self.variant.launch_kwargs, block_size=block, max_model_len=max_model_len, cus=cus
            )
            route = lambda bucket: Route(None, shape_of(q, kv), None, kwargs(bucket), bounds=bounds)  # noqa: E731
            return measure.local(self, args, compress_ratio, route)
        # A table's FlyDSL pick (or none: FlyDSL wherever eligible) brings the margin's ratio, stock none.
        flydsl = pick is None or (pick[0] == "flydsl" and pick[3] is None)
        return pick, 1 / measure.MARGIN if flydsl else math.inf

    def _agree(self, group, local: tuple | str | None, ratio: float) -> tuple | str | None:
        """The router's one collective: every rank of the TP group reaches it once per call signature, at
        its first eager call, whatever it holds (a table, a cache, a measurement, ``TUNE=0``, a failed
        self-test or measurement: the rules before it read only shapes). One MAX over FlyDSL's time over
        stock's (``inf``: stock), so the slowest rank counts and a cache never outvotes a
        measurement. The wait is bounded by ``measure.AGREE_TIMEOUT_S``: past it this rank keeps stock for
        every signature not yet agreed and never waits on the group again (a late peer's operation still
        pairs with the one left pending, so the group's order of operations holds)."""
        try:
            if self.gave_up:  # a peer missed an agreement: never wait on the group again
                return self.gave_up
            reduced = torch.tensor([ratio], dtype=torch.float64)
            work = dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group, async_op=True)
            work.wait(timedelta(seconds=measure.AGREE_TIMEOUT_S))
            taken = measure.settle(reduced.item())
        except Exception as e:  # noqa: BLE001 - no agreement: stock on this rank, for good
            why = f"the TP group's agreement failed ({type(e).__name__}: {e})"
            self.logger.warning("%s %s; every batch not yet agreed stays stock", HEAD, why)
            self.gave_up = f"{measure.NOT_MEASURED} ({why})"
            return self.gave_up
        if taken:
            return None if local is None else ("flydsl", *local[1:])
        if isinstance(local, str) or (local is not None and local[0] == "gluon"):
            return local
        return "the TP group keeps stock: on its slowest rank FlyDSL does not beat stock by the margin"

    def _flydsl_or_none(
        self, key: tuple, route: Route | None, args: tuple, facts: tuple, compress_ratio: int, caller
    ) -> torch.Tensor | None:
        """FlyDSL's answer to a call not memoised as stock, or ``None``; other facts: keyed by them too."""
        if route is not None and route.facts != facts:
            key = (key, facts)
            route = self.routes.get(key)
        if route is None:
            route = self._memoise(key, args, compress_ratio, caller, facts)
        if route.reason is not None:
            return None
        if route.ready:
            return self._launch(route, args)
        return self._first_calls(route, args, compress_ratio)

    def _memoise(self, key: tuple, args: tuple, compress_ratio: int, caller, facts: tuple = ()) -> Route:
        """The rules' verdict on a new call signature, kept while the memo has room (not from capture)."""
        q, kv, _, lens, _, _, max_model_len = args
        shape = shape_of(q, kv) if q.dim() == 4 and kv.dim() == 4 else None
        reason, pick = objection(self, args, compress_ratio, caller), None
        if reason is None:  # every rank of a TP group gets here, failed shape or not
            pick = self.decide(args, compress_ratio)
            reason = pick_objection(self, pick, args)
        reason = reason or self.failed.get(shape)
        if reason is not None:
            route = Route(reason)
            self.logger.info_once("%s %s", STOCK_CALL_LINE, reason, scope="process")
        else:
            kwargs = self.variant.launch_kwargs(
                q.shape[0], kv.shape[1], max_model_len, cu_count(q.device), pick[2] if pick else 0
            )
            bounds = "(B, next_n)" if lens.dim() == 2 else "(B,)"
            route = Route(None, shape, caller, kwargs, facts, bounds, *pick[4:] if pick else ())
            route.rows = q.shape[0] * q.shape[1]
        if len(self.routes) < MAX_MEMOISED_VERDICTS and reason != measure.IN_CAPTURE:
            self.routes[key] = route
        return route

    def _first_calls(self, route: Route, args: tuple, compress_ratio: int) -> torch.Tensor | None:
        """A route's first calls (the capture guard, the self-test): FlyDSL's answer, or ``None``."""
        untested = self.self_test and (route.shape, route.bounds) not in self.self_tests
        if self.is_capturing() and (route.shape not in self.compiled or untested):
            # FlyDSL JIT-compiles a shape on its first call, and the self-test allocates and syncs:
            # neither may happen inside graph capture, so this graph keeps stock.
            what = "compiled and self-tested" if untested else "compiled"
            line = (
                f"FlyDSL not yet {what} for {describe(route.shape)} bounds {route.bounds} and the stream is "
                "capturing, so this graph keeps the stock path. vLLM runs eager warm-up steps before it "
                "captures, so this is unexpected: report it with your vLLM version and compilation config"
            )
            self.logger.warning_once("%s %s", STOCK_CALL_LINE, line, scope="process")
            return None
        if untested and self._tested(route, args, compress_ratio) is not None:
            return None
        return self._launch(route, args)

    def _tested(self, route: Route, args: tuple, compress_ratio: int, context: int = 0) -> str | None:
        """The self-test, once per shape and bounds, and once per timing context the measurement meets
        (``context``: on one sequence that long): ``None`` if passed or off (failed: stock)."""
        lengths = [context] if context else []  # none: the small problem
        key = (route.shape, route.bounds, *lengths)
        if self.self_test and key not in self.self_tests:
            self.self_tests[key] = problem = self._self_test(route, args, compress_ratio, lengths)
            if problem is not None:
                at = f" at context {context}" if context else ""
                self._shape_failed(route.shape, f"self-test failed{at}: {problem}")
        return self.self_tests.get(key)

    def _self_test(self, route: Route, args: tuple, compress_ratio: int, lengths=()) -> str | None:
        """FlyDSL itself on a synthetic problem of this shape (small, else sequences of ``lengths``: the
        measurement's timing contexts), against stock: ``None`` if they agree. It launches SplitKV 1 and
        the largest SplitKV any live launch of this shape reaches, clamped to the problem's pages, where
        SplitKV is passed; else the live launch's knobs (under aiter's dispatcher, its FlyDSL row for this
        live call, forced: its table may pick Gluon for the small problem)."""
        q, kv, _, lens, _, _, max_model_len = args
        shape, kwargs, rows = route.shape, route.kwargs, lens.dim() == 2
        problem = selftest.synthetic(
            *shape, kv.shape[3], per_row_bounds=rows, device=q.device, lengths=lengths
        )
        if "SplitKV" in kwargs:
            most = max(self.variant.split_kv_workgroups_per_cu or 0, *TUNER_WG_PER_CU)
            top = explicit_split_kv(cu_count(q.device), 1, max_model_len, shape[2], most)
            pages = problem[4].shape[1]
            launches = {f"at SplitKV {s}": {**kwargs, "SplitKV": s} for s in sorted({1, min(pages, top)})}
        elif self.variant.flydsl is not None:
            launches = {"forced through aiter's dispatcher": {**kwargs, "live": args}}
        else:
            launches = {"at its default launch": kwargs}
        fn = self.variant.flydsl or self.variant.fn
        try:
            stock = functools.partial(self.original, compress_ratio=compress_ratio)
            launch = {name: functools.partial(self._flydsl, fn, knobs) for name, knobs in launches.items()}
            live = (q.shape[0] * q.shape[1], max_model_len)
            return selftest.run(problem, lambda a: stock(*a), self.hooks.output_buffer, launch, live)
        except Exception as e:  # noqa: BLE001 - a self-test that raises is a failed one
            return f"raised {type(e).__name__}: {e}"

    def _flydsl(self, fn: Callable, kwargs: dict, args: tuple, out: torch.Tensor) -> None:
        """A FlyDSL launch, live or self-test, into ``out``."""
        q, kv, w, lens, bt, _, max_model_len = args
        fn(q, kv, w, out, self.hooks.per_sequence_lens(lens), bt, max_model_len, **kwargs)

    def _launch(self, route: Route, args: tuple) -> torch.Tensor | None:
        """FlyDSL into the logits buffer taken exactly as stock takes it; ``None`` for stock's."""
        q, kv, w, lens, bt, _, max_model_len = args
        out = self.hooks.output_buffer(route.rows, max_model_len)
        try:
            self.variant.fn(
                q, kv, w, out, self.hooks.per_sequence_lens(lens), bt, max_model_len, **route.kwargs
            )
        except Exception as e:  # noqa: BLE001 - a kernel that fails sends its shape to stock
            self._shape_failed(route.shape, f"raised {type(e).__name__}: {e}")
            return None
        if not route.ready and not self.is_capturing():
            # Compiled outside capture: announced once per shape, and fast from now on.
            self.compiled.add(route.shape)
            route.ready = True
            tested = self.self_tests.get((route.shape, route.bounds), "") is None
            where = f"caller {route.caller or 'unknown'}; {self.variant.location}; {route.source}"
            where += "; self-test passed" if tested else ""
            self.logger.info_once(
                "%s FlyDSL taken for %s (%s)", HEAD, describe(route.shape), where, scope="process"
            )
        self.calls_taken += 1
        return out

    def _router_failed(self, error: Exception, key: tuple | None, q, kv) -> None:
        """The router's work on a call raised: this call gets stock's answer, its shape stays stock."""
        problem = f"raised {type(error).__name__} while routing this call: {error}"
        try:
            shape = shape_of(q, kv)
        except Exception:  # noqa: BLE001 - arguments without shapes: no shape to keep stock
            shape, line = None, f"the router {problem}. It uses the stock path."
            self.logger.error_once("%s %s", HEAD, line, scope="process")
        if shape is not None and shape not in self.failed:  # the facts or a hook may raise at every call
            self._shape_failed(shape, problem)  # one ERROR
        if key is not None and len(self.routes) < MAX_MEMOISED_VERDICTS:
            self.routes[key] = Route(self.failed.get(shape, f"the router {problem}"))

    def _shape_failed(self, shape: tuple, problem: str) -> None:
        """This shape stays stock until restart (every memoised route of it too), with one ERROR."""
        self.failed[shape] = f"FlyDSL for {describe(shape)} earlier {problem}"
        self.compiled.discard(shape)
        self.routes.clear()  # every memoised route of this shape now says stock
        versions = "flydsl {flydsl}, aiter {aiter}".format(**measure.stack_versions())
        where = f"{self.variant.location} ({describe(shape)}) {problem} ({versions})"
        self.logger.error("%s %s. %s.", HEAD, where, STAYS_STOCK)
