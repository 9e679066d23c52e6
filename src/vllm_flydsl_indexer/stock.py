# SPDX-License-Identifier: Apache-2.0
"""What vLLM's original call would do here: the router's stock-side rules.

The router replaces only the call that stock would send to aiter's gfx950
Gluon kernel, and launches FlyDSL on the cache layout stock tells Gluon. Both
questions are asked of vLLM through :class:`StockHooks`, exactly as the
original asks them, so the core imports no vLLM and a test (or ``check``'s
mirror) can inject its own answers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

__all__ = [
    "StockHooks",
    "vllm_gluon_objection",
    "vllm_stock_hooks",
]


@dataclass(frozen=True)
class StockHooks:
    """What the router needs from vLLM, injected so the core imports none of it.

    * ``gluon_objection(compress_ratio, block_size)``: why the original would
      not send this call to aiter's gfx950 Gluon kernel, or ``None``.
    * ``output_buffer(rows, max_model_len)``: the logits buffer, obtained exactly
      as the original obtains it.
    * ``per_sequence_lens(context_lens)``: vLLM's own reduction to one length
      per sequence.
    * ``dcp_world_size()``: decode context parallel size of this process.
    * ``preshuffle(block_size)``: the ``Preshuffle`` the original passes Gluon,
      i.e. vLLM's indexer K cache layout for that block size.
    """

    gluon_objection: Callable[[int, int], str | None]
    output_buffer: Callable[[int, int], torch.Tensor]
    per_sequence_lens: Callable[[torch.Tensor], torch.Tensor]
    dcp_world_size: Callable[[], int]
    preshuffle: Callable[[int], bool]


def vllm_gluon_objection(
    target: ModuleType, aiter_ops: object = None, compress_ratio: int = 1, block_size: int = 1
) -> str | None:
    """Why vLLM's original (module ``target``) would not call aiter's gfx950 Gluon kernel, or ``None``.

    The original's own conditions: not its C4A Triton route on gfx9, gfx950,
    aiter enabled, and aiter's Gluon module found. Module globals are read at
    call time, as the original reads them. ``check``, ``bench`` and ``doctor``
    ask the same question (their ``paths.vllm_target``).
    """
    if aiter_ops is None:
        from vllm._aiter_ops import rocm_aiter_ops as aiter_ops

    on_gfx9 = target._ON_GFX950 or target._ON_GFX942
    if on_gfx9 and target._indexer_k_is_c4a_block_flat(compress_ratio) and block_size > 1:
        return f"vLLM's own C4A Triton route (compress_ratio={compress_ratio}, block_size={block_size})"
    if not target._ON_GFX950:
        return "vLLM does not report gfx950, so its stock call would not run aiter's Gluon kernel"
    if not (aiter_ops.is_enabled() or aiter_ops.is_rdna_aiter_enabled()):
        return "VLLM_ROCM_USE_AITER is not 1, so vLLM would not call aiter's Gluon kernel"
    if target.paged_mqa_logits_module() is None:
        return "vLLM finds no aiter Gluon paged-MQA-logits module"
    return None


def vllm_stock_hooks(target: ModuleType) -> StockHooks:
    """Hooks that ask vLLM exactly what the original function asks it."""
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.distributed.parallel_state import get_dcp_world_size_and_rank

    def output_buffer(rows: int, max_model_len: int) -> torch.Tensor:
        (out,) = target.current_workspace_manager().get_simultaneous(
            ((rows, max_model_len), torch.float32),
        )
        return out

    def preshuffle(block_size: int) -> bool:
        # 0.34.0: ``indexer_k_cache_is_shuffled(block_size) and not _ON_RDNA``; before: ``block_size > 1``.
        shuffled = getattr(target, "indexer_k_cache_is_shuffled", None)
        if shuffled is None:
            return block_size > 1
        return bool(shuffled(block_size)) and not getattr(target, "_ON_RDNA", False)

    return StockHooks(
        gluon_objection=functools.partial(vllm_gluon_objection, target, rocm_aiter_ops),
        output_buffer=output_buffer,
        per_sequence_lens=lambda t: target._per_sequence_context_lens(t),
        dcp_world_size=lambda: get_dcp_world_size_and_rank()[0],
        preshuffle=preshuffle,
    )
