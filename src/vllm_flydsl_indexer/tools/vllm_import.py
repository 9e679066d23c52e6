# SPDX-License-Identifier: Apache-2.0
"""No vLLM import can silence doctor, check or bench.

Every probe of vLLM in the gates and the tools catches ``Exception`` and reports it. A vLLM (or a
vLLM submodule) whose import raises anything else (``SystemExit(3)``, ``GeneratorExit``, a custom
``BaseException``) would end the command with no report, or with a traceback. While :func:`net` is
open, such an import raises ``ImportError("importing vllm raised SystemExit(3)")`` instead, which
every probe names in its report. Only the outermost vLLM module being imported converts: inside
vLLM's own imports the exception travels as vLLM raised it. A real Ctrl-C (a SIGINT that arrived
during the import) stays a ``KeyboardInterrupt``, and the tools' own :class:`~interrupt.StopNow`
stays itself.

Tools wing only: the plugin (``register()``) never imports this module.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType, ModuleType
from typing import Any

from vllm_flydsl_indexer.tools.interrupt import StopNow

__all__ = ["net", "raised"]

_state = threading.local()
_sigints = [0]  # SIGINTs that reached the handler net() installs: a KeyboardInterrupt after one is real


def _ours(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.")


def raised(name: str, error: BaseException) -> ImportError:
    """The ImportError that stands for ``error`` raised while importing module ``name``."""
    return ImportError(f"importing {name} raised {error!r}", name=name)


class _Loader:
    """A vLLM module's own loader, whose ``exec_module`` converts what no probe would catch."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        depth = getattr(_state, "depth", 0)
        sigints = _sigints[0]
        _state.depth = depth + 1
        try:
            self._loader.exec_module(module)
        except BaseException as e:
            if depth or isinstance(e, (Exception, StopNow)):
                raise
            if isinstance(e, KeyboardInterrupt) and _sigints[0] != sigints:
                raise  # a real Ctrl-C
            raise raised(module.__name__, e) from e
        finally:
            _state.depth = depth

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package ...
        return getattr(self._loader, name)


class _Finder:
    """Finds vLLM's modules as the finders after it do, wrapping each one's loader in :class:`_Loader`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if not _ours(name) or getattr(_state, "finding", False):
            return None
        _state.finding = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            _state.finding = False
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        return None


@contextlib.contextmanager
def net() -> Iterator[None]:
    """While open, a vLLM import that raises a non-``Exception`` raises :func:`raised` instead."""
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    previous = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGINT)

        def counting(signum: int, frame: FrameType | None) -> None:
            _sigints[0] += 1
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                raise KeyboardInterrupt

        if handler != signal.SIG_IGN:
            previous = handler
            signal.signal(signal.SIGINT, counting)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
