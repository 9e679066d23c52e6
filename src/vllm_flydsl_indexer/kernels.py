# SPDX-License-Identifier: Apache-2.0
"""The FlyDSL kernel APIs' exact contracts and graph-safe launches, as values.

A :class:`KernelVariant` is one identified API (found at startup by
:mod:`vllm_flydsl_indexer.identification`): its name, its function, its
:class:`Limits` beyond the contract every API shares (:func:`common_violation`),
and its launch (:meth:`KernelVariant.launch_kwargs`): KVBlockSize and
Preshuffle always; an explicit SplitKV for the gfx950 APIs, computed from
shapes as aiter's dispatcher does (:func:`explicit_split_kv`), since the later
gfx950 wrapper's automatic SplitKV reads ``context_lens.max().item()`` (a host
sync that breaks graph capture); a tuned row's ``wg_per_cu`` where the API's
launch takes it (:meth:`KernelVariant.knob_problem`). The general (PR #4221)
kernel keeps its other knobs at their defaults. Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_flydsl_indexer.target import I32_OFFSET_LIMIT, SCALE_BYTES, Call

__all__ = [
    "BLOCK_OUTER_LAYOUTS",
    "BLOCK_OUTER_NOTE",
    "GFX950_EARLY_WORKGROUPS_PER_CU",
    "KernelVariant",
    "LAYOUT_VARIABLE",
    "Limits",
    "MIN_HEAD_DIM_MULTIPLE",
    "MIN_HEAD_MULTIPLE",
    "PRESHUFFLE_ALIGN",
    "TUNER_WG_PER_CU",
    "WORKGROUPS_PER_CU",
    "common_violation",
    "cu_count",
    "explicit_split_kv",
    "strided_cache_reason",
]

# vLLM's KV cache layouts with the block dimension outside the layer dimension
# (vllm/v1/kv_cache_layout.py; tests/test_drift.py pins them).
BLOCK_OUTER_LAYOUTS = ("BLHNC", "BLNHC", "BHLNC")
LAYOUT_VARIABLE = "VLLM_KV_CACHE_LAYOUT"
BLOCK_OUTER_NOTE = (
    "FlyDSL needs a layer-contiguous indexer cache (vLLM's default LBNHC, or LBHNC). A block-outer KV cache "
    "layout (BLHNC/BLNHC, BHLNC) packs every layer's page inside each block, so each layer's indexer cache "
    "is strided and every call stays stock: DeepSeek-V4/V4.1 and GLM-5-next (kpool tail cache) "
    f"require one; {LAYOUT_VARIABLE} or a KV connector can choose one for DeepSeek-V3.2 and GLM-5.x."
)

PRESHUFFLE_ALIGN = 16
MIN_HEAD_MULTIPLE = 32
MIN_HEAD_DIM_MULTIPLE = 64
# aiter's dispatcher: workgroups per CU when it picks SplitKV for FlyDSL (its
# FLYDSL_DEFAULT_WG_PER_CU, aiter/paged_mqa_logits.py at 1eb1a7b5), and the values
# its tuner sweeps (FLYDSL_WG_PER_CU, csrc/paged_mqa_logits/paged_mqa_logits_tune.py).
WORKGROUPS_PER_CU = 3
TUNER_WG_PER_CU = (1, 2, 3, 4)
# The earlier gfx950 kernel's own automatic SplitKV: ``total_cu * 4 * 2``
# one-wave workgroups, capped by the pages of ``max_model_len``.
GFX950_EARLY_WORKGROUPS_PER_CU = 8


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class Limits:
    """What a kernel API accepts beyond the common contract. ``None``: the general rule."""

    heads: frozenset[int] | None = None
    head_dims: frozenset[int] | None = None
    block_sizes: frozenset[int] | None = None
    index_dim: int | None = None
    max_next_n: int | None = None
    preshuffle_required: bool = False
    # Take q only when contiguous: the later gfx950 wrapper raises otherwise,
    # and the earlier one reads q in dwords at q's strides, assuming a dense
    # head_dim (vLLM's q is contiguous, so nothing is lost).
    q_contiguous: bool = False

    def violation(
        self, heads: int, head_dim: int, block_size: int, index_dim: int, next_n: int
    ) -> str | None:
        if self.heads is None:
            if not _is_pow2(heads) or heads % MIN_HEAD_MULTIPLE:
                return f"heads={heads} is not a power of two and a multiple of 32"
        elif heads not in self.heads:
            return f"heads={heads} is not one of {sorted(self.heads)}"
        if self.head_dims is None:
            if not _is_pow2(head_dim) or head_dim % MIN_HEAD_DIM_MULTIPLE:
                return f"head_dim={head_dim} is not a power of two and a multiple of 64"
        elif head_dim not in self.head_dims:
            return f"head_dim={head_dim} is not one of {sorted(self.head_dims)}"
        if self.block_sizes is None:
            if block_size > 1 and block_size % PRESHUFFLE_ALIGN:
                return f"KVBlockSize={block_size} is not 1 or a multiple of 16"
        elif block_size not in self.block_sizes:
            return f"KVBlockSize={block_size} is not one of {sorted(self.block_sizes)}"
        if self.preshuffle_required and block_size == 1:
            return "KVBlockSize=1 (no preshuffle) but this kernel requires Preshuffle"
        if self.index_dim is not None and index_dim != self.index_dim:
            return f"kv_cache index_dim={index_dim} is not {self.index_dim}"
        if self.max_next_n is not None and next_n > self.max_next_n:
            return f"next_n={next_n} is above this kernel's maximum {self.max_next_n}"
        return None


def common_violation(
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> str | None:
    """Why the call breaks what every FlyDSL API takes, or ``None``.

    The cache's contiguity is :func:`contiguity_rule`'s (part of the router's memo key).
    """
    if q_fp8.dim() != 4:
        return f"q_fp8 is {q_fp8.dim()}-D, not (B, next_n, H, D)"
    batch, next_n, heads, head_dim = q_fp8.shape
    if q_fp8.dtype != torch.float8_e4m3fn:
        return f"q_fp8 dtype {q_fp8.dtype} is not float8_e4m3fn"
    if kv_cache.dtype != torch.uint8:
        return f"kv_cache dtype {kv_cache.dtype} is not uint8"
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        return f"kv_cache shape {tuple(kv_cache.shape)} is not (blocks, KVB, 1, dim)"
    num_blocks, block_size, _, index_dim = kv_cache.shape
    if index_dim < head_dim + SCALE_BYTES:
        return f"kv_cache index_dim={index_dim} < head_dim + 4"
    if num_blocks * block_size * index_dim >= I32_OFFSET_LIMIT:
        return "kv_cache pool is 2**31 bytes or more (FlyDSL uses i32 offsets)"
    if weights.dtype != torch.float32 or tuple(weights.shape) != (batch * next_n, heads):
        return f"weights ({weights.dtype}, {tuple(weights.shape)}) are not float32 (B*next_n, H)"
    if not weights.is_contiguous():
        # aiter's gfx950 wrapper asserts it; its dispatcher's flydsl_supports requires it.
        return f"weights are not contiguous (strides {tuple(weights.stride())})"
    if (
        context_lens.dtype != torch.int32
        or context_lens.dim() not in (1, 2)
        or context_lens.shape[0] != batch
    ):
        return f"context_lens ({context_lens.dtype}, {tuple(context_lens.shape)}) are not int32 with B rows"
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        return f"block_tables ({block_tables.dtype}, {block_tables.dim()}-D) are not int32 (B, max_blocks)"
    return None


@functools.lru_cache(maxsize=16)
def _device_cu_count(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index if index is not None else 0).multi_processor_count
    return 1


def cu_count(device: torch.device) -> int:
    """Compute units of ``device`` (a host-side property read, cached; no sync)."""
    return _device_cu_count(device.type, device.index)


def explicit_split_kv(
    cus: int, batch: int, max_model_len: int, block_size: int, workgroups_per_cu: int = WORKGROUPS_PER_CU
) -> int:
    """aiter's dispatcher rule: ``max(1, min(pages, ceil(cu * wg_per_cu / batch)))``.

    ``pages`` counts the KV blocks of ``max_model_len``. Shapes only: no device read.
    With ``workgroups_per_cu=8`` it is the earlier gfx950 wrapper's own automatic rule.
    """
    pages = -(-max_model_len // block_size)
    return max(1, min(pages, -(-cus * workgroups_per_cu // max(batch, 1))))


@dataclass(frozen=True)
class KernelVariant:
    """One identified FlyDSL API: its name, function, contract and graph-safe launch."""

    name: str
    fn: Callable[..., torch.Tensor]
    location: str
    limits: Limits
    description: str
    # Workgroups per CU of the explicit SplitKV every launch passes; ``None``: SplitKV not passed.
    split_kv_workgroups_per_cu: int | None = None
    # Picks Gluon or FlyDSL itself from aiter's own tuned table (the dispatcher): the plugin's
    # table is not used.
    own_table: bool = False
    # The dispatcher's own choice for a call, from shapes (its ``get_paged_mqa_logits_config`` and
    # ``flydsl_supports``), given the call and its Preshuffle: ``None`` where it launches FlyDSL, else
    # why not. Where it would launch Gluon (with its own ChunkK/WavePerEU), vLLM's original runs instead.
    dispatch_objection: Callable[[Call, bool], str | None] | None = None
    # FlyDSL itself, with ``fn``'s signature, for the self-test: ``None`` where ``fn`` is the kernel;
    # for the dispatcher, its own ``run_paged_mqa_logits`` forced to the FlyDSL backend.
    flydsl: Callable[..., object] | None = None

    def violation(self, call: Call) -> str | None:
        """Why this API cannot take the call exactly, or ``None``."""
        q_fp8, kv_cache, weights, context_lens, block_tables = call[:5]
        problem = common_violation(q_fp8, kv_cache, weights, context_lens, block_tables)
        if problem is not None:
            return problem
        _, next_n, heads, head_dim = q_fp8.shape
        problem = self.limits.violation(heads, head_dim, kv_cache.shape[1], kv_cache.shape[3], next_n)
        if problem is not None:
            return f"{problem} ({self.name} FlyDSL kernel)"
        if self.limits.q_contiguous and not q_fp8.is_contiguous():
            return f"q_fp8 is not contiguous ({self.name} FlyDSL kernel)"
        return None

    def takes_shape(self, heads: int, head_dim: int, block_size: int, next_n: int) -> bool:
        """Whether this API's limits take vLLM's cache at this shape (for reports)."""
        index_dim = self.limits.index_dim or head_dim + SCALE_BYTES
        return self.limits.violation(heads, head_dim, block_size, index_dim, next_n) is None

    @staticmethod
    def preshuffle(block_size: int) -> bool:
        """The ``Preshuffle`` this package launches a ``block_size`` cache with: vLLM's ROCm layout rule."""
        return block_size > 1

    @property
    def tuned_wg_per_cu(self) -> tuple[int, ...]:
        """The ``wg_per_cu`` values ``bench --tune`` measures: aiter's tuner's sweep where this
        API's launch takes SplitKV, else only the default launch (``0``)."""
        return TUNER_WG_PER_CU if self.split_kv_workgroups_per_cu is not None else (0,)

    def knob_problem(self, wg_per_cu: int) -> str | None:
        """Why a tuned FlyDSL row's ``wg_per_cu`` cannot be launched on this API as measured, or ``None``.

        ``0`` is the default launch, which every API takes. A positive value
        sets SplitKV, which only the gfx950 APIs' launch passes.
        """
        if wg_per_cu == 0 or self.split_kv_workgroups_per_cu is not None:
            return None
        return (
            f"wg_per_cu={wg_per_cu}, a SplitKV that the {self.name} FlyDSL kernel is not launched with "
            "(this package passes it no SplitKV), so it cannot launch what was measured"
        )

    def launch_kwargs(
        self, batch: int, block_size: int, max_model_len: int, cus: int, wg_per_cu: int = 0
    ) -> dict[str, object]:
        """The keyword arguments of every launch of this shape: shapes only, so graph-safe.

        KVBlockSize and Preshuffle always; an explicit SplitKV for the gfx950
        kernels: the later one's automatic SplitKV reads device memory on the
        host, and the earlier one's gets the value its own rule would compute.
        ``wg_per_cu`` is a tuned row's knob (``0``: this API's default), turned
        into SplitKV exactly as aiter's dispatcher does; an API that takes no
        SplitKV accepts only ``0`` (:meth:`knob_problem`).
        """
        kwargs: dict[str, object] = {"Preshuffle": self.preshuffle(block_size), "KVBlockSize": block_size}
        if self.split_kv_workgroups_per_cu is not None:
            kwargs["SplitKV"] = explicit_split_kv(
                cus, batch, max_model_len, block_size, wg_per_cu or self.split_kv_workgroups_per_cu
            )
        elif wg_per_cu:
            raise ValueError(self.knob_problem(wg_per_cu))
        return kwargs

    def self_test_launches(
        self, kwargs: dict[str, object], top_split_kv: int
    ) -> dict[str, dict[str, object]]:
        """The launches the self-test makes of a shape whose live launches take ``kwargs``, by name:
        SplitKV 1 and ``top_split_kv`` (the largest a live launch reaches, clamped to the self-test's
        pages) where this API is launched with SplitKV, else ``kwargs`` as they are."""
        if "SplitKV" not in kwargs:
            return {"at its default launch": kwargs}
        return {f"at SplitKV {s}": {**kwargs, "SplitKV": s} for s in sorted({1, top_split_kv})}

    def describe_launch(self, wg_per_cu: int) -> str:
        """The knob of a launch, for the first-taken log line."""
        if self.own_table:
            return "aiter's dispatcher picks the arm and its knobs from its own table"
        if self.split_kv_workgroups_per_cu is None:
            return "the kernel's default launch"
        if wg_per_cu:
            return f"SplitKV from wg_per_cu={wg_per_cu}"
        return f"SplitKV from wg_per_cu={self.split_kv_workgroups_per_cu} (default)"


def strided_cache_reason(kv_cache: torch.Tensor) -> str:
    """The stock-path reason for a cache view that is not layer-contiguous, in actionable words."""
    blocks, block_size, _, index_dim = (tuple(kv_cache.shape) + (0, 0, 0, 0))[:4]
    return (
        f"kv_cache is strided (block stride {kv_cache.stride(0) if kv_cache.dim() else '?'} bytes, "
        f"not KVBlockSize*index_dim = {block_size * index_dim}), so this layer stays on the stock path. "
        f"{BLOCK_OUTER_NOTE}"
    )
