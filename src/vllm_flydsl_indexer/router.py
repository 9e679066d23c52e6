# SPDX-License-Identifier: Apache-2.0
"""The FlyDSL router for vLLM's decode-logits call. Imports no vLLM.

:class:`FlyDSLRouter` is what the patch installs in place of
``rocm_fp8_paged_mqa_logits``. Every call is either taken, and launched on the
identified FlyDSL API (:mod:`vllm_flydsl_indexer.kernels`), or handed to the
original function unchanged. The decision reads only shapes, dtypes, strides,
Python arguments and the calling module: never tensor values, so it issues no
host sync and is the same during CUDA/HIP graph capture as outside it.

The router only composes :data:`vllm_flydsl_indexer.rules.RULES`, the ordered
list of every rule (each returns ``None`` or a short reason; the first reason
is what the log says, once, for the stock path). ``live`` rules run on every
call (they read what a memoised verdict cannot: vLLM's module state) and take
only ``(compress_ratio, KVBlockSize)``; the others read a :class:`Call` and are
memoised on the call's signature (:func:`call_key`, which includes the cache's
contiguity), so a Call is built only on a memo miss. The router, not a rule,
drops a tuned table that has no rows for this GPU's CU count. After the rules,
guards that depend on the router's own history: **no first-time compile
inside graph capture**, **a configuration proves itself before it is used**
(the self-test of :mod:`vllm_flydsl_indexer.selftest`, at its first call
outside capture), and **a configuration whose kernel raised or disagreed stays
stock**. A configuration is the launch: heads, head_dim, KVBlockSize, next_n
and the launch's knobs (:attr:`Route.key`). Any exception from the FlyDSL
launch, or from the router's own work on a call (the rules, the launch's
keyword arguments), returns stock's answer for that call and logs one ERROR;
nothing reaches vLLM. A kernel's argument check (:data:`ARGUMENT_ERRORS`)
rejects only that call signature's route; anything else (compile, launch, the
router's own work) sends the whole configuration to stock for good.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vllm_flydsl_indexer import selftest, tuning
from vllm_flydsl_indexer._logging import (
    DISAGREE_LINE,
    HEAD,
    STOCK_CALL_LINE,
    TABLE_IGNORED_LINE,
    log_once,
)
from vllm_flydsl_indexer.agreement import read_window_ends
from vllm_flydsl_indexer.identification import AITER_DISTRIBUTIONS, installed_version
from vllm_flydsl_indexer.kernels import KernelVariant, cu_count
from vllm_flydsl_indexer.rules import LIVE_RULES, MEMOISED_RULES
from vllm_flydsl_indexer.stock import StockHooks
from vllm_flydsl_indexer.target import Call, call_key
from vllm_flydsl_indexer.tuning import TunedTable

__all__ = [
    "ARGUMENT_ERRORS",
    "FlyDSLRouter",
    "KernelConfig",
    "MAX_MEMOISED_VERDICTS",
    "Route",
    "canary_sequences",
    "describe_configuration",
]

# Distinct call signatures (mostly batch sizes) whose verdicts are memoised.
MAX_MEMOISED_VERDICTS = 4096
# What aiter's wrappers raise from their argument checks, before anything is compiled or launched
# (Python's own exceptions for bad arguments: ``assert``, ``raise ValueError``/``TypeError``). They
# reject that call signature only; any other exception disables the kernel configuration.
ARGUMENT_ERRORS = (ValueError, TypeError, AssertionError)


class KernelConfig(NamedTuple):
    """What FlyDSL compiles, and what the first-taken log line names (a tuple: cheap to hash)."""

    heads: int
    head_dim: int
    block_size: int
    next_n: int

    def describe(self) -> str:
        return (
            f"heads={self.heads} head_dim={self.head_dim} KVBlockSize={self.block_size} next_n={self.next_n}"
        )


def _is_capturing() -> bool:
    # Nothing can be capturing before CUDA/HIP is initialised; is_initialized()
    # is a cheap flag read, unlike is_available(), which can query the driver.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@dataclass(slots=True)
class Route:
    """The memoised verdict for one call signature: a reason to stay stock, or how to launch."""

    reason: str | None
    config: KernelConfig | None = None
    caller: str | None = None
    kwargs: dict[str, object] = field(default_factory=dict)
    # The launch's knob, and the tuned row that chose it (for the first-taken log line).
    note: str = ""
    # Compiled outside capture and announced in the log: the plain fast path applies.
    ready: bool = False

    @property
    def key(self) -> tuple:
        """The configuration: what FlyDSL compiles and every launch knob (a self-test each)."""
        return (self.config, tuple(sorted(self.kwargs.items())))

    def describe(self) -> str:
        """The configuration in words, for the log."""
        return describe_configuration(self.key)


def describe_configuration(key: tuple) -> str:
    """A :attr:`Route.key` in words: the shape, then every launch knob but KVBlockSize (named already)."""
    config, knobs = key
    named = " ".join(f"{k}={v}" for k, v in knobs if k != "KVBlockSize")
    return f"{config.describe()} {named}".rstrip()


class FlyDSLRouter:
    """Callable with ``rocm_fp8_paged_mqa_logits``'s signature.

    The patch calls :meth:`call_from` with the calling module; a plain call is
    an unknown caller, which may take ``next_n == 1`` only.

    ``self_test`` (on by default): each configuration's first call outside
    graph capture first runs :func:`vllm_flydsl_indexer.selftest.run`; a
    configuration that fails it (or raises) stays stock, with one ERROR.
    ``self_tests`` records each configuration's outcome (``None``: passed).

    ``verifier``, when given, is the canary: at each configuration's first
    eligible call made outside graph capture, it is called on a sample of rows,
    one sequence at a time, as ``verifier(stock_rows, flydsl_rows, ends)``; it
    returns ``None`` when the arms agree, else a message. On disagreement that
    configuration stays stock.
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
        # The shapes that failed (their self-test, a launch or the canary), whatever the knobs; and
        # each configuration's self-test outcome, keyed by Route.key.
        self.failed: dict[KernelConfig, str] = {}
        self.self_tests: dict[tuple, str | None] = {}
        self.verified: set[tuple] = set()  # the configurations the canary checked
        # Why the kernel rejected a call's arguments (ARGUMENT_ERRORS), one entry per rejected route.
        self.rejected: list[str] = []
        self._routes: dict[tuple, Route] = {}
        self.calls_taken = 0
        self.calls_delegated = 0

    def _memoise(self, key: tuple, call: Call) -> Route:
        """The memoised rules' verdict on a call not seen before, kept while the memo has room."""
        route = self._new_route(call)
        if len(self._routes) < MAX_MEMOISED_VERDICTS:
            self._routes[key] = route
        return route

    def _new_route(self, call: Call) -> Route:
        cus = cu_count(call.q_fp8.device)
        self._drop_foreign_table(cus)
        for rule in MEMOISED_RULES:
            reason = rule(call, self)
            if reason is not None:
                return Route(reason)
        batch, next_n, heads, head_dim = call.q_fp8.shape
        block_size = call.kv_cache.shape[1]
        config = KernelConfig(heads, head_dim, block_size, next_n)
        if config in self.failed:
            return Route(self.failed[config])
        # The table rule has passed: a FlyDSL pick here is launched with its row's knob, as measured.
        pick = tuning.pick_for(call, self, cus)
        wg_per_cu = pick.wg_per_cu if pick is not None else 0
        kwargs = self.variant.launch_kwargs(batch, block_size, call.max_model_len, cus, wg_per_cu)
        note = self.variant.describe_launch(wg_per_cu)
        if pick is not None:
            note = f"{tuning.where(self.table, pick, cus)} measured FlyDSL faster; {note}"
        return Route(None, config, call.caller, kwargs, f"; {note}")

    def _drop_foreign_table(self, cus: int) -> None:
        """A table with no rows for this GPU's CU count is dropped, with one WARNING (INFO for the
        built-in table, which the user did not ask for: it applies where it was measured only)."""
        table = self.table
        if table is None or cus in table.cu_counts():
            return
        self.logger.log(
            logging.INFO if table.origin == "built-in" else logging.WARNING,
            "%s %s has %s rows for CU count(s) %s, none for this GPU's %d CUs",
            TABLE_IGNORED_LINE,
            table.name,
            table.gfx,
            sorted(table.cu_counts()),
            cus,
        )
        self.table = None

    def _delegate(
        self, reason: str, args: tuple, compress_ratio: int, level: int = logging.INFO
    ) -> torch.Tensor:
        self.calls_delegated += 1
        log_once(self.logger, level, "%s %s", STOCK_CALL_LINE, reason)
        return self.original(*args, compress_ratio=compress_ratio)

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
        args = (q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata, max_model_len)
        for rule in LIVE_RULES:
            reason = rule(compress_ratio, kv_cache_fp8.shape[1], self)
            if reason is not None:
                return self._delegate(reason, args, compress_ratio)
        dcp = self.hooks.dcp_world_size()
        key = call_key(args, compress_ratio, caller, dcp)
        route = self._routes.get(key)
        if route is None:
            # A Call is built only on a memo miss: the hot path looks its verdict up by the key alone.
            try:
                route = self._memoise(key, Call.of(args, compress_ratio, caller, dcp))
            except Exception as e:  # noqa: BLE001 - the router's own failure is stock's answer
                return self._route_failed(e, key, args, compress_ratio)
        if route.reason is not None:
            return self._delegate(route.reason, args, compress_ratio)
        if not route.ready:
            return self._first_calls(route, args, compress_ratio)
        return self._launch(route, args, compress_ratio)

    def _first_calls(self, route: Route, args: tuple, compress_ratio: int) -> torch.Tensor:
        """The rare paths: a route's first calls (self-test, compile, announce) and the canary."""
        config = route.config
        assert config is not None
        key = route.key
        if config in self.failed:
            return self._delegate(self.failed[config], args, compress_ratio)
        capturing = self.is_capturing()
        untested = self.self_test and key not in self.self_tests
        if capturing and (config not in self.compiled or untested):
            # FlyDSL JIT-compiles a configuration on its first call, and the self-test allocates
            # and syncs there: neither may happen inside graph capture, so this graph keeps stock.
            what = (
                f"compiled and self-tested for {route.describe()}"
                if untested
                else f"compiled for {config.describe()}"
            )
            reason = (
                f"FlyDSL not yet {what} and the stream is capturing, so this "
                "graph keeps the stock path. vLLM runs eager warm-up steps before it captures, so this "
                "is unexpected: please report it with your vLLM version and compilation config"
            )
            return self._delegate(reason, args, compress_ratio, logging.WARNING)
        if self.self_test and not capturing and key not in self.self_tests:
            problem = self._self_test(route, args, compress_ratio)
            self.self_tests[key] = problem
            if problem is not None:
                return self._config_failed(route, f"self-test failed: {problem}", args, compress_ratio)
        if self.verifier is not None and not capturing and key not in self.verified:
            self.verified.add(key)
            return self._verified_call(route, args, compress_ratio)
        return self._launch(route, args, compress_ratio)

    def _self_test(self, route: Route, args: tuple, compress_ratio: int) -> str | None:
        """This configuration on a small synthetic problem, FlyDSL against stock: ``None`` if they agree."""
        q_fp8, kv_cache, _, context_lens, _, _, _ = args
        _, next_n, heads, head_dim = q_fp8.shape
        problem = selftest.synthetic(
            heads,
            head_dim,
            kv_cache.shape[1],
            next_n,
            kv_cache.shape[3],
            per_row_bounds=context_lens.dim() == 2,
            device=q_fp8.device,
        )
        try:
            # The live call's exact launch knobs (SplitKV included): splits past a short sequence's
            # pages are what every live call's shorter sequences get too.
            return selftest.run(
                problem,
                lambda a: self.original(*a, compress_ratio=compress_ratio),
                self.hooks.output_buffer,
                lambda a, out: self._flydsl(route, a, out),
                exact_writes=not self.variant.own_table,
                live=(q_fp8.shape[0] * q_fp8.shape[1], args[6]),
            )
        except Exception as e:  # noqa: BLE001 - a self-test that raises is a failed one
            return f"raised {type(e).__name__}: {e}"

    def _flydsl(self, route: Route, args: tuple, out: torch.Tensor) -> None:
        """The FlyDSL launch of every call, live or self-test, into ``out``."""
        q_fp8, kv_cache, weights, context_lens, block_tables, _, max_model_len = args
        self.variant.fn(
            q_fp8,
            kv_cache,
            weights,
            out,
            self.hooks.per_sequence_lens(context_lens),
            block_tables,
            max_model_len,
            **route.kwargs,
        )

    def _launch(self, route: Route, args: tuple, compress_ratio: int) -> torch.Tensor:
        """FlyDSL into the logits buffer obtained exactly as stock obtains it; never raises."""
        q_fp8, _, _, _, _, _, max_model_len = args
        out = self.hooks.output_buffer(q_fp8.shape[0] * q_fp8.shape[1], max_model_len)
        try:
            self._flydsl(route, args, out)
        except Exception as e:  # noqa: BLE001 - nothing the kernel raises may reach vLLM
            return self._kernel_failed(e, args, compress_ratio, route)
        if not route.ready:
            self._settle(route)
        self.calls_taken += 1
        return out

    def _settle(self, route: Route) -> None:
        """After a route's successful launch outside capture: compiled, announced, fast from now on."""
        if self.is_capturing():
            return
        config = route.config
        self.compiled.add(config)
        route.ready = True
        tested = "; self-test passed" if self.self_tests.get(route.key, "") is None else ""
        log_once(
            self.logger,
            logging.INFO,
            "%s FlyDSL taken for %s (caller %s; %s%s%s)",
            HEAD,
            config.describe(),
            route.caller or "unknown",
            self.variant.location,
            route.note,
            tested,
        )

    def _route_failed(self, error: Exception, key: tuple, args: tuple, compress_ratio: int) -> torch.Tensor:
        """The router's own work on a call raised: stock's answer, and its configuration stays stock."""
        q_fp8, kv_cache = args[0], args[1]
        reason = f"the router raised {type(error).__name__} building this call's route: {error}"
        if q_fp8.dim() == 4 and kv_cache.dim() >= 2:
            _, next_n, heads, head_dim = q_fp8.shape
            config = KernelConfig(heads, head_dim, kv_cache.shape[1], next_n)
            self.failed[config] = f"{reason} (for {config.describe()}, earlier)"
            self._routes.clear()  # no memoised route of this configuration launches again
        if len(self._routes) < MAX_MEMOISED_VERDICTS:
            self._routes[key] = Route(reason)
        self.logger.error(
            "%s %s. This call and every later call of this configuration use the stock path.", HEAD, reason
        )
        self.calls_delegated += 1
        return self.original(*args, compress_ratio=compress_ratio)

    def _kernel_failed(
        self, error: Exception, args: tuple, compress_ratio: int, route: Route
    ) -> torch.Tensor:
        if isinstance(error, ARGUMENT_ERRORS):
            # The wrapper's argument check refused this call: only its signature's route stays stock.
            route.reason = f"FlyDSL rejected this call's arguments earlier ({type(error).__name__}: {error})"
            self.rejected.append(route.reason)
            route.ready = False
            log_once(
                self.logger,
                logging.ERROR,
                "%s %s (%s) rejected a call's arguments: %s: %s (%s). Calls of this signature use the "
                "stock path; the rest of this configuration is unaffected.",
                HEAD,
                self.variant.location,
                route.describe(),
                type(error).__name__,
                error,
                _stack_versions(),
            )
            self.calls_delegated += 1
            return self.original(*args, compress_ratio=compress_ratio)
        return self._config_failed(route, f"raised {type(error).__name__}: {error}", args, compress_ratio)

    def _config_failed(self, route: Route, problem: str, args: tuple, compress_ratio: int) -> torch.Tensor:
        """This configuration (its shape, whatever the knobs) stays stock for good, with one ERROR;
        this call gets stock's answer."""
        config = route.config
        self.failed[config] = f"FlyDSL for {route.describe()} earlier {problem}"
        self.compiled.discard(config)
        self._routes.clear()  # every memoised route of this configuration now says stock
        self.logger.error(
            "%s %s (%s) %s (%s). This call and every later call of this configuration use the stock path.",
            HEAD,
            self.variant.location,
            route.describe(),
            problem,
            _stack_versions(),
        )
        self.calls_delegated += 1
        return self.original(*args, compress_ratio=compress_ratio)

    def _verified_call(self, route: Route, args: tuple, compress_ratio: int) -> torch.Tensor:
        """The canary: both arms on this call's live inputs, compared on a sample of rows.

        Stock runs first; only its sampled rows are copied (:func:`canary_rows`,
        a few MB at most). FlyDSL then runs into the same buffer filled with NaN,
        so a column it fails to write shows as NaN inside a read window. The
        rows are compared one sequence at a time. On disagreement this
        configuration stays stock and stock runs again for this call's answer.
        """
        q_fp8, _, _, context_lens, _, _, max_model_len = args
        batch, next_n = q_fp8.shape[:2]
        sequences = canary_sequences(batch, next_n, max_model_len)
        stock_out = self.original(*args, compress_ratio=compress_ratio)
        stock = torch.cat([stock_out[b * next_n : (b + 1) * next_n] for b in sequences])
        self.hooks.output_buffer(batch * next_n, max_model_len).fill_(float("nan"))
        taken_before = self.calls_taken
        out = self._launch(route, args, compress_ratio)
        if self.calls_taken == taken_before:
            return out  # the kernel raised: _launch already returned stock's answer
        ends = read_window_ends(context_lens, batch * next_n, next_n)
        problem = None
        for i, b in enumerate(sequences):
            rows = slice(b * next_n, (b + 1) * next_n)
            problem = self.verifier(stock[i * next_n : (i + 1) * next_n], out[rows], ends[rows])
            if problem is not None:
                break
        if problem is None:
            self.logger.info(
                "%s verify-on-enable canary passed for %s (%s)",
                HEAD,
                route.describe(),
                "arms agree inside the read windows",
            )
            return out
        self.calls_taken -= 1
        problem = f"and stock {DISAGREE_LINE} in the canary: {problem}"
        return self._config_failed(route, problem, args, compress_ratio)


# The canary compares at most this many logits rows' bytes (whole sequences, at least one).
CANARY_BYTES = 4 << 20


def canary_sequences(batch: int, next_n: int, max_model_len: int) -> list[int]:
    """The sequences whose rows the canary compares, spread from the first to the last.

    As many as fit in :data:`CANARY_BYTES` of float32 rows, at least one.
    """
    fit = min(batch, max(1, CANARY_BYTES // (4 * max_model_len * next_n)))
    if fit == 1:
        return [0]
    return sorted({round(i * (batch - 1) / (fit - 1)) for i in range(fit)})


@functools.cache
def _stack_versions() -> str:
    """``flydsl X, aiter Y`` from the installed distributions ("unknown" if absent); read once, lazily."""

    def version(distributions: tuple[str, ...]) -> str:
        found = installed_version(distributions)
        return found[0] if found else "unknown"

    return f"flydsl {version(('flydsl',))}, aiter {version(AITER_DISTRIBUTIONS)}"
