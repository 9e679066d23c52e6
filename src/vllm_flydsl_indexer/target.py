# SPDX-License-Identifier: Apache-2.0
"""The patch target: vLLM's decode-logits function, where it lives, and its signature.

Written once here; the gates check the signature, the patch replaces the
function, the call-site audit names the defining module, and the tools call
the original through :func:`unpatched`. So are the two byte facts about the
call's cache that the kernels' contracts and the tools' size limits share.
No torch at import: the CLI's parser reads this.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

__all__ = [
    "Call",
    "I32_OFFSET_LIMIT",
    "INDEX_TOPK",
    "MARKER",
    "RouterView",
    "SCALE_BYTES",
    "TARGET_KEYWORD_ONLY",
    "TARGET_MODULE",
    "TARGET_NAME",
    "TARGET_POSITIONAL",
    "signature_problem",
    "unpatched",
]

if TYPE_CHECKING:
    import torch

TARGET_MODULE = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"
TARGET_NAME = "rocm_fp8_paged_mqa_logits"
# The signature this package was written against (vLLM 0.32.0, 0.33.0 and 0.34.0).
TARGET_POSITIONAL = (
    "q_fp8",
    "kv_cache_fp8",
    "weights",
    "context_lens",
    "block_tables",
    "schedule_metadata",
    "max_model_len",
)
TARGET_KEYWORD_ONLY = {"compress_ratio": 1}
# vLLM's fp8 indexer cache: per token, head_dim fp8 bytes, then one float32 scale.
SCALE_BYTES = 4
# FlyDSL addresses the cache with i32 byte offsets: a pool must stay under this.
I32_OFFSET_LIMIT = 2**31
# vLLM's index_topk: the columns the indexer's top-k keeps per row (the agreement rule compares them).
INDEX_TOPK = 2048

# Set on the patch's wrapper, so the original can always be found behind it.
MARKER = "_vllm_flydsl_indexer"


def signature_problem(fn: object) -> str | None:
    """Why ``fn`` does not have the target signature, or ``None``."""
    if not callable(fn):
        return f"{TARGET_NAME} is missing"
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        return f"signature unreadable ({e})"
    positional = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    keyword_only = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    others = [
        p.name
        for p in params
        if p.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    if positional != TARGET_POSITIONAL or keyword_only != TARGET_KEYWORD_ONLY or others:
        return f"signature {inspect.signature(fn)} differs from the one this package supports"
    return None


def unpatched(fn: Callable) -> Callable:
    """``fn`` itself, or the original function when ``fn`` is this package's wrapper."""
    return fn.__wrapped__ if getattr(fn, MARKER, False) else fn


class Call(NamedTuple):
    """One call as the rules see it."""

    q_fp8: torch.Tensor
    kv_cache: torch.Tensor
    weights: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_model_len: int
    compress_ratio: int
    caller: str | None
    dcp_world_size: int

    @classmethod
    def of(cls, args: tuple, compress_ratio: int, caller: str | None, dcp: int) -> Call:
        """The Call of the target's positional ``args`` (``schedule_metadata`` is not read)."""
        q, kv, weights, lens, tables, _, max_model_len = args
        return cls(q, kv, weights, lens, tables, max_model_len, compress_ratio, caller, dcp)


class RouterView(Protocol):
    """What a rule reads of the router besides the call (see :data:`vllm_flydsl_indexer.router.RULES`)."""

    variant: Any  # the identified kernels.KernelVariant
    hooks: Any  # stock.StockHooks: what vLLM's original would do
    table: Any  # tuning.TunedTable, or None
    logger: logging.Logger
