# SPDX-License-Identifier: Apache-2.0
"""The FlyDSL adapter for vLLM's decode-logits call. Imports no vLLM.

:class:`FlyDSLRouter` is what the patch installs in place of
``rocm_fp8_paged_mqa_logits``. Every call is either taken, and launched on the
identified FlyDSL API (:mod:`vllm_flydsl_indexer.kernels`), or handed to the
original function unchanged. The decision reads only shapes, dtypes, strides,
Python arguments and the calling module: never tensor values, so it issues no
host sync and is the same during CUDA/HIP graph capture as outside it.

The router only composes rules that each live in one place, and memoises the
verdict on everything they read; the first rule that objects is the reason
logged (once) for the stock path:

1. **Stock would have used Gluon** (:class:`StockHooks`, vLLM's own helpers).
   Otherwise the call is not ours to change: the C4A Triton route, the torch
   fallback and other arches stay.
2. **The found kernel's exact contract** (:meth:`KernelVariant.violation
   <vllm_flydsl_indexer.kernels.KernelVariant.violation>`): the common FlyDSL
   contract plus that API's own limits. A strided cache (vLLM's block-outer
   KV cache layouts) is checked live on every call.
3. **Written columns equal read columns** (:func:`window_mismatch`, with the
   caller audit of :mod:`vllm_flydsl_indexer.callers`). FlyDSL writes exactly
   columns ``[0, ctx_b - next_n + i]`` of row ``(b, i)``, where ``ctx_b`` is the
   last column of vLLM's bounds, and has no ``-inf`` prefill. vLLM's consumers
   read row ``r`` over ``[0, bounds.reshape(-1)[r])``, or the sequence's single
   entry repeated ``next_n`` times. The two agree when:

   * ``next_n == 1``: every row reads ``[0, ctx_b)`` and FlyDSL writes
     ``[0, ctx_b - 1]``. Holds for plain and flattened speculative decode,
     index compression and DCP, whose bounds are per row, from any caller.
   * ``next_n > 1`` with a ``(B, next_n)`` table, from a call site audited to
     build vLLM's native-MTP table, passing ``compress_ratio == 1``, without
     decode context parallelism: ``[b, j] = max(0, L_b - next_n + j + 1)``, so
     the last column is ``L_b`` and every row's read bound equals FlyDSL's
     write bound (both empty when negative).

   Anything else can read a column FlyDSL never writes: compressed bounds
   (``floor`` makes neighbours equal; GLM-5-next's kpool indexer passes them
   without ``compress_ratio``), DCP-localised bounds, or one entry per
   sequence repeated over ``next_n > 1`` rows (Gluon fills those columns with
   ``-inf``). Those calls stay on the stock path.
4. **The same cache layout as stock**: FlyDSL's ``Preshuffle`` must be the
   one the original passes Gluon (:attr:`StockHooks.preshuffle`; vLLM 0.34.0
   asks ``indexer_k_cache_is_shuffled``), else the call stays stock.
5. **No first-time compile inside graph capture**, and **a configuration whose
   kernel raised stays stock** (:meth:`FlyDSLRouter.call_from`).

Any exception from the FlyDSL launch returns stock's answer for that call,
logs one ERROR, and sends that configuration to stock for good: nothing the
kernel raises reaches vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vllm_flydsl_indexer import callers
from vllm_flydsl_indexer._logging import log_once
from vllm_flydsl_indexer.kernels import KernelVariant, cu_count
from vllm_flydsl_indexer.tuning import TunedTable

# Distinct call signatures (mostly batch sizes) whose verdicts are memoised.
MAX_MEMOISED_VERDICTS = 4096


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


def strided_cache_reason(kv_cache: torch.Tensor) -> str:
    """The stock-path reason for a cache view that is not layer-contiguous, in actionable words."""
    blocks, block_size, _, index_dim = (tuple(kv_cache.shape) + (0, 0, 0, 0))[:4]
    return (
        f"kv_cache is strided (block stride {kv_cache.stride(0) if kv_cache.dim() else '?'} bytes, "
        f"not KVBlockSize*index_dim = {block_size * index_dim}): vLLM's block-outer KV cache layout "
        "(BLHNC/BLNHC, which the DeepSeek-V4/V4.1 indexer and GLM-5-next kpool tail backends require, "
        "or VLLM_KV_CACHE_LAYOUT / a KV connector choose) packs every layer's page inside each block; "
        "FlyDSL needs a layer-contiguous cache (LBNHC/LBHNC), so this layer stays on the stock path"
    )


def window_mismatch(
    next_n: int, context_lens: torch.Tensor, compress_ratio: int, dcp_world_size: int, caller: str | None
) -> str | None:
    """Why FlyDSL's written columns may differ from those vLLM reads, or ``None``.

    See the module docstring for the rule and :mod:`vllm_flydsl_indexer.callers`
    for which callers may pass ``next_n > 1``.
    """
    if next_n == 1:
        if context_lens.dim() == 2 and context_lens.shape[1] != 1:
            return f"next_n=1 with {context_lens.shape[1]} bounds per sequence"
        return None
    if context_lens.dim() != 2 or context_lens.shape[1] != next_n:
        return (
            f"next_n={next_n} without a (B, next_n) bounds table: "
            "consumers read columns FlyDSL does not write"
        )
    objection = callers.multi_row_objection(caller)
    if objection is not None:
        return objection
    if compress_ratio != 1:
        return f"next_n={next_n} with compress_ratio={compress_ratio}: compressed bounds are not one apart"
    if dcp_world_size != 1:
        return f"next_n={next_n} with decode context parallel size {dcp_world_size}: localised bounds"
    return None


def ineligibility(
    variant: KernelVariant,
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    compress_ratio: int,
    dcp_world_size: int,
    caller: str | None,
) -> str | None:
    """The FlyDSL-side reason this call must stay stock, or ``None`` to take it."""
    problem = variant.violation(q_fp8, kv_cache, weights, context_lens, block_tables)
    if problem is not None:
        return problem
    return window_mismatch(q_fp8.shape[1], context_lens, compress_ratio, dcp_world_size, caller)


@dataclass(frozen=True)
class StockHooks:
    """What the router needs from vLLM, injected so the core imports none of it.

    * ``stock_uses_gluon(compress_ratio, block_size)``: would the original send
      this call to aiter's gfx950 Gluon kernel?
    * ``output_buffer(rows, max_model_len)``: the logits buffer, obtained exactly
      as the original obtains it.
    * ``per_sequence_lens(context_lens)``: vLLM's own reduction to one length
      per sequence.
    * ``dcp_world_size()``: decode context parallel size of this process.
    * ``preshuffle(block_size)``: the ``Preshuffle`` the original passes Gluon,
      i.e. vLLM's indexer K cache layout for that block size.
    """

    stock_uses_gluon: Callable[[int, int], bool]
    output_buffer: Callable[[int, int], torch.Tensor]
    per_sequence_lens: Callable[[torch.Tensor], torch.Tensor]
    dcp_world_size: Callable[[], int]
    preshuffle: Callable[[int], bool]


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
    # Why FlyDSL, when a tuned table decided (for the first-taken log line).
    note: str = ""
    # Compiled outside capture and announced in the log: the plain fast path applies.
    ready: bool = False


class FlyDSLRouter:
    """Callable with ``rocm_fp8_paged_mqa_logits``'s signature.

    The patch calls :meth:`call_from` with the calling module; a plain call is
    an unknown caller, which may take ``next_n == 1`` only.

    ``verifier``, when given, is called once on the first eligible call made
    outside graph capture, as ``verifier(stock_out, flydsl_out, context_lens,
    next_n)``; it returns ``None`` when the arms agree, else a message. On
    disagreement this router sends every later call to the stock path.
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
    ) -> None:
        self.original = original
        self.table = table
        self.variant = variant
        self.hooks = hooks
        self.logger = logger
        self.verifier = verifier
        self.is_capturing = is_capturing
        self.compiled: set[KernelConfig] = set()
        self.failed: dict[KernelConfig, str] = {}
        self._routes: dict[tuple, Route] = {}
        self.disabled_reason: str | None = None
        self.calls_taken = 0
        self.calls_delegated = 0

    def _route(
        self, q_fp8, kv_cache, weights, context_lens, block_tables, max_model_len, compress_ratio, caller
    ) -> Route:
        """The memoised :class:`Route` for this call.

        Memoised on everything the rules read but the cache's contiguity:
        shapes, dtypes, q's contiguity, ``max_model_len``, the ratio, the DCP size
        and the caller fully decide it for a layer-contiguous cache, and
        contiguity is checked live. The memo is bounded.
        """
        if not kv_cache.is_contiguous():
            return Route(strided_cache_reason(kv_cache))
        key = (
            q_fp8.shape,
            kv_cache.shape,
            weights.shape,
            context_lens.shape,
            block_tables.shape,
            q_fp8.dtype,
            kv_cache.dtype,
            weights.dtype,
            context_lens.dtype,
            block_tables.dtype,
            q_fp8.is_contiguous(),
            max_model_len,
            compress_ratio,
            caller,
            self.hooks.dcp_world_size(),
        )
        route = self._routes.get(key)
        if route is None:
            route = self._new_route(
                q_fp8,
                kv_cache,
                weights,
                context_lens,
                block_tables,
                max_model_len,
                compress_ratio,
                caller,
                key[-1],
            )
            if len(self._routes) < MAX_MEMOISED_VERDICTS:
                self._routes[key] = route
        return route

    def _new_route(
        self, q_fp8, kv_cache, weights, context_lens, block_tables, max_model_len, compress_ratio, caller, dcp
    ) -> Route:
        reason = ineligibility(
            self.variant,
            q_fp8,
            kv_cache,
            weights,
            context_lens,
            block_tables,
            compress_ratio=compress_ratio,
            dcp_world_size=dcp,
            caller=caller,
        )
        if reason is not None:
            return Route(reason)
        batch, next_n, heads, head_dim = q_fp8.shape
        config = KernelConfig(heads, head_dim, kv_cache.shape[1], next_n)
        if config in self.failed:
            return Route(self.failed[config])
        cus = cu_count(q_fp8.device)
        note = ""
        if self.table is not None:
            pick = self._tuned_choice(cus, batch, config)
            if pick is not None:
                backend, bucket = pick
                where = (
                    f"tuned table {self.table.source}, batch >= {bucket} on {self.table.gfx} with {cus} CUs"
                )
                if backend != "flydsl":
                    return Route(f"{where} measured stock (Gluon) faster for {config.describe()}")
                note = f"; {where} measured FlyDSL faster"
        kwargs = self.variant.launch_kwargs(batch, kv_cache.shape[1], max_model_len, cus)
        layout = self.hooks.preshuffle(kv_cache.shape[1])
        if kwargs["Preshuffle"] != layout:
            return Route(
                f"stock reads this KVBlockSize={kv_cache.shape[1]} cache with Preshuffle={layout}, "
                f"FlyDSL would be launched with Preshuffle={kwargs['Preshuffle']}"
            )
        return Route(None, config, caller, kwargs, note)

    def _tuned_choice(self, cus: int, batch: int, config: KernelConfig) -> tuple[str, int] | None:
        """The tuned table's pick for an eligible call; the table is dropped if it has no rows for ``cus``."""
        assert self.table is not None
        if cus not in self.table.cu_counts():
            self.logger.warning(
                "vllm-flydsl-indexer: tuned table ignored: %s has %s rows for CU count(s) %s, none for this "
                "GPU's %d CUs",
                self.table.source,
                self.table.gfx,
                sorted(self.table.cu_counts()),
                cus,
            )
            self.table = None
            return None
        return self.table.choice(cus, batch, config.next_n, config.heads, config.head_dim, config.block_size)

    def _delegate(
        self, reason: str, args: tuple, compress_ratio: int, level: int = logging.INFO
    ) -> torch.Tensor:
        self.calls_delegated += 1
        log_once(self.logger, level, "vllm-flydsl-indexer: stock path for this call: %s", reason)
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
        if self.disabled_reason is not None:
            return self._delegate(self.disabled_reason, args, compress_ratio)
        if not self.hooks.stock_uses_gluon(compress_ratio, kv_cache_fp8.shape[1]):
            reason = (
                "stock does not use aiter's Gluon kernel here "
                f"(compress_ratio={compress_ratio}, block_size={kv_cache_fp8.shape[1]})"
            )
            return self._delegate(reason, args, compress_ratio)
        route = self._route(
            q_fp8, kv_cache_fp8, weights, context_lens, block_tables, max_model_len, compress_ratio, caller
        )
        if route.reason is not None:
            return self._delegate(route.reason, args, compress_ratio)
        if not route.ready or self.verifier is not None:
            return self._first_calls(route, args, compress_ratio)
        return self._launch(route, args, compress_ratio)

    def _first_calls(self, route: Route, args: tuple, compress_ratio: int) -> torch.Tensor:
        """The rare paths: a route's first calls (compile, announce) and the canary."""
        config = route.config
        assert config is not None
        if config in self.failed:
            return self._delegate(self.failed[config], args, compress_ratio)
        capturing = self.is_capturing()
        if capturing and config not in self.compiled:
            # FlyDSL JIT-compiles a configuration on its first call; that must
            # not happen inside graph capture: this graph keeps stock.
            reason = (
                f"FlyDSL not yet compiled for {config.describe()} and the stream is capturing, so this "
                "graph keeps the stock path. vLLM runs eager warm-up steps before it captures, so this "
                "is unexpected: please report it with your vLLM version and compilation config"
            )
            return self._delegate(reason, args, compress_ratio, logging.WARNING)
        if self.verifier is not None and not capturing:
            return self._verified_call(route, args, compress_ratio)
        return self._launch(route, args, compress_ratio)

    def _launch(self, route: Route, args: tuple, compress_ratio: int) -> torch.Tensor:
        """FlyDSL into the logits buffer obtained exactly as stock obtains it; never raises."""
        q_fp8, kv_cache, weights, context_lens, block_tables, _, max_model_len = args
        out = self.hooks.output_buffer(q_fp8.shape[0] * q_fp8.shape[1], max_model_len)
        try:
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
        log_once(
            self.logger,
            logging.INFO,
            "vllm-flydsl-indexer: FlyDSL taken for %s (caller %s; %s%s)",
            config.describe(),
            route.caller or "unknown",
            self.variant.location,
            route.note,
        )

    def _kernel_failed(
        self, error: Exception, args: tuple, compress_ratio: int, route: Route
    ) -> torch.Tensor:
        config = route.config
        assert config is not None
        self.failed[config] = (
            f"FlyDSL raised for {config.describe()} earlier ({type(error).__name__}: {error})"
        )
        self.compiled.discard(config)
        self._routes.clear()  # every memoised route of this configuration now says stock
        self.logger.error(
            "vllm-flydsl-indexer: %s (%s) raised %s: %s. This call and every later call of this "
            "configuration use the stock path.",
            self.variant.location,
            config.describe(),
            type(error).__name__,
            error,
        )
        self.calls_delegated += 1
        return self.original(*args, compress_ratio=compress_ratio)

    def _verified_call(self, route: Route, args: tuple, compress_ratio: int) -> torch.Tensor:
        """The canary: run both arms once on live inputs, keep FlyDSL only if they agree.

        The FlyDSL output is filled with NaN first, so a column it fails to write
        shows as NaN inside a read window instead of stock's value.
        """
        q_fp8, _, _, context_lens, _, _, max_model_len = args
        verifier, self.verifier = self.verifier, None
        stock = self.original(*args, compress_ratio=compress_ratio).clone()
        self.hooks.output_buffer(q_fp8.shape[0] * q_fp8.shape[1], max_model_len).fill_(float("nan"))
        taken_before = self.calls_taken
        out = self._launch(route, args, compress_ratio)
        if self.calls_taken == taken_before:
            return out  # the kernel raised: _launch already returned stock's answer
        problem = verifier(stock, out, context_lens, q_fp8.shape[1])
        if problem is None:
            self.logger.info(
                "vllm-flydsl-indexer: verify-on-enable canary passed (%s)",
                "arms agree inside the read windows",
            )
            return out
        self.disabled_reason = f"verify-on-enable canary failed earlier ({problem})"
        self.logger.error(
            "vllm-flydsl-indexer: FlyDSL and stock paged MQA logits DISAGREE on the "
            "first eligible call: %s. This process now uses the stock path for good.",
            problem,
        )
        out.copy_(stock)
        self.calls_taken -= 1
        self.calls_delegated += 1
        return out
