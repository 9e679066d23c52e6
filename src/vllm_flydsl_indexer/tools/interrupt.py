# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C and SIGTERM for the long-running tools: keep what was measured.

The first SIGINT or SIGTERM asks for a stop: the tool finishes the shape (or
case) it is on, then writes and prints what finished and exits
:data:`EXIT_INTERRUPTED`. A second one raises :class:`StopNow` at once; the
CLI turns that into one line and the same exit status, never a traceback.
Output files are replaced atomically (:func:`write_atomic`), so an interrupted
write leaves the old file, never half of a new one.

Tools wing only: the plugin never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from types import FrameType
from typing import IO, Any

from vllm_flydsl_indexer.tools.settings import PROG

__all__ = [
    "EXIT_INTERRUPTED",
    "StopNow",
    "StopSignal",
    "interrupted_note",
    "write_atomic",
    "write_atomic_bytes",
]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopNow(BaseException):
    """A second signal: stop at once. A BaseException, so no ``except Exception`` swallows it."""


class StopSignal:
    """``with StopSignal() as stop:`` then ``if stop.requested: break`` between shapes.

    Installs handlers for SIGINT and SIGTERM (in the main thread only; elsewhere
    it is inert) and restores the previous ones on exit. The first signal sets
    :attr:`requested` and :attr:`signal_name` and prints one line to stderr;
    the second raises :class:`StopNow`.
    """

    def __init__(self, unit: str = "shape", stream: IO[str] | None = None) -> None:
        self.unit = unit
        self.stream = stream
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            raise StopNow(name)
        self.requested = True
        self.signal_name = name
        stream = self.stream or sys.stderr
        # On a terminal the progress bar holds the cursor mid-line.
        lead = "\n" if getattr(stream, "isatty", lambda: False)() else ""
        stream.write(f"{lead}{PROG}: {name}: stopping after the current {self.unit} (again to stop now)\n")
        stream.flush()


def interrupted_note(done: int, total: int) -> str:
    """The last line of an interrupted run."""
    return f"interrupted after {done}/{total}"


def _replace_atomic(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write a temporary file beside ``path`` with ``write``, sync it, then rename it over ``path``."""
    directory, name = os.path.split(os.path.abspath(path))
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o644 & ~umask
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str, text: str, newline: str | None = None) -> None:
    """Replace ``path`` with ``text`` all at once: readers see the old file or the new one.

    UTF-8; ``newline`` as for :func:`open` (``""``: no translation). The mode
    of an existing file is kept; a new file gets 0o644 less the umask.
    """

    if newline not in ("", "\n"):
        text = text.replace("\n", os.linesep if newline is None else newline)
    data = text.encode("utf-8")
    _replace_atomic(path, lambda f: f.write(data))


def write_atomic_bytes(path: str, data: bytes) -> None:
    """:func:`write_atomic` for bytes (a rendered plot)."""
    _replace_atomic(path, lambda f: f.write(data))
