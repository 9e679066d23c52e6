# SPDX-License-Identifier: Apache-2.0
"""May the patch be installed at all? The gates, in order; the first that fails is the reason.

switch, in-tree (vLLM declares the switch), vllm (the tested window), rocm, gfx950, aiter (enabled and
installed), kernel (aiter imported only past the cheap gates, as vLLM would), target (signature, fingerprint,
hooks). ``register()`` and ``doctor`` both call :func:`evaluate`. A gate is ``(name, ok, detail)``, ``ok``
``None`` where a gate it needs failed. Nothing here raises.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from types import ModuleType

from vllm_flydsl_indexer import envs, target
from vllm_flydsl_indexer.envs import ACTIVE_LINE, IN_TREE_LINE, STOCK_LINE
from vllm_flydsl_indexer.kernels import KernelVariant, find_kernel, installed_version

Gate = tuple[str, bool | None, str]
# Tested vLLM releases: (major, minor) inclusive. Dev and local builds count.
SUPPORTED_VLLM = ((0, 32), (0, 34))
# The plugin loads before any model config exists: doctor can tell whether the model calls the target.
MODEL_HINT = "vllm-flydsl-indexer doctor --model MODEL tells whether yours does"


@dataclass
class Decision:
    """The outcome: whether FlyDSL is active, the one reason, and every gate."""

    active: bool
    reason: str
    gates: list[Gate] = field(default_factory=list)
    variant: KernelVariant | None = None
    target_module: ModuleType | None = None
    warnings: list[str] = field(default_factory=list)
    gcn_arch: str | None = None  # as vLLM reports it (e.g. "gfx950:sramecc+:xnack-"), when ROCm
    table: str | None = None  # which measured table picks the arm per shape (set when the patch is installed)
    in_tree: bool = False  # vLLM declares the switch itself: the plugin patches and registers nothing
    hooks: target.StockHooks | None = None  # the router's vLLM hooks the target gate resolved

    def log_line(self) -> str:
        """The one line ``register()`` logs: ACTIVE with what replaces what, or stock with the reason."""
        if self.in_tree:
            return f"{IN_TREE_LINE} ({self.reason}); the plugin patches nothing"
        if not self.active or self.variant is None:
            return f"{STOCK_LINE} {self.reason})"
        table = f"; per shape: {self.table}" if self.table else ""
        return (
            f"{ACTIVE_LINE} ({self.variant.location}, {self.variant.description}, replaces "
            f"{target.TARGET_MODULE}.{target.TARGET_NAME} for eligible decode calls{table}; only models "
            f"whose FP8 indexer calls it on a layer-contiguous cache reach it: {MODEL_HINT})"
        )


def vllm_version() -> str | None:
    """vLLM's version from package metadata (no ``import vllm``)."""
    return None if (version := installed_version(("vllm",))) == "unknown" else version


def check_version(version: str | None) -> Gate:
    if version is None:
        return "vllm", False, "vLLM is not installed"
    m = re.match(r"^\s*(\d+)\.(\d+)", version)
    if m is None:
        return "vllm", False, f"vLLM version {version!r} is unreadable"
    parsed, (low, high) = (int(m.group(1)), int(m.group(2))), SUPPORTED_VLLM
    window = f"{low[0]}.{low[1]}.x-{high[0]}.{high[1]}.x"
    if low <= parsed <= high:
        return "vllm", True, f"vLLM {version} is inside the tested window {window}"
    return (
        "vllm",
        False,
        f"vLLM {version} is outside the tested window {window}: a release is supported once audited",
    )


def gcn_arch() -> str | None:
    """vLLM's ROCm arch string, or ``None``; never raises."""
    try:
        from vllm.platforms.rocm import _GCN_ARCH

        return str(_GCN_ARCH)
    except Exception:  # noqa: BLE001
        return None


def _platform_gates() -> list[Gate]:
    """ROCm, gfx950, then vLLM's own cheap aiter questions (``VLLM_ROCM_USE_AITER``, ``find_spec``)."""
    names, found = ("rocm", "gfx950", "aiter"), []
    try:
        from vllm.platforms import current_platform

        rocm, platform = bool(current_platform.is_rocm()), type(current_platform).__name__
        why = "vLLM platform is ROCm" if rocm else f"not ROCm (vLLM platform: {platform})"
        found.append(("rocm", rocm, why))
        if rocm:
            from vllm.platforms.rocm import on_gfx950

            ok, arch = bool(on_gfx950()), gcn_arch()
            why = f"vLLM reports gfx950 ({arch})" if ok else f"not gfx950 (vLLM reports {arch})"
            found.append(("gfx950", ok, why))
        if found[-1][1]:
            import vllm.envs as vllm_envs

            why = None
            if not vllm_envs.VLLM_ROCM_USE_AITER:
                why = "VLLM_ROCM_USE_AITER is not 1, so vLLM does not use aiter"
            elif importlib.util.find_spec("aiter") is None:
                why = "aiter is not installed (importlib.util.find_spec('aiter') is None)"
            found.append(("aiter", why is None, why or "VLLM_ROCM_USE_AITER=1 and aiter is installed"))
    except Exception as e:  # noqa: BLE001 - report, never raise into vLLM
        what = ("vLLM platform unavailable", "arch unreadable", "aiter unreadable")[len(found)]
        found.append((names[len(found)], False, f"{what} ({type(e).__name__}: {e})"))
    return found + [(name, None, f"the {found[-1][0]} gate failed") for name in names[len(found) :]]


def check_target() -> tuple[Gate, ModuleType | None, target.StockHooks | None]:
    """The target's fingerprint (its exact code, its signature included) and hooks: the gate, and the module
    and hooks where it passes. Code that is not an audited release's keeps stock: the router launches FlyDSL
    with what it passes."""
    where = f"{target.TARGET_MODULE}.{target.TARGET_NAME}"
    try:
        module = importlib.import_module(target.TARGET_MODULE)
        fn = target.unpatched(vars(module).get(target.TARGET_NAME))
        if not callable(fn):
            return ("target", False, f"{where} is missing"), None, None
        try:  # its exact code, its signature included
            audited, problem = target.AUDITED.get(target.fingerprint_of(fn)), None
        except Exception as e:  # noqa: BLE001 - no readable source: no fingerprint
            audited, problem = None, f"its source is unreadable ({type(e).__name__}: {e})"
        if audited is None:
            releases = ", ".join(release for release, _ in target.AUDITED.values())
            what = problem or f"its code is none of the audited releases' ({releases})"
            return ("target", False, f"vLLM {vllm_version()}'s {target.TARGET_NAME}: {what}"), None, None
        hooks = target.vllm_stock_hooks(module, audited[1])
    except Exception as e:  # noqa: BLE001
        return ("target", False, f"{where}: {type(e).__name__}: {e}"), None, None
    how = f"is vLLM {audited[0]}'s audited code"
    if target.caller_release(target.TARGET_MODULE) is None:  # its caller's code read now, once per process
        how += f"; {target.multi_row_objection(target.TARGET_MODULE)}"
    return ("target", True, f"{where} {how}"), module, hooks


def evaluate(environ: dict[str, str] | None = None, *, full: bool = False) -> Decision:
    """Run the gates in order; the first that fails is the reason. ``register()`` stops there;
    ``full=True`` (``doctor``) evaluates every later gate too, for the report, not the outcome."""
    switch, switch_error = envs.read_flag(envs.SWITCH, environ)
    warnings = [switch_error] if switch_error else []
    variant = module = hooks = None

    def run_gates():
        nonlocal variant, module, hooks
        yield "switch", switch, f"{envs.SWITCH}=1" if switch else envs.off_reason(envs.SWITCH, environ)
        table = getattr(sys.modules.get("vllm.envs"), "environment_variables", None)
        # Declared by vLLM itself, not through the getters this package adds (``envs.OWN_GETTER``).
        declared = isinstance(table, dict) and envs.SWITCH in table
        declared = declared and not getattr(table[envs.SWITCH], envs.OWN_GETTER, False)
        what = f"vllm.envs declares {envs.SWITCH}" if declared else "vLLM does not route it itself"
        yield "in-tree", not declared, what
        yield check_version(vllm_version())
        cheap = _platform_gates()
        yield from cheap
        stopped = next((g for g in cheap if g[1] is False), None)
        if stopped is not None:  # import aiter only where vLLM would
            yield "kernel", None, f"aiter not imported (the {stopped[0]} gate failed)"
        else:
            variant, reason = find_kernel()
            found = variant and f"found {variant.location}: {variant.name} ({variant.description})"
            yield "kernel", variant is not None, found or f"aiter has no usable FlyDSL kernel ({reason})"
        gate, module, hooks = check_target()
        yield gate

    gates: list[Gate] = []
    for gate in run_gates():
        gates.append(gate)
        if gate[1] is False and not full:
            break
    failed = next((g for g in gates if g[1] is False), None)
    if failed is not None:
        return Decision(False, failed[2], gates, variant, warnings=warnings, in_tree=failed[0] == "in-tree")
    return Decision(True, "all gates passed", gates, variant, module, warnings, gcn_arch(), hooks=hooks)
