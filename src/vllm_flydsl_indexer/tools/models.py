# SPDX-License-Identifier: Apache-2.0
"""The indexer shapes of the models that reach vLLM's decode-logits call: the one table.

``check`` builds its cases from it, ``bench``/``tune`` their default grids and
``doctor`` its report. The plugin itself decides by contract, never by model,
so it does not import this. No torch here: the CLI's parser reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

__all__ = [
    "BY_NAME",
    "HEADS",
    "MODEL_SHAPES",
    "ModelShape",
    "REPORT_BLOCK_SIZES",
    "REPORT_NEXT_NS",
    "eligible_configs",
    "takes_shape",
]

from vllm_flydsl_indexer.target import SCALE_BYTES

if TYPE_CHECKING:
    from vllm_flydsl_indexer.kernels import KernelVariant


@dataclass(frozen=True)
class ModelShape:
    """One indexer shape: ``name`` is check's ``--model`` value, ``label`` the report's."""

    name: str
    label: str
    heads: int
    head_dim: int


MODEL_SHAPES = (
    ModelShape("deepseek-v3.2", "DeepSeek-V3.2", 64, 128),
    ModelShape("glm-5", "GLM-5.x/DSV4.1", 32, 128),  # GLM-5.x and DeepSeek-V4.1 share it
)
BY_NAME = {m.name: m for m in MODEL_SHAPES}
HEADS = tuple(m.heads for m in MODEL_SHAPES)
(HEAD_DIM,) = {m.head_dim for m in MODEL_SHAPES}  # one head_dim for every model

# The (KVBlockSize, next_n) grid doctor reports per model.
REPORT_BLOCK_SIZES = (64, 1)
REPORT_NEXT_NS = (1, 2)


def takes_shape(variant: KernelVariant, heads: int, head_dim: int, block_size: int, next_n: int) -> bool:
    """Whether ``variant``'s contract takes vLLM's cache at this shape (for reports)."""
    index_dim = variant.index_dim or head_dim + SCALE_BYTES
    return variant.shape_violation(heads, head_dim, block_size, index_dim, next_n) is None


def eligible_configs(variant: KernelVariant) -> Iterator[tuple[str, int, int, int, int]]:
    """``(label, heads, head_dim, KVBlockSize, next_n)`` of the report shapes ``variant`` takes."""
    for m in MODEL_SHAPES:
        for block_size in REPORT_BLOCK_SIZES:
            for next_n in REPORT_NEXT_NS:
                if takes_shape(variant, m.heads, m.head_dim, block_size, next_n):
                    yield m.label, m.heads, m.head_dim, block_size, next_n
