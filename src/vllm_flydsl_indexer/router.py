# SPDX-License-Identifier: Apache-2.0
"""The route: every rule of the decode step, the memo, the guards and the one net. Imports no vLLM.

:class:`FlyDSLRouter` is what the patch installs in place of ``rocm_fp8_paged_mqa_logits``. A call is
either taken, and launched on the identified FlyDSL API, or handed to the original unchanged. The
decision reads shapes, dtypes, strides, Python arguments and the calling module, never a tensor value:
no host sync, and the same during CUDA/HIP graph capture as outside it.

**The rules** (:data:`RULES`), in order: each is a function ``(call, router) -> None | reason``; the
first reason is what the log says, once ("why did this call stay stock?"). None reads vLLM's modules
(stock's questions go to the hooks resolved at start-up), so the verdict is memoised on the call's
signature: q's, the cache's and the bounds' shapes, the cache's contiguity, ``max_model_len``,
``compress_ratio`` and the caller. A stock verdict is reused as it is; a FlyDSL verdict is launched only
while the call's other facts (:func:`call_facts`) are the ones it was decided on.

**The guards**, from the router's own history: no first-time compile or self-test inside graph capture;
a shape proves itself (:mod:`~vllm_flydsl_indexer.selftest`, once per shape and kind of bounds) at its
first call outside capture; a shape whose self-test, kernel or canary failed stays stock.

**One net.** Everything the router does for a call runs inside one ``try``: any exception gives the
caller stock's answer, one ERROR, and that shape stays stock. A kernel's argument check
(:data:`ARGUMENT_ERRORS`) rejects only that call signature's route. Only stock's own call runs outside
the net, so what it raises reaches vLLM exactly as without the plugin.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vllm_flydsl_indexer import selftest
from vllm_flydsl_indexer.envs import DISAGREE_LINE, HEAD, STOCK_CALL_LINE, TABLE_IGNORED_LINE, log_once
from vllm_flydsl_indexer.kernels import (
    AITER_DISTRIBUTIONS,
    TUNER_WG_PER_CU,
    KernelVariant,
    cu_count,
    explicit_split_kv,
    installed_version,
    strided_cache_reason,
)
from vllm_flydsl_indexer.target import Call, StockHooks, multi_row_objection
from vllm_flydsl_indexer.tuning import Pick, TunedTable, where

__all__ = [
    "ARGUMENT_ERRORS", "CANARY_BYTES", "FlyDSLRouter", "KernelConfig", "MAX_MEMOISED_VERDICTS", "RULES",
    "Route", "call_facts", "canary_sequences", "contiguity_rule", "contract_rule", "describe_configuration",
    "dispatcher_rule", "gluon_rule", "layout_rule", "pick_for", "table_rule", "window_rule",
]  # fmt: skip

# Distinct call signatures (mostly batch sizes) whose verdicts are memoised.
MAX_MEMOISED_VERDICTS = 4096
# What aiter's wrappers raise from their argument checks, before anything is compiled or launched
# (``assert``, ``raise ValueError``/``TypeError``): they reject that call signature only.
ARGUMENT_ERRORS = (ValueError, TypeError, AssertionError)
# The canary compares at most this many logits rows' bytes (whole sequences, at least one).
CANARY_BYTES = 4 << 20


# --- The rules, in the order RULES applies them. ---


def gluon_rule(call: Call, router: FlyDSLRouter) -> str | None:
    """Only the call stock would send to aiter's gfx950 Gluon kernel is ours to change."""
    reason = router.hooks.gluon_objection(call.compress_ratio, call.kv_cache.shape[1])
    return None if reason is None else f"stock does not use aiter's Gluon kernel here: {reason}"


def contiguity_rule(call: Call, router: FlyDSLRouter) -> str | None:
    """Every FlyDSL API needs a layer-contiguous cache (its contiguity is part of the memo key)."""
    return None if call.kv_cache.is_contiguous() else strided_cache_reason(call.kv_cache)


def contract_rule(call: Call, router: FlyDSLRouter) -> str | None:
    """The found API's exact contract: the common one plus its own limits."""
    return router.variant.violation(call)


def window_rule(call: Call, router: FlyDSLRouter) -> str | None:
    """Written columns equal read columns: FlyDSL writes ``[0, ctx_b - next_n + i]`` of row ``(b, i)``.

    ``ctx_b`` is the last column of vLLM's bounds; the consumers read row ``r`` over ``[0,
    bounds.reshape(-1)[r])``, or one entry per sequence repeated over its rows. They agree for
    ``next_n == 1`` with one bound per row, and for ``next_n > 1`` with a ``(B, next_n)`` native table
    from an audited caller, ``compress_ratio == 1`` and DCP 1. Anything else can read a column FlyDSL
    never writes, where Gluon writes ``-inf``.
    """
    next_n, context_lens = call.q_fp8.shape[1], call.context_lens
    if next_n == 1:
        if context_lens.dim() == 2 and context_lens.shape[1] != 1:
            return f"next_n=1 with {context_lens.shape[1]} bounds per sequence"
        return None
    if context_lens.dim() != 2 or context_lens.shape[1] != next_n:
        return (
            f"next_n={next_n} without a (B, next_n) bounds table: "
            "consumers read columns FlyDSL does not write"
        )
    objection = multi_row_objection(call.caller)
    if objection is not None:
        return objection
    if call.compress_ratio != 1:
        return (
            f"next_n={next_n} with compress_ratio={call.compress_ratio}: compressed bounds are not one apart"
        )
    if call.dcp_world_size != 1:
        return f"next_n={next_n} with decode context parallel size {call.dcp_world_size}: localised bounds"
    return None


def layout_rule(call: Call, router: FlyDSLRouter) -> str | None:
    """FlyDSL is launched with the cache layout (``Preshuffle``) stock passes Gluon, or not at all."""
    block_size = call.kv_cache.shape[1]
    layout = router.hooks.preshuffle(block_size)
    told = router.variant.preshuffle(block_size)
    if told != layout:
        return (
            f"stock reads this KVBlockSize={block_size} cache with Preshuffle={layout}, "
            f"FlyDSL would be launched with Preshuffle={told}"
        )
    return None


def dispatcher_rule(call: Call, router: FlyDSLRouter) -> str | None:
    """With aiter's dispatcher only its FlyDSL picks are taken: where its table picks Gluon it would
    re-tune Gluon's ChunkK/WavePerEU, so vLLM's original runs instead (the switch changes only the kernel)."""
    objection = router.variant.dispatch_objection
    return None if objection is None else objection(call, router.variant.preshuffle(call.kv_cache.shape[1]))


def pick_for(call: Call, router: FlyDSLRouter, cus: int) -> Pick | None:
    """The router's table's :class:`~vllm_flydsl_indexer.tuning.Pick` for this call, or ``None``."""
    if router.table is None:
        return None
    batch, next_n, heads, head_dim = call.q_fp8.shape
    return router.table.choice(cus, batch, next_n, heads, head_dim, call.kv_cache.shape[1])


def table_rule(call: Call, router: FlyDSLRouter) -> str | None:
    """A measured table keeps the call stock where it found stock (Gluon) faster, or where the FlyDSL
    launch it measured cannot be made: its rows disagree, or the found kernel cannot take the knob."""
    cus = cu_count(call.q_fp8.device)
    pick = pick_for(call, router, cus)
    if pick is None:
        return None
    _, next_n, heads, head_dim = call.q_fp8.shape
    shape = f"heads={heads} head_dim={head_dim} KVBlockSize={call.kv_cache.shape[1]} next_n={next_n}"
    if pick.backend != "flydsl":
        return f"{where(router.table, pick, cus)} measured stock (Gluon) faster for {shape}"
    if pick.conflict is not None:
        return f"{where(router.table, pick, cus)}: {pick.conflict} for {shape}"
    problem = router.variant.knob_problem(pick.wg_per_cu)
    if problem is not None:
        return f"{where(router.table, pick, cus)} measured FlyDSL with {problem}"
    return None


# In order; the first reason wins.
RULES = (
    gluon_rule,  # only the call stock sends to aiter's Gluon
    contiguity_rule,  # a layer-contiguous cache
    contract_rule,  # the found API's exact contract and limits
    window_rule,  # written columns equal read columns, per caller
    layout_rule,  # launched with stock's Preshuffle
    dispatcher_rule,  # aiter's dispatcher: only where it launches FlyDSL
    table_rule,  # a measured table's per-shape choice and its launch
)


# --- The memo and the router. ---


class KernelConfig(NamedTuple):
    """A shape: what FlyDSL compiles, and what the log lines name."""

    heads: int
    head_dim: int
    block_size: int
    next_n: int

    def describe(self) -> str:
        return (
            f"heads={self.heads} head_dim={self.head_dim} KVBlockSize={self.block_size} next_n={self.next_n}"
        )


def _config_of(q_fp8: torch.Tensor, kv_cache: torch.Tensor) -> KernelConfig | None:
    if q_fp8.dim() != 4 or kv_cache.dim() < 2:
        return None
    _, next_n, heads, head_dim = q_fp8.shape
    return KernelConfig(heads, head_dim, kv_cache.shape[1], next_n)


def call_facts(args: tuple, dcp_world_size: int) -> tuple:
    """What the rules read besides the memo key: dtypes, q's and the weights' contiguity, the other
    shapes, the device and the DCP size."""
    q, kv, w, lens, bt = args[:5]
    return (
        dcp_world_size,
        q.dtype,
        kv.dtype,
        w.dtype,
        w.shape,
        lens.dtype,
        bt.dtype,
        bt.shape,
        q.is_contiguous(),
        w.is_contiguous(),
        q.device,
    )


@dataclass(slots=True)
class Route:
    """The memoised verdict for one call signature: a reason to stay stock, or how to launch."""

    reason: str | None
    config: KernelConfig | None = None
    caller: str | None = None
    kwargs: dict[str, object] = field(default_factory=dict)
    note: str = ""  # the launch's knob and the tuned row that chose it (the first-taken log line)
    facts: tuple = ()  # the call's facts (call_facts) the verdict was decided on
    bounds: str = ""  # the kind of bounds: "(B,)" or "(B, next_n)"
    ready: bool = False  # compiled outside capture and announced: the plain fast path applies

    @property
    def key(self) -> tuple:
        """The configuration: the shape and every launch knob (the canary's key)."""
        return (self.config, tuple(sorted(self.kwargs.items())))

    @property
    def test_key(self) -> tuple:
        """What the self-test proves once: the shape and the kind of bounds, not batch or SplitKV."""
        return (self.config, self.bounds)

    def describe(self) -> str:
        return describe_configuration(self.key)


def describe_configuration(key: tuple) -> str:
    """A :attr:`Route.key` (shape, knobs) or :attr:`Route.test_key` (shape, bounds) in words."""
    config, detail = key
    if isinstance(detail, str):
        return f"{config.describe()} bounds {detail}"
    named = " ".join(f"{k}={v}" for k, v in detail if k != "KVBlockSize")
    return f"{config.describe()} {named}".rstrip()


def canary_sequences(batch: int, next_n: int, max_model_len: int) -> list[int]:
    """The sequences whose rows the canary compares, spread from the first to the last: as many as fit
    in :data:`CANARY_BYTES` of float32 rows, at least one."""
    fit = min(batch, max(1, CANARY_BYTES // (4 * max_model_len * next_n)))
    if fit == 1:
        return [0]
    return sorted({round(i * (batch - 1) / (fit - 1)) for i in range(fit)})


@functools.cache
def _stack_versions() -> str:
    """``flydsl X, aiter Y`` from the installed distributions ("unknown" if absent); read once, lazily."""
    flydsl, aiter = installed_version(("flydsl",)), installed_version(AITER_DISTRIBUTIONS)
    return f"flydsl {flydsl[0] if flydsl else 'unknown'}, aiter {aiter[0] if aiter else 'unknown'}"


def _is_capturing() -> bool:
    # Nothing captures before CUDA/HIP is initialised; is_initialized() is a cheap flag read.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class FlyDSLRouter:
    """Callable with ``rocm_fp8_paged_mqa_logits``'s signature. The patch calls :meth:`call_from` with
    the calling module; a plain call is an unknown caller, which may take ``next_n == 1`` only.

    ``self_test`` (on by default): each shape's first call outside capture first runs its self-test;
    ``self_tests`` records each outcome by :attr:`Route.test_key` (``None``: passed). ``verifier``, when
    given, is the canary: ``verifier(stock_rows, flydsl_rows, ends) -> None | what differed``, at each
    configuration's first eligible call outside capture, one sequence at a time.
    """

    def __init__(
        self,
        original: Callable[..., torch.Tensor],
        variant: KernelVariant,
        hooks: StockHooks,
        logger: logging.Logger,
        verifier: Callable[..., str | None] | None = None,
        is_capturing: Callable[[], bool] = _is_capturing,
        table: TunedTable | None = None,
        self_test: bool = True,
    ) -> None:
        self.original = original
        self.table = table
        self.variant = variant
        self.hooks = hooks
        self.logger = logger
        self.verifier = verifier
        self.is_capturing = is_capturing
        self.self_test = self_test
        self.compiled: set[KernelConfig] = set()
        self.failed: dict[KernelConfig, str] = {}  # shapes whose self-test, launch, canary or routing failed
        self.self_tests: dict[tuple, str | None] = {}
        self.verified: set[tuple] = set()  # the configurations the canary checked
        self.rejected: list[str] = []  # why the kernel rejected a call's arguments, per rejected route
        self._routes: dict[tuple, Route] = {}
        self.calls_taken = 0
        self.calls_delegated = 0

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.call_from(None, *args, **kwargs)

    def call_from(
        self,
        caller: str | None,
        q_fp8: torch.Tensor,
        kv_cache_fp8: torch.Tensor,
        weights: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        schedule_metadata: torch.Tensor,
        max_model_len: int,
        *,
        compress_ratio: int = 1,
    ) -> torch.Tensor:
        """Route one call made from module ``caller`` (``None``: unknown)."""
        key = route = None
        try:
            key = (
                q_fp8.shape,
                kv_cache_fp8.shape,
                kv_cache_fp8.is_contiguous(),
                context_lens.shape,
                max_model_len,
                compress_ratio,
                caller,
            )
            route = self._routes.get(key)
            # The hot path of a memoised stock verdict (every step, once warm) reads nothing more.
            if route is None or route.reason is None:
                args = (q_fp8, kv_cache_fp8, weights, context_lens, block_tables)
                args += (schedule_metadata, max_model_len)
                out = self._flydsl_or_none(key, route, args, compress_ratio, caller)
                if out is not None:
                    return out
        except Exception as e:  # noqa: BLE001 - nothing the router does may reach vLLM
            self._router_failed(e, key, route, q_fp8, kv_cache_fp8)
        self.calls_delegated += 1
        return self.original(
            q_fp8,
            kv_cache_fp8,
            weights,
            context_lens,
            block_tables,
            schedule_metadata,
            max_model_len,
            compress_ratio=compress_ratio,
        )

    def _flydsl_or_none(
        self, key: tuple, route: Route | None, args: tuple, compress_ratio: int, caller: str | None
    ) -> torch.Tensor | None:
        """FlyDSL's answer to a call whose memoised verdict is not stock, or ``None`` for stock's."""
        if route is None:
            route = self._memoise(key, args, compress_ratio, caller)  # decided on this call's facts
        elif route.reason is None:
            facts = call_facts(args, self.hooks.dcp_world_size())
            if facts != route.facts:
                key = (key, facts)
                route = self._routes.get(key) or self._memoise(key, args, compress_ratio, caller)
        if route.reason is not None:
            return None
        if route.ready:
            return self._launch(route, args)
        return self._first_calls(route, args, compress_ratio)

    def _memoise(self, key: tuple, args: tuple, compress_ratio: int, caller: str | None) -> Route:
        """The rules' verdict on a new call signature, kept while the memo has room. A shape that failed
        stays stock without asking anything again."""
        config = _config_of(args[0], args[1])
        if config in self.failed:
            route = Route(self.failed[config])
        else:
            dcp = self.hooks.dcp_world_size()
            route = self._new_route(Call.of(args, compress_ratio, caller, dcp))
            route.facts = call_facts(args, dcp)
        if route.reason is not None:
            log_once(self.logger, logging.INFO, "%s %s", STOCK_CALL_LINE, route.reason)
        if len(self._routes) < MAX_MEMOISED_VERDICTS:
            self._routes[key] = route
        return route

    def _new_route(self, call: Call) -> Route:
        """The rules' verdict on ``call``, and its launch where they all pass (no memo, no log)."""
        cus = cu_count(call.q_fp8.device)
        self._drop_foreign_table(cus)
        for rule in RULES:
            reason = rule(call, self)
            if reason is not None:
                return Route(reason)
        config = _config_of(call.q_fp8, call.kv_cache)
        # The table rule has passed: a FlyDSL pick here is launched with its row's knob, as measured.
        pick = pick_for(call, self, cus)
        wg_per_cu = pick.wg_per_cu if pick is not None else 0
        kwargs = self.variant.launch_kwargs(
            call.q_fp8.shape[0], config.block_size, call.max_model_len, cus, wg_per_cu
        )
        note = self.variant.describe_launch(wg_per_cu)
        if pick is not None:
            note = f"{where(self.table, pick, cus)} measured FlyDSL faster; {note}"
        bounds = "(B, next_n)" if call.context_lens.dim() == 2 else "(B,)"
        return Route(None, config, call.caller, kwargs, f"; {note}", bounds=bounds)

    def _drop_foreign_table(self, cus: int) -> None:
        """A table with no rows for this GPU's CU count is dropped, with one WARNING (INFO for the
        built-in table, which the user did not ask for: it applies where it was measured only)."""
        table = self.table
        if table is None or cus in table.cu_counts():
            return
        level = logging.INFO if table.origin == "built-in" else logging.WARNING
        counts = sorted(table.cu_counts())
        line = f"{table.name} has {table.gfx} rows for CU count(s) {counts}, none for this GPU's {cus} CUs"
        self.logger.log(level, "%s %s", TABLE_IGNORED_LINE, line)
        self.table = None

    def _first_calls(self, route: Route, args: tuple, compress_ratio: int) -> torch.Tensor | None:
        """A route's first calls (the capture guard, the self-test, the canary): FlyDSL's answer, or
        ``None`` for stock's."""
        config = route.config
        capturing = self.is_capturing()
        untested = self.self_test and route.test_key not in self.self_tests
        if capturing and (config not in self.compiled or untested):
            # FlyDSL JIT-compiles a shape on its first call, and the self-test allocates and syncs:
            # neither may happen inside graph capture, so this graph keeps stock.
            what = (
                f"compiled and self-tested for {describe_configuration(route.test_key)}"
                if untested
                else f"compiled for {config.describe()}"
            )
            line = (
                f"FlyDSL not yet {what} and the stream is capturing, so this graph keeps the stock path. "
                "vLLM runs eager warm-up steps before it captures, so this is unexpected: please report it "
                "with your vLLM version and compilation config"
            )
            log_once(self.logger, logging.WARNING, "%s %s", STOCK_CALL_LINE, line)
            return None
        if untested:
            problem = self._self_test(route, args, compress_ratio)
            self.self_tests[route.test_key] = problem
            if problem is not None:
                self._shape_failed(route, f"self-test failed: {problem}")
                return None
        if self.verifier is not None and not capturing and route.key not in self.verified:
            self.verified.add(route.key)
            return self._verified_call(route, args, compress_ratio)
        return self._launch(route, args)

    def _self_test(self, route: Route, args: tuple, compress_ratio: int) -> str | None:
        """FlyDSL itself on a small synthetic problem of this shape, against stock: ``None`` if they agree.
        It launches SplitKV 1 and the largest SplitKV any live launch of this shape reaches, clamped to
        the problem's pages (:meth:`~vllm_flydsl_indexer.kernels.KernelVariant.self_test_launches`)."""
        q_fp8, kv_cache, _, context_lens, _, _, max_model_len = args
        config = route.config
        per_row = context_lens.dim() == 2
        problem = selftest.synthetic(*config, kv_cache.shape[3], per_row_bounds=per_row, device=q_fp8.device)
        pages = selftest.width(config.block_size, config.next_n)[1]
        most = max(self.variant.split_kv_workgroups_per_cu or 0, *TUNER_WG_PER_CU)
        top = explicit_split_kv(cu_count(q_fp8.device), 1, max_model_len, config.block_size, most)
        fn = self.variant.flydsl or self.variant.fn
        launches = {
            name: functools.partial(self._flydsl, fn, knobs)
            for name, knobs in self.variant.self_test_launches(route.kwargs, min(pages, top)).items()
        }
        try:
            stock = functools.partial(self.original, compress_ratio=compress_ratio)
            live = (q_fp8.shape[0] * q_fp8.shape[1], max_model_len)
            return selftest.run(problem, lambda a: stock(*a), self.hooks.output_buffer, launches, live)
        except Exception as e:  # noqa: BLE001 - a self-test that raises is a failed one
            return f"raised {type(e).__name__}: {e}"

    def _flydsl(self, fn: Callable, kwargs: dict, args: tuple, out: torch.Tensor) -> None:
        """A FlyDSL launch, live or self-test, into ``out``."""
        q_fp8, kv_cache, weights, context_lens, block_tables, _, max_model_len = args
        lens = self.hooks.per_sequence_lens(context_lens)
        fn(q_fp8, kv_cache, weights, out, lens, block_tables, max_model_len, **kwargs)

    def _launch(self, route: Route, args: tuple) -> torch.Tensor | None:
        """FlyDSL into the logits buffer taken exactly as stock takes it; ``None`` for stock's."""
        q_fp8, _, _, _, _, _, max_model_len = args
        out = self.hooks.output_buffer(q_fp8.shape[0] * q_fp8.shape[1], max_model_len)
        try:
            self._flydsl(self.variant.fn, route.kwargs, args, out)
        except ARGUMENT_ERRORS as e:
            # The wrapper's argument check refused this call: only its signature's route stays stock.
            route.reason = f"FlyDSL rejected this call's arguments earlier ({type(e).__name__}: {e})"
            route.ready = False
            self.rejected.append(route.reason)
            line = (
                f"{self.variant.location} ({route.describe()}) rejected a call's arguments: "
                f"{type(e).__name__}: {e} ({_stack_versions()}). Calls of this signature use the stock path; "
                "the rest of this configuration is unaffected."
            )
            log_once(self.logger, logging.ERROR, "%s %s", HEAD, line)
            return None
        except Exception as e:  # noqa: BLE001 - a kernel that fails sends its shape to stock
            self._shape_failed(route, f"raised {type(e).__name__}: {e}")
            return None
        if not route.ready and not self.is_capturing():
            # Compiled outside capture: announced once, and fast from now on.
            self.compiled.add(route.config)
            route.ready = True
            tested = "; self-test passed" if self.self_tests.get(route.test_key, "") is None else ""
            where = f"caller {route.caller or 'unknown'}; {self.variant.location}{route.note}{tested}"
            log_once(
                self.logger, logging.INFO, "%s FlyDSL taken for %s (%s)", HEAD, route.config.describe(), where
            )
        self.calls_taken += 1
        return out

    def _router_failed(
        self, error: Exception, key: tuple | None, route: Route | None, q_fp8: object, kv_cache: object
    ) -> None:
        """The router's work on a call raised: this call gets stock's answer, its shape stays stock."""
        try:
            config = route.config if route is not None and route.config else _config_of(q_fp8, kv_cache)
        except Exception:  # noqa: BLE001 - arguments without shapes: no shape to keep stock
            config = None
        problem = f"raised {type(error).__name__} while routing this call: {error}"
        if config is not None:
            self._shape_failed(route or Route(None, config), problem)
            return
        if key is not None and len(self._routes) < MAX_MEMOISED_VERDICTS:
            self._routes[key] = Route(f"the router {problem}")
        log_once(self.logger, logging.ERROR, "%s the router %s. It uses the stock path.", HEAD, problem)

    def _shape_failed(self, route: Route, problem: str) -> None:
        """This shape stays stock for good (every memoised route of it too), with one ERROR."""
        config = route.config
        described = route.describe() if route.kwargs else config.describe()
        self.failed[config] = f"FlyDSL for {described} earlier {problem}"
        self.compiled.discard(config)
        self._routes.clear()  # every memoised route of this shape now says stock
        where = f"{self.variant.location} ({described}) {problem} ({_stack_versions()})"
        self.logger.error(
            "%s %s. This call and every later call of this shape use the stock path.", HEAD, where
        )

    def _verified_call(self, route: Route, args: tuple, compress_ratio: int) -> torch.Tensor | None:
        """The canary: both arms on this call's live inputs, compared on a sample of rows.

        Stock runs first; only the rows of :func:`canary_sequences` are copied (a few MB at most).
        FlyDSL then runs into the same buffer filled with NaN, so a column it fails to write shows as
        NaN inside a read window. On disagreement this shape stays stock and stock runs again.
        """
        q_fp8, _, _, context_lens, _, _, max_model_len = args
        batch, next_n = q_fp8.shape[:2]
        sequences = canary_sequences(batch, next_n, max_model_len)
        stock_out = self.original(*args, compress_ratio=compress_ratio)
        stock = torch.cat([stock_out[b * next_n : (b + 1) * next_n] for b in sequences])
        self.hooks.output_buffer(batch * next_n, max_model_len).fill_(float("nan"))
        out = self._launch(route, args)
        if out is None:
            return None
        ends = selftest.read_window_ends(context_lens, batch * next_n, next_n)
        problem = None
        for i, b in enumerate(sequences):
            rows = slice(b * next_n, (b + 1) * next_n)
            problem = self.verifier(stock[i * next_n : (i + 1) * next_n], out[rows], ends[rows])
            if problem is not None:
                break
        if problem is None:
            line = (
                f"verify-on-enable canary passed for {route.describe()} (arms agree inside the read windows)"
            )
            self.logger.info("%s %s", HEAD, line)
            return out
        self.calls_taken -= 1
        self._shape_failed(route, f"and stock {DISAGREE_LINE} in the canary: {problem}")
        return None
