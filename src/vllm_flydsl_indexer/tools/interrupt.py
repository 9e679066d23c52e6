# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C and SIGTERM for the long-running tools: keep what was measured.

The first SIGINT or SIGTERM asks for a stop: the tool finishes the shape (or
case) it is on, then writes and prints what finished and exits
:data:`EXIT_INTERRUPTED`. A second one raises :class:`StopNow` at once; the
CLI turns that into one line and the same exit status, never a traceback.
Output files are replaced atomically (``files.write_atomic``), so an interrupted
write leaves the old file, never half of a new one.

Tools wing only: the plugin never imports this module.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import IO, Any

from vllm_flydsl_indexer.files import write_atomic, write_atomic_bytes
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
