# SPDX-License-Identifier: Apache-2.0
"""The stock path and the patched path that ``check`` and ``bench`` run.

* **vLLM's own function** when vLLM is importable, its target has the supported
  signature, and vLLM would send the call to aiter's Gluon kernel on gfx950
  (``_ON_GFX950``, aiter enabled, ``paged_mqa_logits_module()`` found). Stock is
  the original ``rocm_fp8_paged_mqa_logits`` function object; the patched path
  is :class:`~vllm_flydsl_indexer.router.FlyDSLRouter` with
  :func:`~vllm_flydsl_indexer.target.vllm_stock_hooks`, wrapped by
  :func:`~vllm_flydsl_indexer.patch.wrap` exactly as serving wraps it, and
  called from the call sites' own modules so the caller rules apply.
* **The stock copy** everywhere else: this package's copy of vLLM's gfx9 branches (0.33.0 and 0.34.0 alike)
  (:func:`~vllm_flydsl_indexer.tools.arms.stock_call`) and hooks that mirror vLLM's.

With reference arms (no gfx950 GPU, or ``--reference``), vLLM's own function
runs with its two kernel lookups (aiter's Gluon module and the C4A Triton
route) pointed at the reference contracts while :meth:`Paths.session` is open,
so no real kernel is launched on tensors it cannot take.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from vllm_flydsl_indexer import envs, gates, patch
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.target import TARGET_MODULE, TARGET_NAME, StockHooks, unpatched, vllm_stock_hooks
from vllm_flydsl_indexer.tools.arms import (
    Arms,
    Workspace,
    c4a_route_reference,
    mirror_hooks,
    simulated_callers,
    stock_call,
)
from vllm_flydsl_indexer.tools.harness import plugin_logger
from vllm_flydsl_indexer.tools.reference import gluon_contract_reference

__all__ = ["Paths", "build_paths", "call_site_in", "vllm_gluon_objection", "vllm_target", "vllm_workspace"]

_CALL_SITE = compile(
    "def call_site(fn, args, kwargs):\n    return fn(*args, **kwargs)\n",
    "<vllm-flydsl-indexer call site>",
    "exec",
)


def call_site_in(module: ModuleType) -> Callable[[Callable, tuple, dict], object]:
    """A function living in ``module`` (its globals are the module's) that calls what it is given.

    ``call_site_in(m)(fn, args, kwargs)`` calls ``fn`` exactly as code in ``m`` would, so the patch
    sees ``m`` as the caller. It adds no name to ``m``.
    """
    namespace: dict[str, object] = {}
    exec(_CALL_SITE, vars(module), namespace)  # noqa: S102 - a fixed one-line function
    return namespace["call_site"]  # type: ignore[return-value]


def vllm_gluon_objection(
    target: object, aiter_ops: object = None, compress_ratio: int = 1, block_size: int = 1
) -> str | None:
    """Why vLLM's original (module ``target``, or a stand-in) would not call aiter's gfx950 Gluon kernel,
    or ``None``: the router's question (the hooks' ``gluon_objection``), asked once."""
    return vllm_stock_hooks(target, "size", aiter_ops).gluon_objection(compress_ratio, block_size)


@dataclass
class Paths:
    """Both paths over one output buffer, and how to call the patched one from a caller."""

    stock: Callable[..., torch.Tensor]
    router: FlyDSLRouter
    output_buffer: Callable[[int, int], torch.Tensor]
    uses_vllm: bool
    label: str
    make_router: Callable[..., FlyDSLRouter]
    _session: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    _modules: dict[str, ModuleType] = dataclasses.field(default_factory=dict)

    def session(self) -> contextlib.AbstractContextManager:
        """Open while running cases: vLLM's workspace and kernel lookups set up, then restored (the mirror:
        its call sites' code counts as audited, :func:`simulated_callers`)."""
        return self._session()

    def caller(self, name: str) -> ModuleType:
        """The caller's module: vLLM's own when it imports, else a stand-in of that name."""
        module = self._modules.get(name)
        if module is None:
            if self.uses_vllm:
                try:
                    module = importlib.import_module(name)
                except Exception:  # noqa: BLE001 - an absent call site gets a stand-in
                    module = None
            if module is None:
                module = types.ModuleType(name)
            self._modules[name] = module
        return module

    def stock_from(self, caller: str) -> Callable[..., torch.Tensor]:
        """The stock function as code in module ``caller`` calls it (the same call overhead as patched)."""
        site = call_site_in(self.caller(caller))
        stock = self.stock
        return lambda *args, **kwargs: site(stock, args, kwargs)

    def stand_in(self, caller: str) -> bool:
        """Is ``caller``'s module here a stand-in (no vLLM, or a call site this vLLM lacks)? A stand-in plays
        the audited releases' call site, so its code counts as theirs (:func:`simulated_callers`)."""
        return getattr(self.caller(caller), "__file__", None) is None

    def patched_from(self, caller: str, router: FlyDSLRouter | None = None) -> Callable[..., torch.Tensor]:
        """The patched function as code in module ``caller`` calls it."""
        wrapper = patch.wrap(self.stock, router or self.router)
        site = call_site_in(self.caller(caller))
        if not (self.uses_vllm and self.stand_in(caller)):  # the mirror's session simulates its callers
            return lambda *args, **kwargs: site(wrapper, args, kwargs)

        def call(*args, **kwargs) -> torch.Tensor:  # a call site this vLLM lacks (0.32.0's DeepSeek-V4.1)
            with simulated_callers():
                return site(wrapper, args, kwargs)

        return call

    def with_dcp(self, router: FlyDSLRouter, world_size: int) -> contextlib.AbstractContextManager:
        """``router`` seeing decode context parallel size ``world_size`` (a simulation)."""

        @contextlib.contextmanager
        def scope() -> Iterator[None]:
            hooks = router.hooks
            router.hooks = dataclasses.replace(hooks, dcp_world_size=lambda: world_size)
            try:
                yield
            finally:
                router.hooks = hooks

        return scope()


def vllm_target() -> tuple[ModuleType | None, str]:
    """vLLM's target module when its stock call would run aiter's Gluon on gfx950, else why not."""
    target, _, why = _vllm_target()
    return target, why


def _vllm_target() -> tuple[ModuleType | None, StockHooks | None, str]:
    """:func:`vllm_target`, and the hooks the patch's target gate resolved (signature, fingerprint, names)."""
    try:
        importlib.import_module(TARGET_MODULE)
    except Exception as e:  # noqa: BLE001 - no vLLM is a reason, not an error
        return None, None, f"vLLM unavailable ({type(e).__name__}: {e})"
    (_, ok, detail), target, hooks = gates.check_target()
    if not ok:
        return None, None, detail
    try:
        why = hooks.gluon_objection(1, 1)
    except Exception as e:  # noqa: BLE001
        return None, None, f"vLLM's aiter lookup failed ({type(e).__name__}: {e})"
    if why is not None:
        return None, None, why
    return target, hooks, "vLLM would run aiter's Gluon kernel here"


@contextlib.contextmanager
def _reference_lookups(
    target: ModuleType, output_buffer: Callable[[int, int], torch.Tensor]
) -> Iterator[None]:
    """Point vLLM's kernel lookups at the reference contracts, for reference arms."""
    gluon_module = types.SimpleNamespace(
        __name__="reference Gluon contract", deepgemm_fp8_paged_mqa_logits=gluon_contract_reference
    )
    saved = {
        name: vars(target)[name] for name in ("paged_mqa_logits_module", "rocm_fp8_paged_mqa_logits_triton")
    }
    target.paged_mqa_logits_module = lambda: gluon_module
    target.rocm_fp8_paged_mqa_logits_triton = functools.partial(c4a_route_reference, output_buffer)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(target, name, value)


@contextlib.contextmanager
def vllm_workspace(device: torch.device) -> Iterator[None]:
    """vLLM's workspace manager on ``device``, initialised for the session if the process has none.

    Its growth frees the accelerator cache, which a CPU-only torch refuses; on a
    CPU device without an accelerator that call is a no-op for the session.
    """
    from vllm.v1.worker import workspace as ws

    with contextlib.ExitStack() as stack:
        if device.type == "cpu" and not torch.accelerator.is_available():
            saved = torch.accelerator.empty_cache
            torch.accelerator.empty_cache = lambda: None
            stack.callback(setattr, torch.accelerator, "empty_cache", saved)
        if not ws.is_workspace_manager_initialized():
            ws.init_workspace_manager(device)
            stack.callback(ws.reset_workspace_manager)
        yield


@contextlib.contextmanager
def _vllm_session(
    target: ModuleType, device: torch.device, hooks: StockHooks, real_kernels: bool
) -> Iterator[None]:
    with vllm_workspace(device):
        if real_kernels:
            yield
        else:
            with _reference_lookups(target, hooks.output_buffer):
                yield


def build_paths(
    arms: Arms, device: torch.device, max_rows: int, max_model_len: int, logger: logging.Logger | None = None
) -> Paths:
    """vLLM's own paths when vLLM would run Gluon here, else the mirror."""
    variant = arms.flydsl_variant()
    logger = logger or plugin_logger()
    target, found_hooks, why = _vllm_target()
    if target is not None:
        stock = unpatched(vars(target)[TARGET_NAME])
        hooks = found_hooks
        session = functools.partial(_vllm_session, target, device, hooks, arms.real)
        kernels = (
            "aiter's Gluon kernel" if arms.real else "its aiter lookups pointed at the reference contracts"
        )
        label = f"vLLM's own {TARGET_MODULE}.{TARGET_NAME} ({kernels})"
    else:
        workspace = Workspace(max_rows, max_model_len, device)
        stock = stock_call(arms.gluon, workspace)
        hooks = mirror_hooks(workspace)
        session = simulated_callers  # the mirror's call sites are stand-ins, as its stock copy is
        label = f"this package's stock copy of vLLM's gfx950 branches ({why})"

    def make_router(**kwargs) -> FlyDSLRouter:
        # As serving installs it: the self-test unless VLLM_FLYDSL_INDEXER_SELFTEST turns it off.
        kwargs.setdefault("self_test", envs.read_flag(envs.SELFTEST, default=True)[0])
        # A routing proof, not a speed claim: no table and no measurement (FlyDSL wherever eligible), so
        # every case's expected arm follows from the rules alone, on any GPU and node cache.
        kwargs.setdefault("table", None)
        kwargs.setdefault("tune", None)
        return FlyDSLRouter(stock, variant, hooks, logger, **kwargs)

    return Paths(
        stock=stock,
        router=make_router(),
        output_buffer=hooks.output_buffer,
        uses_vllm=target is not None,
        label=label,
        make_router=make_router,
        _session=session,
    )
