# SPDX-License-Identifier: Apache-2.0
"""The FlyDSL adapter for vLLM's decode-logits call. Imports no vLLM.

:class:`FlyDSLRouter` is what the patch installs in place of
``rocm_fp8_paged_mqa_logits``. Every call is either taken, and sent to
aiter's FlyDSL kernel through :func:`run_flydsl`, or handed to the original
function unchanged. The decision reads only shapes, dtypes, strides and
Python arguments: never tensor values, so it issues no host sync and is the
same during CUDA/HIP graph capture as outside it.

vLLM's own decisions (aiter enabled, the C4A route, the workspace buffer) are
injected as :class:`StockHooks`, so the router runs without vLLM in tests and
on CUDA. :mod:`vllm_flydsl_indexer.patch` builds the hooks from vLLM.

Eligibility (see :func:`ineligibility`):

1. **Stock would have used Gluon.** Otherwise the call is not ours to
   change: the C4A Triton route, the torch fallback and other arches stay.
2. **FlyDSL's contract holds exactly** (aiter PR #4221's asserts and silent
   hazards): uint8, contiguous ``(num_blocks, KVB, 1, index_dim)`` cache with
   ``index_dim >= head_dim + 4`` and fewer than 2**31 bytes (i32 offsets);
   ``KVB == 1`` or ``KVB % 16 == 0`` (Preshuffle is ``KVB > 1``); heads a
   power of two and a multiple of 32; head_dim a power of two and a multiple
   of 64; e4m3fn queries; float32 ``(B*next_n, H)`` weights; int32 bounds and
   block table with ``B`` rows.
3. **Written columns equal read columns.** FlyDSL writes exactly columns
   ``[0, ctx_b - next_n + i]`` of row ``(b, i)``, where ``ctx_b`` is the last
   column of vLLM's bounds; it has no ``-inf`` prefill. vLLM's consumers
   (top-k, V4.1 candidate selection) read row ``r`` over
   ``[0, bounds.reshape(-1)[r])``, or the sequence's single entry repeated
   ``next_n`` times. The two agree when:

   * ``next_n == 1``: every row reads ``[0, ctx_b)`` and FlyDSL writes
     ``[0, ctx_b - 1]``. Holds for plain and flattened speculative decode,
     index compression and DCP, whose bounds are per row.
   * ``next_n > 1`` with a ``(B, next_n)`` table, ``compress_ratio == 1`` and
     no decode context parallelism: vLLM builds ``[b, j] = max(0, L_b -
     next_n + j + 1)``, so the last column is ``L_b`` and every row's read
     bound equals FlyDSL's write bound (both empty when negative).

   Anything else can read a column FlyDSL never writes: compressed bounds
   (``floor`` makes neighbours equal), DCP-localised bounds, or one entry per
   sequence repeated over ``next_n > 1`` rows (Gluon fills those columns with
   ``-inf``). Those calls stay on the stock path.

The adapter also never lets FlyDSL JIT-compile inside graph capture: a kernel
configuration first seen while the stream is capturing goes to the stock path
for that capture (see :meth:`FlyDSLRouter.__call__`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_flydsl_indexer._logging import log_once

I32_OFFSET_LIMIT = 2**31
SCALE_BYTES = 4
MIN_HEAD_MULTIPLE = 32
MIN_HEAD_DIM_MULTIPLE = 64
PRESHUFFLE_ALIGN = 16

# Distinct call signatures (mostly batch sizes) whose verdicts are memoised.
MAX_MEMOISED_VERDICTS = 4096

# (heads, head_dim, KVBlockSize): FlyDSL's JIT cache key for the adapter's
# calls (ChunkK and variant stay at FlyDSL's defaults; Preshuffle = KVB > 1).
KernelConfig = tuple[int, int, int]


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def contract_violation(
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> str | None:
    """Why this call breaks FlyDSL's contract, or ``None`` if it meets it."""
    if q_fp8.dim() != 4:
        return f"q_fp8 is {q_fp8.dim()}-D, not (B, next_n, H, D)"
    batch, next_n, heads, head_dim = q_fp8.shape
    if q_fp8.dtype != torch.float8_e4m3fn:
        return f"q_fp8 dtype {q_fp8.dtype} is not float8_e4m3fn"
    if not _is_pow2(heads) or heads % MIN_HEAD_MULTIPLE:
        return f"heads={heads} is not a power of two and a multiple of 32"
    if not _is_pow2(head_dim) or head_dim % MIN_HEAD_DIM_MULTIPLE:
        return f"head_dim={head_dim} is not a power of two and a multiple of 64"
    if kv_cache.dtype != torch.uint8:
        return f"kv_cache dtype {kv_cache.dtype} is not uint8"
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        return f"kv_cache shape {tuple(kv_cache.shape)} is not (blocks, KVB, 1, dim)"
    num_blocks, block_size, _, index_dim = kv_cache.shape
    if index_dim < head_dim + SCALE_BYTES:
        return f"kv_cache index_dim={index_dim} < head_dim + 4"
    if block_size > 1 and block_size % PRESHUFFLE_ALIGN:
        return f"KVBlockSize={block_size} is not 1 or a multiple of 16"
    if not kv_cache.is_contiguous():
        return "kv_cache is not contiguous (FlyDSL would copy it every call)"
    if num_blocks * block_size * index_dim >= I32_OFFSET_LIMIT:
        return "kv_cache pool is 2**31 bytes or more (FlyDSL uses i32 offsets)"
    if weights.dtype != torch.float32 or tuple(weights.shape) != (batch * next_n, heads):
        return f"weights ({weights.dtype}, {weights.dim()}-D) are not float32 (B*next_n, H)"
    if context_lens.dtype != torch.int32 or context_lens.shape[0] != batch:
        return f"context_lens ({context_lens.dtype}) are not int32 with one row per sequence"
    if context_lens.dim() not in (1, 2):
        return f"context_lens is {context_lens.dim()}-D"
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        return f"block_tables ({block_tables.dtype}, {block_tables.dim()}-D) are not int32 (B, max_blocks)"
    return None


def window_mismatch(
    next_n: int, context_lens: torch.Tensor, compress_ratio: int, dcp_world_size: int
) -> str | None:
    """Why FlyDSL's written columns may differ from those vLLM reads, or ``None``.

    See the module docstring for the rule and its reason.
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
    if compress_ratio != 1:
        return f"next_n={next_n} with compress_ratio={compress_ratio}: compressed bounds are not one apart"
    if dcp_world_size != 1:
        return f"next_n={next_n} with decode context parallel size {dcp_world_size}: localised bounds"
    return None


def ineligibility(
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    compress_ratio: int,
    dcp_world_size: int,
) -> str | None:
    """The FlyDSL-side reason this call must stay stock, or ``None`` to take it."""
    problem = contract_violation(q_fp8, kv_cache, weights, context_lens, block_tables)
    if problem is not None:
        return problem
    return window_mismatch(q_fp8.shape[1], context_lens, compress_ratio, dcp_world_size)


def run_flydsl(
    kernel: Callable[..., torch.Tensor],
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    out_logits: torch.Tensor,
    per_sequence_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_model_len: int,
) -> torch.Tensor:
    """One FlyDSL launch, writing ``out_logits`` in place.

    Passes only KVBlockSize and Preshuffle; ChunkK, SplitKV, WavePerEU and the
    variant stay at FlyDSL's tuned defaults. No ``-inf`` prefill.
    """
    block_size = kv_cache.shape[1]
    kernel(
        q_fp8,
        kv_cache,
        weights,
        out_logits,
        per_sequence_lens,
        block_tables,
        max_model_len,
        Preshuffle=block_size > 1,
        KVBlockSize=block_size,
    )
    return out_logits


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
    """

    stock_uses_gluon: Callable[[int, int], bool]
    output_buffer: Callable[[int, int], torch.Tensor]
    per_sequence_lens: Callable[[torch.Tensor], torch.Tensor]
    dcp_world_size: Callable[[], int]


def _is_capturing() -> bool:
    # Nothing can be capturing before CUDA/HIP is initialised; is_initialized()
    # is a cheap flag read, unlike is_available(), which can query the driver.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class FlyDSLRouter:
    """Callable with ``rocm_fp8_paged_mqa_logits``'s signature.

    ``verifier``, when given, is called once on the first eligible call made
    outside graph capture, as ``verifier(stock_out, flydsl_out, context_lens,
    next_n)``; it returns ``None`` when the arms agree, else a message. On
    disagreement this router sends every later call to the stock path.
    """

    def __init__(
        self,
        original: Callable[..., torch.Tensor],
        kernel: Callable[..., torch.Tensor],
        hooks: StockHooks,
        logger: logging.Logger,
        verifier: Callable[..., str | None] | None = None,
        is_capturing: Callable[[], bool] = _is_capturing,
    ) -> None:
        self.original = original
        self.kernel = kernel
        self.hooks = hooks
        self.logger = logger
        self.verifier = verifier
        self.is_capturing = is_capturing
        self.compiled: set[KernelConfig] = set()
        self._verdicts: dict[tuple, str | None] = {}
        self.disabled_reason: str | None = None
        self.calls_taken = 0
        self.calls_delegated = 0

    def _verdict(
        self, q_fp8, kv_cache, weights, context_lens, block_tables, compress_ratio
    ) -> str | KernelConfig:
        """The reason to stay stock, or the kernel configuration to run.

        :func:`ineligibility`, memoised on everything it reads but contiguity:
        shapes, dtypes, the ratio and the DCP size fully decide the verdict for a
        contiguous cache, and contiguity is checked live. The memo is bounded.
        """
        if not kv_cache.is_contiguous():
            return "kv_cache is not contiguous (FlyDSL would copy it every call)"
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
            compress_ratio,
            self.hooks.dcp_world_size(),
        )
        verdict = self._verdicts.get(key)
        if verdict is None:
            reason = ineligibility(
                q_fp8,
                kv_cache,
                weights,
                context_lens,
                block_tables,
                compress_ratio=compress_ratio,
                dcp_world_size=key[-1],
            )
            verdict = reason if reason is not None else (q_fp8.shape[2], q_fp8.shape[3], kv_cache.shape[1])
            if len(self._verdicts) < MAX_MEMOISED_VERDICTS:
                self._verdicts[key] = verdict
        return verdict

    def _delegate(
        self, reason: str, args: tuple, compress_ratio: int, level: int = logging.INFO
    ) -> torch.Tensor:
        self.calls_delegated += 1
        log_once(self.logger, level, "vllm-flydsl-indexer: stock path for this call: %s", reason)
        return self.original(*args, compress_ratio=compress_ratio)

    def __call__(
        self,
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
        reason: str | None = self.disabled_reason
        level = logging.INFO
        if reason is None and not self.hooks.stock_uses_gluon(compress_ratio, kv_cache_fp8.shape[1]):
            reason = (
                "stock does not use aiter's Gluon kernel here "
                f"(compress_ratio={compress_ratio}, block_size={kv_cache_fp8.shape[1]})"
            )
        if reason is None:
            verdict = self._verdict(q_fp8, kv_cache_fp8, weights, context_lens, block_tables, compress_ratio)
            if isinstance(verdict, str):
                reason = verdict
            elif verdict not in self.compiled or self.verifier is not None:
                # Rare paths: the first call of a configuration, or the canary.
                capturing = self.is_capturing()
                if capturing and verdict not in self.compiled:
                    # FlyDSL JIT-compiles a configuration on its first call; that
                    # must not happen inside graph capture: this graph keeps stock.
                    heads, head_dim, block_size = verdict
                    reason = (
                        f"FlyDSL not yet compiled for heads={heads} head_dim={head_dim} "
                        f"KVBlockSize={block_size} and the stream is capturing; run one eager "
                        "decode step first (e.g. compilation_config.cudagraph_num_of_warmups=1)"
                    )
                    level = logging.WARNING  # the user asked for FlyDSL and this graph will not have it
                elif self.verifier is not None and not capturing:
                    args = (q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata)
                    return self._verified_call((*args, max_model_len), compress_ratio, verdict)
        if reason is not None:
            args = (
                q_fp8,
                kv_cache_fp8,
                weights,
                context_lens,
                block_tables,
                schedule_metadata,
                max_model_len,
            )
            return self._delegate(reason, args, compress_ratio, level)

        out = self._launch(q_fp8, kv_cache_fp8, weights, context_lens, block_tables, max_model_len)
        if verdict not in self.compiled and not self.is_capturing():
            self.compiled.add(verdict)
        self.calls_taken += 1
        return out

    def _launch(self, q_fp8, kv_cache, weights, context_lens, block_tables, max_model_len) -> torch.Tensor:
        """FlyDSL into the logits buffer obtained exactly as stock obtains it."""
        out = self.hooks.output_buffer(q_fp8.shape[0] * q_fp8.shape[1], max_model_len)
        return run_flydsl(
            self.kernel,
            q_fp8,
            kv_cache,
            weights,
            out,
            self.hooks.per_sequence_lens(context_lens),
            block_tables,
            max_model_len,
        )

    def _verified_call(self, args: tuple, compress_ratio: int, config: KernelConfig) -> torch.Tensor:
        """The canary: run both arms once on live inputs, keep FlyDSL only if they agree."""
        q_fp8, kv_cache, weights, context_lens, block_tables, _, max_model_len = args
        verifier, self.verifier = self.verifier, None
        stock = self.original(*args, compress_ratio=compress_ratio).clone()
        out = self._launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_model_len)
        self.compiled.add(config)
        problem = verifier(stock, out, context_lens, q_fp8.shape[1])
        if problem is not None:
            self.disabled_reason = f"verify-on-enable canary failed earlier ({problem})"
            self.logger.error(
                "vllm-flydsl-indexer: FlyDSL and stock paged MQA logits DISAGREE on the "
                "first eligible call: %s. This process now uses the stock path for good.",
                problem,
            )
            out.copy_(stock)
            self.calls_delegated += 1
            return out
        self.logger.info(
            "vllm-flydsl-indexer: verify-on-enable canary passed (%s)", "arms agree inside the read windows"
        )
        self.calls_taken += 1
        return out
