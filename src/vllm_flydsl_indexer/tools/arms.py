# SPDX-License-Identifier: Apache-2.0
"""The two arms that ``check`` and ``bench`` compare, on this machine.

* **Real kernels** when aiter provides both the Gluon and the FlyDSL kernel and
  the device is gfx950: exactly what vLLM's stock function and the plugin run.
* **Reference contracts** everywhere else: the pure-torch references of the
  two write contracts. They are labelled as such and never presented as
  kernels.

Also the stock copy: this package's copy of vLLM's gfx950 branches of the
target (:func:`stock_call`, :func:`mirror_hooks`; the same in effect in vLLM
0.33.0 and 0.34.0), which :mod:`vllm_flydsl_indexer.tools.paths` uses where
vLLM's own function would not run aiter's Gluon kernel; its call sites are
stand-ins of the audited ones (:func:`simulated_callers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from vllm_flydsl_indexer import target
from vllm_flydsl_indexer.kernels import KernelVariant, find_kernel
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.target import TARGET_MODULE, StockHooks
from vllm_flydsl_indexer.tools.harness import plugin_logger
from vllm_flydsl_indexer.tools.reference import (
    GENERAL,
    VARIANT_CONTRACTS,
    PagedProblem,
    VariantContract,
    flydsl_contract_reference,
    fp8_paged_mqa_logits_reference,
    gluon_contract_reference,
    per_sequence_lens,
    variant_reference,
)

__all__ = [
    "Arms",
    "GLUON_KNOBS",
    "GLUON_MODULES",
    "GLUON_NAME",
    "REFERENCE_LABEL",
    "Workspace",
    "c4a_block_flat",
    "c4a_route_reference",
    "contract_limits",
    "detect_arms",
    "device_is_gfx950",
    "from_defining_module",
    "kernel_arms",
    "mirror_hooks",
    "patched_call",
    "per_sequence_context_lens",
    "raw_launch",
    "reference_arms",
    "reference_variant",
    "simulated_callers",
    "stock_call",
    "variant_order",
]

GLUON_MODULES = ("aiter.ops.triton.pa_mqa_logits", "aiter.ops.triton.attention.pa_mqa_logits")
GLUON_NAME = "deepgemm_fp8_paged_mqa_logits"


@dataclass
class Arms:
    real: bool
    label: str
    why: str
    gluon: Callable[..., torch.Tensor]
    flydsl: Callable[..., torch.Tensor]
    variant: KernelVariant | None = None
    # The API that reference arms pose as (check poses them as the found one).
    contract: VariantContract = GENERAL

    def flydsl_variant(self) -> KernelVariant:
        """The found API, or the FlyDSL arm posing as :attr:`contract`'s API (the general one by default)."""
        if self.variant is not None:
            return self.variant
        return dataclasses.replace(reference_variant(self.contract), fn=self.flydsl)

    def pose_as(self, contract: VariantContract) -> None:
        """Reference arms pose as ``contract``'s API; a substituted FlyDSL arm (a planted fault) is kept."""
        if self.flydsl is flydsl_contract_reference:
            self.flydsl = variant_reference(contract)
        self.contract = contract


def contract_limits(contract: VariantContract) -> dict[str, object]:
    """The :class:`KernelVariant` contract fields of a reference contract (the general kernel's: none,
    the general rule)."""
    if contract.heads is None:
        return {}

    def one(value: int | None) -> frozenset[int] | None:
        return None if value is None else frozenset({value})

    return {
        "heads": contract.heads,
        "head_dims": one(contract.head_dim),
        "block_sizes": one(contract.block_size),
        "index_dim": contract.index_dim,
        "max_next_n": contract.max_next_n,
        "gfx950": True,
    }


def reference_variant(contract: VariantContract) -> KernelVariant:
    """A :class:`KernelVariant` shaped like ``contract``'s API, its function the pure-torch reference
    that raises as that API's wrapper does."""
    return KernelVariant(
        contract.name,
        variant_reference(contract),
        f"reference {contract.name} FlyDSL contract",
        f"reference contract of the {contract.name} FlyDSL kernel",
        split_kv_workgroups_per_cu=contract.split_kv_wg_per_cu,
        **contract_limits(contract),
    )


def variant_order(found: str | None) -> tuple[VariantContract, ...]:
    """Every FlyDSL API the plugin knows, the found one first (the dispatcher dispatches to them)."""
    return tuple(sorted(VARIANT_CONTRACTS, key=lambda c: c.name != found))


def _find_gluon() -> tuple[Callable | None, str]:
    problems = []
    for path in GLUON_MODULES:
        try:
            fn = getattr(importlib.import_module(path), GLUON_NAME, None)
        except Exception as e:  # noqa: BLE001 - a probe reports, never raises
            problems.append(f"{path}: {type(e).__name__}")
            continue
        if callable(fn):
            return fn, f"{path}.{GLUON_NAME}"
        problems.append(f"{path}: no {GLUON_NAME}")
    return None, "; ".join(problems)


def device_is_gfx950(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip is None:
        return False
    return "gfx950" in torch.cuda.get_device_properties(device).gcnArchName


REFERENCE_LABEL = "reference contracts (pure torch; NOT the real kernels)"


def reference_arms() -> Arms:
    """The pure-torch references of the two write contracts, as arms."""
    return Arms(False, REFERENCE_LABEL, "", gluon_contract_reference, flydsl_contract_reference)


def detect_arms(device: torch.device, force_reference: bool = False) -> Arms:
    reference = reference_arms()
    if force_reference:
        reference.why = "--reference asked for"
        return reference
    if not device_is_gfx950(device):
        reference.why = f"device {device} is not a gfx950 GPU"
        return reference
    gluon, where = _find_gluon()
    if gluon is None:
        reference.why = f"aiter's Gluon kernel not found ({where})"
        return reference
    variant, reason = find_kernel()
    if variant is None:
        reference.why = f"aiter's FlyDSL kernel not found ({reason})"
        return reference
    return _real_arms(gluon, where, variant)


def kernel_arms(variant: KernelVariant) -> Arms | str:
    """The real arms over the found FlyDSL ``variant``, whatever the device (``tune --model`` decides the
    device itself), or why aiter's Gluon kernel, stock's, is not found."""
    gluon, where = _find_gluon()
    if gluon is None:
        return f"aiter's Gluon kernel, which stock runs, not found ({where})"
    return _real_arms(gluon, where, variant)


def _real_arms(gluon: Callable, where: str, variant: KernelVariant) -> Arms:
    label = f"real kernels: aiter Gluon vs aiter FlyDSL ({variant.name})"
    return Arms(True, label, f"{where}, {variant.location}", gluon, variant.fn, variant)


class Workspace:
    """Mimics vLLM's workspace: every request is a view from the buffer's start; it grows on demand."""

    def __init__(self, max_rows: int, max_model_len: int, device: torch.device):
        self.buffer = torch.empty(max_rows * max_model_len, dtype=torch.float32, device=device)

    def get(self, rows: int, max_model_len: int) -> torch.Tensor:
        if rows * max_model_len > self.buffer.numel():
            self.buffer = torch.empty(rows * max_model_len, dtype=torch.float32, device=self.buffer.device)
        return self.buffer[: rows * max_model_len].view(rows, max_model_len)


# vLLM's own Gluon call's other knobs (tests/test_drift.py pins them).
GLUON_KNOBS = {"ChunkK": 256, "WavePerEU": 2}


def raw_launch(kernel: Callable, output_buffer: Callable[[int, int], torch.Tensor], **knobs) -> Callable:
    """``kernel`` launched straight on a :class:`PagedProblem`, as vLLM launches Gluon (no router)."""

    def run(p: PagedProblem) -> torch.Tensor:
        q, kv, weights, lens, tables, _, max_model_len = p.call_args()
        out = output_buffer(p.batch * p.next_n, max_model_len)
        lens, size = per_sequence_lens(lens, p.batch).contiguous(), p.block_size
        kernel(
            q, kv, weights, out, lens, tables, max_model_len, Preshuffle=size > 1, KVBlockSize=size, **knobs
        )
        return out

    return run


def per_sequence_context_lens(context_lens: torch.Tensor) -> torch.Tensor:
    """vLLM's ``_per_sequence_context_lens``, for use without vLLM."""
    if context_lens.dim() == 2 and context_lens.shape[1] > 1:
        return context_lens[:, -1].contiguous()
    return context_lens


def c4a_block_flat(compress_ratio: int, block_size: int) -> bool:
    """vLLM 0.33.0 sends C4A (ratio 4, block-flat cache) to its own Triton route on gfx9."""
    return compress_ratio == 4 and block_size > 1


def c4a_route_reference(
    output_buffer: Callable[[int, int], torch.Tensor],
    q_fp8,
    kv_cache_fp8,
    weights,
    context_lens,
    block_tables,
    max_model_len,
) -> torch.Tensor:
    """Stand-in for vLLM's C4A Triton route on reference arms: the Gluon contract, block-flat cache."""
    batch_size, next_n = q_fp8.shape[:2]
    out = output_buffer(batch_size * next_n, max_model_len)
    return fp8_paged_mqa_logits_reference(
        q_fp8,
        kv_cache_fp8,
        weights,
        out,
        context_lens,
        block_tables,
        max_model_len,
        preshuffle=False,
        contract="gluon",
    )


def stock_call(gluon: Callable, workspace: Workspace) -> Callable[..., torch.Tensor]:
    """The stock copy: vLLM's gfx950 branches of ``rocm_fp8_paged_mqa_logits`` (0.33.0 and 0.34.0 alike).

    C4A goes to (the reference of) vLLM's Triton route; everything else to Gluon. Its signature is the
    target's, written out as vLLM writes it (as the router's call of the original is): a copy on purpose.
    """

    def rocm_fp8_paged_mqa_logits(
        q_fp8,
        kv_cache_fp8,
        weights,
        context_lens,
        block_tables,
        schedule_metadata,
        max_model_len,
        *,
        compress_ratio=1,
    ):
        batch_size, next_n = q_fp8.shape[:2]
        block_size = kv_cache_fp8.shape[1]
        if c4a_block_flat(compress_ratio, block_size):
            return c4a_route_reference(
                workspace.get, q_fp8, kv_cache_fp8, weights, context_lens, block_tables, max_model_len
            )
        out = workspace.get(batch_size * next_n, max_model_len)
        gluon(
            q_fp8,
            kv_cache_fp8,
            weights,
            out,
            per_sequence_context_lens(context_lens),
            block_tables,
            max_model_len,
            Preshuffle=block_size > 1,
            KVBlockSize=block_size,
            **GLUON_KNOBS,
        )
        return out

    return rocm_fp8_paged_mqa_logits


def mirror_hooks(workspace: Workspace) -> StockHooks:
    """Hooks that mirror what vLLM's are on gfx950 with aiter enabled, DCP 1."""
    return StockHooks(
        gluon_objection=lambda compress_ratio, block_size: (
            "the mirror's C4A Triton route" if c4a_block_flat(compress_ratio, block_size) else None
        ),
        output_buffer=workspace.get,
        per_sequence_lens=per_sequence_context_lens,
        dcp_world_size=lambda: 1,
        preshuffle=lambda block_size: block_size > 1,
    )


def patched_call(arms: Arms, workspace: Workspace, logger: logging.Logger | None = None) -> FlyDSLRouter:
    """The plugin's router over the mirror's stock call (tests on machines without vLLM)."""
    return FlyDSLRouter(
        stock_call(arms.gluon, workspace),
        arms.flydsl_variant(),
        mirror_hooks(workspace),
        logger or plugin_logger(),
    )


@contextlib.contextmanager
def simulated_callers() -> Iterator[None]:
    """While open, the audited multi-row call sites (``target.CALLER_CODE``) count as an audited release's
    code without being read: the mirror's callers are stand-ins of theirs, as its stock copy is of the
    target (the plugin reads vLLM's own, ``target.caller_release``; without vLLM none could be read)."""
    real = target.caller_release
    target.caller_release = lambda caller: "the mirror's stand-in" if caller in target.CALLER_CODE else None
    try:
        yield
    finally:
        target.caller_release = real


def from_defining_module(router: FlyDSLRouter) -> Callable[..., torch.Tensor]:
    """The router as the defining module's own indexer calls it (the mirror's call site, a stand-in)."""

    def call(*args, **kwargs) -> torch.Tensor:
        with simulated_callers():
            return router.call_from(TARGET_MODULE, *args, **kwargs)

    return call
