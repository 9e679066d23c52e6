# SPDX-License-Identifier: Apache-2.0
"""Find aiter's FlyDSL fp8 paged MQA logits kernel (aiter PR #4221).

Importing ``aiter.ops.flydsl`` can fail with errors other than ImportError
(for example an aiter/flydsl version mismatch), so every probe catches any
exception and records it as the reason.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

KERNEL_NAME = "flydsl_fp8_paged_mqa_logits"
# Probed in order: the re-export, the PR branch's module, earlier revisions.
KERNEL_MODULES = (
    "aiter.ops.flydsl",
    "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits",
    "aiter.ops.flydsl.kernels.fp8_paged_mqa_logits",
)
# The adapter passes exactly these, by keyword; FlyDSL makes them keyword-only.
REQUIRED_KEYWORD_ONLY = ("Preshuffle", "KVBlockSize")


@dataclass(frozen=True)
class KernelLookup:
    """The kernel, where it was found, and why each earlier probe failed."""

    kernel: Callable | None
    location: str | None
    reason: str


def _signature_problem(fn: Callable) -> str | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        return f"signature unreadable ({e})"
    missing = [
        p
        for p in REQUIRED_KEYWORD_ONLY
        if p not in params or params[p].kind is not inspect.Parameter.KEYWORD_ONLY
    ]
    if missing:
        return f"lacks keyword-only {', '.join(missing)}"
    return None


def find_kernel() -> KernelLookup:
    """Probe :data:`KERNEL_MODULES` for :data:`KERNEL_NAME`; never raises."""
    problems: list[str] = []
    for path in KERNEL_MODULES:
        try:
            module = importlib.import_module(path)
        except Exception as e:  # noqa: BLE001 - any import failure is a reason
            problems.append(f"{path}: {type(e).__name__}: {e}")
            continue
        fn = getattr(module, KERNEL_NAME, None)
        if not callable(fn):
            problems.append(f"{path}: no {KERNEL_NAME}")
            continue
        problem = _signature_problem(fn)
        if problem is not None:
            problems.append(f"{path}.{KERNEL_NAME}: {problem}")
            continue
        return KernelLookup(fn, f"{path}.{KERNEL_NAME}", "found")
    return KernelLookup(None, None, "; ".join(problems))
