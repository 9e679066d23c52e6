# SPDX-License-Identifier: Apache-2.0
"""What vLLM's original call would do here: the router's stock-side rules.

The router replaces only the call that stock would send to aiter's gfx950
Gluon kernel, and launches FlyDSL on the cache layout stock tells Gluon. Both
questions are asked of vLLM through :class:`StockHooks`, exactly as the
original asks them, so the core imports no vLLM and a test (or ``check``'s
mirror) can inject its own answers. vLLM's hooks resolve every name they use
when they are built (the patch's install), after checking that the original
does what they mirror; per call they read no vLLM module attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from vllm_flydsl_indexer.content import PRESHUFFLE_BY_LAYOUT, PRESHUFFLE_BY_SIZE, ContentDrift, audit
from vllm_flydsl_indexer.target import TARGET_NAME, unpatched

__all__ = [
    "GluonQuestion",
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


@dataclass(frozen=True)
class GluonQuestion:
    """Whether the original would call aiter's gfx950 Gluon kernel, asked of vLLM's objects in hand.

    The original's own conditions (:mod:`vllm_flydsl_indexer.content` checks its source for them):
    not its C4A route on gfx9, gfx950, aiter enabled, and aiter's Gluon module found. The flags are
    read once, when the question is built; the helpers are vLLM's own function objects.
    """

    on_gfx950: bool
    on_gfx942: bool
    c4a_block_flat: Callable[[int], object]
    aiter_enabled: Callable[[], object]
    rdna_aiter_enabled: Callable[[], object]
    gluon_module: Callable[[], object]

    @classmethod
    def of(cls, target: object, aiter_ops: object) -> GluonQuestion:
        """The question with ``target``'s names (a module, or a stand-in with those attributes) resolved.

        Raises :class:`ContentDrift` naming the first that is missing.
        """
        return cls(
            on_gfx950=bool(_resolve(target, "_ON_GFX950", flag=True)),
            on_gfx942=bool(_resolve(target, "_ON_GFX942", flag=True)),
            c4a_block_flat=_resolve(target, "_indexer_k_is_c4a_block_flat"),
            aiter_enabled=_resolve(aiter_ops, "is_enabled"),
            rdna_aiter_enabled=_resolve(aiter_ops, "is_rdna_aiter_enabled"),
            gluon_module=_resolve(target, "paged_mqa_logits_module"),
        )

    def __call__(self, compress_ratio: int, block_size: int) -> str | None:
        """Why the original would not call aiter's gfx950 Gluon kernel here, or ``None``."""
        if (self.on_gfx950 or self.on_gfx942) and self.c4a_block_flat(compress_ratio) and block_size > 1:
            return f"vLLM's own C4A Triton route (compress_ratio={compress_ratio}, block_size={block_size})"
        if not self.on_gfx950:
            return "vLLM does not report gfx950, so its stock call would not run aiter's Gluon kernel"
        if not (self.aiter_enabled() or self.rdna_aiter_enabled()):
            return "VLLM_ROCM_USE_AITER is not 1, so vLLM would not call aiter's Gluon kernel"
        if self.gluon_module() is None:
            return "vLLM finds no aiter Gluon paged-MQA-logits module"
        return None


def _resolve(owner: object, name: str, flag: bool = False) -> Any:
    """``owner.name``: a callable, or a bool where ``flag``; :class:`ContentDrift` otherwise."""
    value = getattr(owner, name, None)
    if not (isinstance(value, bool) if flag else callable(value)):
        where = getattr(owner, "__name__", type(owner).__name__)
        what = "flag" if flag else "function"
        raise ContentDrift(f"vLLM's {where} has no {what} {name} (the router's stock side uses it)")
    return value


def vllm_gluon_objection(
    target: object, aiter_ops: object = None, compress_ratio: int = 1, block_size: int = 1
) -> str | None:
    """Why vLLM's original (module ``target``) would not call aiter's gfx950 Gluon kernel, or ``None``.

    A one-off question: ``check``, ``bench`` and ``doctor`` ask it (their ``paths.vllm_target``);
    the router asks the :class:`GluonQuestion` its hooks resolved at start-up.
    """
    if aiter_ops is None:
        from vllm._aiter_ops import rocm_aiter_ops as aiter_ops
    return GluonQuestion.of(target, aiter_ops)(compress_ratio, block_size)


def vllm_stock_hooks(target: ModuleType) -> StockHooks:
    """Hooks that answer as the original ``target.rocm_fp8_paged_mqa_logits``, every vLLM name resolved now.

    First checks the original's content (:func:`content.audit`): the hooks mirror what it does only
    where it does what was audited. Raises :class:`ContentDrift` naming what differs or is missing.
    Per call, the hooks read no vLLM module attribute: they hold vLLM's objects.
    """
    form = audit(unpatched(_resolve(target, TARGET_NAME)))
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.distributed import parallel_state

    question = GluonQuestion.of(target, rocm_aiter_ops)
    workspace = _resolve(target, "current_workspace_manager")
    per_sequence_lens = _resolve(target, "_per_sequence_context_lens")
    dcp = _resolve(parallel_state, "get_dcp_world_size_and_rank")

    def output_buffer(rows: int, max_model_len: int) -> torch.Tensor:
        (out,) = workspace().get_simultaneous(((rows, max_model_len), torch.float32))
        return out

    if form == PRESHUFFLE_BY_LAYOUT:
        shuffled = _resolve(target, "indexer_k_cache_is_shuffled")
        rdna = _resolve(target, "_ON_RDNA", flag=True)

        def preshuffle(block_size: int) -> bool:
            return bool(shuffled(block_size)) and not rdna

    else:
        assert form == PRESHUFFLE_BY_SIZE, form

        def preshuffle(block_size: int) -> bool:
            return block_size > 1

    return StockHooks(
        gluon_objection=question,
        output_buffer=output_buffer,
        per_sequence_lens=per_sequence_lens,
        dcp_world_size=lambda: dcp()[0],
        preshuffle=preshuffle,
    )
