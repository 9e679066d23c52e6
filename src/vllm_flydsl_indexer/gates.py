# SPDX-License-Identifier: Apache-2.0
"""May the patch be installed at all? The gates, in order; the first that fails is the reason.

1. the switch; 2. vLLM does not route the call itself (in-tree); 3. the vLLM version window; 4. ROCm;
5. gfx950; 6. aiter enabled and installed; 7. the kernel (:func:`~vllm_flydsl_indexer.kernels.find_kernel`);
8. the target: its signature, its content and every vLLM name the router's hooks hold. Gates 4-6 are
cheap, so aiter is imported (gate 7) only where vLLM itself would. ``register()`` and ``doctor`` both
call :func:`evaluate`, so the log line and the doctor report never disagree. Nothing here raises.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from types import ModuleType

from vllm_flydsl_indexer import envs, files, target
from vllm_flydsl_indexer.envs import ACTIVE_LINE, IN_TREE_LINE, STOCK_LINE
from vllm_flydsl_indexer.kernels import KernelVariant, find_kernel
from vllm_flydsl_indexer.target import TARGET_MODULE, TARGET_NAME, signature_problem, unpatched

__all__ = [
    "Decision", "Gate", "MODEL_HINT", "SUPPORTED_VLLM", "check_version", "evaluate", "gcn_arch",
    "in_tree_route", "parse_version", "vllm_version",
]  # fmt: skip

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
    # vLLM routes the call to FlyDSL itself: the plugin patches and registers nothing.
    in_tree: bool = False
    # The router's vLLM hooks the target gate resolved (its content checked), for the install to use.
    hooks: target.StockHooks | None = None

    def log_line(self) -> str:
        """The one line ``register()`` logs: ACTIVE with what replaces what, or stock with the reason."""
        if self.in_tree:
            return f"{IN_TREE_LINE} ({self.reason}); the plugin patches nothing"
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


def _target_calls_flydsl() -> bool:
    """Whether the target function (its module's source read, not imported) calls a FlyDSL function."""
    spec = importlib.util.find_spec(TARGET_MODULE)
    origin = getattr(spec, "origin", None)
    if not origin:
        return False
    source = files.read_text(origin, target.MAX_SOURCE_BYTES)
    fn = target.function_node(source)
    return fn is not None and target.calls_flydsl(ast.parse(source), fn)


def in_tree_route() -> str | None:
    """Why vLLM already routes the call to FlyDSL itself, or ``None``; never raises: vLLM declares the
    switch in ``vllm.envs.environment_variables`` (not through this package), or its target's code calls
    a FlyDSL function (a comment or a string that mentions FlyDSL does not count)."""
    try:
        vllm_envs = sys.modules.get("vllm.envs")
        if vllm_envs is not None and envs.declared_by_vllm(getattr(vllm_envs, "environment_variables", None)):
            return f"vllm.envs declares {envs.SWITCH}"
        if _target_calls_flydsl():
            return f"{TARGET_MODULE}.{TARGET_NAME} already calls aiter's FlyDSL kernel"
    except Exception:  # noqa: BLE001 - unreadable: not in-tree; the target gate reports the rest
        return None
    return None


def _check_aiter() -> Gate:
    """vLLM's own cheap aiter questions: ``VLLM_ROCM_USE_AITER`` and ``find_spec``, no import."""
    try:
        import vllm.envs as vllm_envs

        if not vllm_envs.VLLM_ROCM_USE_AITER:
            return Gate("aiter", False, "VLLM_ROCM_USE_AITER is not 1, so vLLM does not use aiter")
        if importlib.util.find_spec("aiter") is None:
            return Gate("aiter", False, "aiter is not installed (importlib.util.find_spec('aiter') is None)")
    except Exception as e:  # noqa: BLE001
        return Gate("aiter", False, f"aiter unreadable ({type(e).__name__}: {e})")
    return Gate("aiter", True, "VLLM_ROCM_USE_AITER=1 and aiter is installed")


def _check_target() -> tuple[Gate, ModuleType | None, target.StockHooks | None]:
    """The target's signature, then its content and every vLLM name the router's hooks resolve: the
    gate, and the module and its hooks where it passes (the install uses these, not a second audit)."""
    try:
        module = importlib.import_module(TARGET_MODULE)
    except Exception as e:  # noqa: BLE001
        return Gate("target", False, f"{TARGET_MODULE} unimportable ({type(e).__name__}: {e})"), None, None
    fn = unpatched(vars(module).get(TARGET_NAME))
    problem = signature_problem(fn)
    if problem is not None:
        return Gate("target", False, f"{TARGET_MODULE}.{TARGET_NAME}: {problem}"), None, None
    try:
        hooks = target.vllm_stock_hooks(module)
    except target.ContentDrift as e:
        return Gate("target", False, str(e)), None, None
    except Exception as e:  # noqa: BLE001
        return Gate("target", False, f"vLLM's names unresolvable ({type(e).__name__}: {e})"), None, None
    passed = f"{TARGET_MODULE}.{TARGET_NAME} has the supported signature and does what was audited"
    return Gate("target", True, passed), module, hooks


def evaluate(environ: dict[str, str] | None = None, *, full: bool = False) -> Decision:
    """Run the gates in order; the first that fails is the reason. ``register()`` stops there;
    ``full=True`` (``doctor``) evaluates every later gate too, for the report, not the outcome."""
    switch = envs.read_flag(envs.SWITCH, environ)
    verify = envs.read_flag(envs.VERIFY, environ)
    allow = envs.read_flag(envs.ALLOW_UNTESTED_VLLM, environ)
    warnings = [f.error for f in (switch, verify, allow) if f.error]
    lookup = module = hooks = None

    def run_gates():
        nonlocal lookup, module, hooks
        yield (
            Gate("switch", True, f"{envs.SWITCH}={switch.raw}")
            if switch.enabled
            else Gate("switch", False, envs.off_reason(switch))
        )
        in_tree = in_tree_route()
        yield Gate("in-tree", in_tree is None, in_tree or "vLLM does not route the call to FlyDSL itself")
        yield check_version(vllm_version(), allow.enabled)
        cheap = [*_check_platform()]
        cheap.append(_check_aiter() if cheap[-1].ok else Gate("aiter", False, "not on gfx950", skipped=True))
        yield from cheap
        stopped = next((g for g in cheap if not g.ok and not g.skipped), None)
        if stopped is not None:  # import aiter only where vLLM would: a cheap gate failed
            yield Gate("kernel", False, f"aiter not imported (the {stopped.name} gate failed)", skipped=True)
        else:
            lookup = find_kernel()
            found = lookup.variant
            if found is None:
                yield Gate("kernel", False, f"aiter has no usable FlyDSL kernel ({lookup.reason})")
            else:
                yield Gate("kernel", True, f"found {found.location}: {found.name} ({found.description})")
        target_gate, module, hooks = _check_target()
        yield target_gate

    gates: list[Gate] = []
    for gate in run_gates():
        gates.append(gate)
        if not gate.ok and not full:
            break
    failed = next((g for g in gates if not g.ok), None)
    variant = lookup.variant if lookup is not None else None
    if failed is not None:
        in_tree = failed.name == "in-tree"
        return Decision(
            False, failed.detail, gates, variant, verify=verify.enabled, warnings=warnings, in_tree=in_tree
        )
    passed = "all gates passed"
    return Decision(True, passed, gates, variant, module, verify.enabled, warnings, gcn_arch(), hooks=hooks)
