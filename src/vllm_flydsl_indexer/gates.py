# SPDX-License-Identifier: Apache-2.0
"""The gates that decide whether the FlyDSL arm can be installed, in order.

1. the switch; 2. the vLLM version window; 3. ROCm; 4. gfx950; 5. the
kernel; 6. the target's signature. The first gate that fails is the reason.
``register()`` and ``doctor`` both call :func:`evaluate`, so the log line and
the doctor report never disagree. Nothing here raises.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass, field
from types import ModuleType

from vllm_flydsl_indexer import envs
from vllm_flydsl_indexer._logging import ACTIVE_LINE, STOCK_LINE
from vllm_flydsl_indexer.identification import find_kernel
from vllm_flydsl_indexer.kernels import KernelVariant
from vllm_flydsl_indexer.target import TARGET_MODULE, TARGET_NAME, signature_problem, unpatched

__all__ = [
    "Decision",
    "Gate",
    "MODEL_HINT",
    "SUPPORTED_VLLM",
    "check_version",
    "evaluate",
    "gcn_arch",
    "parse_version",
    "vllm_version",
]

# Tested vLLM releases: (major, minor) inclusive. Dev and local builds count.
SUPPORTED_VLLM = ((0, 32), (0, 34))
# vLLM loads plugins before any model config exists (in every process), so the ACTIVE line cannot
# tell whether the served model ever calls the patched function: doctor can (and patch.py's config
# watch warns when vLLM later resolves the model's indexer to MXFP4).
MODEL_HINT = "vllm-flydsl-indexer doctor --model MODEL tells whether yours does"


@dataclass(frozen=True)
class Gate:
    name: str
    ok: bool
    detail: str
    # Not evaluated because an earlier gate it depends on failed (never the deciding gate).
    skipped: bool = False


@dataclass
class Decision:
    """The outcome: whether FlyDSL is active, the one reason, and every gate."""

    active: bool
    reason: str
    gates: list[Gate] = field(default_factory=list)
    variant: KernelVariant | None = None
    target_module: ModuleType | None = None
    verify: bool = False
    warnings: list[str] = field(default_factory=list)
    # The arch as vLLM reports it (e.g. "gfx950:sramecc+:xnack-"), when ROCm.
    gcn_arch: str | None = None
    # Which measured table picks the arm per shape, in a few words (set when the patch is installed).
    table: str | None = None

    def log_line(self) -> str:
        """The one line ``register()`` logs: ACTIVE with what replaces what, or stock with the reason."""
        if self.active:
            return (
                f"{ACTIVE_LINE} ({self.variant.location if self.variant else '?'}, "
                f"{self.variant.description if self.variant else '?'}, replaces "
                f"{TARGET_MODULE}.{TARGET_NAME} for eligible decode calls"
                f"{'; verify-on-enable on' if self.verify else ''}"
                f"{f'; per shape: {self.table}' if self.table else ''}; "
                "only models whose FP8 indexer calls it on a layer-contiguous cache reach it: "
                f"{MODEL_HINT})"
            )
        return f"{STOCK_LINE} {self.reason})"


def parse_version(text: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def vllm_version() -> str | None:
    """vLLM's version from package metadata (no ``import vllm``)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(version: str | None, allow_untested: bool) -> Gate:
    if version is None:
        return Gate("vllm", False, "vLLM is not installed")
    parsed = parse_version(version)
    low, high = SUPPORTED_VLLM
    window = f"{low[0]}.{low[1]}.x-{high[0]}.{high[1]}.x"
    if parsed is None:
        return Gate("vllm", False, f"vLLM version {version!r} is unreadable")
    if low <= parsed <= high:
        return Gate("vllm", True, f"vLLM {version} is inside the tested window {window}")
    if allow_untested and parsed > high:
        return Gate(
            "vllm",
            True,
            f"vLLM {version} is outside the tested window {window}; allowed by {envs.ALLOW_UNTESTED_VLLM}=1",
        )
    return Gate(
        "vllm",
        False,
        f"vLLM {version} is outside the tested window {window}"
        + (f" (set {envs.ALLOW_UNTESTED_VLLM}=1 to try a newer one)" if parsed > high else ""),
    )


def gcn_arch() -> str | None:
    """vLLM's ROCm arch string, or ``None``; never raises."""
    try:
        from vllm.platforms.rocm import _GCN_ARCH

        return str(_GCN_ARCH)
    except Exception:  # noqa: BLE001
        return None


_GFX950_SKIPPED = Gate("gfx950", False, "vLLM reads the arch only on ROCm", skipped=True)


def _check_platform() -> tuple[Gate, Gate]:
    try:
        from vllm.platforms import current_platform

        is_rocm = bool(current_platform.is_rocm())
    except Exception as e:  # noqa: BLE001 - report, never raise into vLLM
        return Gate("rocm", False, f"vLLM platform unavailable ({type(e).__name__}: {e})"), _GFX950_SKIPPED
    if not is_rocm:
        name = type(current_platform).__name__
        return Gate("rocm", False, f"not ROCm (vLLM platform: {name})"), _GFX950_SKIPPED
    rocm = Gate("rocm", True, "vLLM platform is ROCm")
    try:
        from vllm.platforms.rocm import _GCN_ARCH, on_gfx950

        arch = str(_GCN_ARCH)
        if on_gfx950():
            return rocm, Gate("gfx950", True, f"vLLM reports gfx950 ({arch})")
        return rocm, Gate("gfx950", False, f"not gfx950 (vLLM reports {arch})")
    except Exception as e:  # noqa: BLE001
        return rocm, Gate("gfx950", False, f"arch unreadable ({type(e).__name__}: {e})")


def _check_target() -> tuple[Gate, ModuleType | None]:
    try:
        module = importlib.import_module(TARGET_MODULE)
    except Exception as e:  # noqa: BLE001
        return Gate("target", False, f"{TARGET_MODULE} unimportable ({type(e).__name__}: {e})"), None
    fn = unpatched(vars(module).get(TARGET_NAME))
    problem = signature_problem(fn)
    if problem is not None:
        return Gate("target", False, f"{TARGET_MODULE}.{TARGET_NAME}: {problem}"), None
    return Gate("target", True, f"{TARGET_MODULE}.{TARGET_NAME} has the supported signature"), module


def evaluate(environ: dict[str, str] | None = None, *, full: bool = False) -> Decision:
    """Run the gates in order; the first that fails is the reason.

    ``register()`` stops at the first failure. ``full=True`` (``doctor``) still
    evaluates every later gate, for the report, without changing the outcome.
    """
    switch = envs.read_flag(envs.SWITCH, environ)
    verify = envs.read_flag(envs.VERIFY, environ)
    allow = envs.read_flag(envs.ALLOW_UNTESTED_VLLM, environ)
    warnings = [f.error for f in (switch, verify, allow) if f.error]
    gates: list[Gate] = []
    lookup = None
    module = None

    def run_gates():
        nonlocal lookup, module
        if switch.enabled:
            yield Gate("switch", True, f"{envs.SWITCH}={switch.raw}")
        else:
            yield Gate("switch", False, envs.off_reason(switch))
        yield check_version(vllm_version(), allow.enabled)
        rocm, gfx950 = _check_platform()
        yield rocm
        yield gfx950
        lookup = find_kernel()
        if lookup.variant is None:
            yield Gate("kernel", False, f"aiter has no usable FlyDSL kernel ({lookup.reason})")
        else:
            yield Gate(
                "kernel",
                True,
                f"found {lookup.location}: {lookup.variant.name} ({lookup.variant.description})",
            )
        target_gate, module = _check_target()
        yield target_gate

    first_failure: Gate | None = None
    for gate in run_gates():
        gates.append(gate)
        if not gate.ok and first_failure is None:
            first_failure = gate
            if not full:
                break

    if first_failure is not None:
        variant = lookup.variant if lookup is not None else None
        return Decision(False, first_failure.detail, gates, variant, verify=verify.enabled, warnings=warnings)
    assert lookup is not None
    return Decision(
        True,
        "all gates passed",
        gates,
        lookup.variant,
        module,
        verify=verify.enabled,
        warnings=warnings,
        gcn_arch=gcn_arch(),
    )
