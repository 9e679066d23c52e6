# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C and SIGTERM for the long-running tools: keep what was measured, stop in bounded time.

The first SIGINT, SIGTERM or SIGHUP (a closed terminal) asks for a stop. ``check`` finishes the case it is
on (a few calls); ``bench`` and ``tune --out`` stop at the next timed call
(:meth:`StopSignal.check` raises :class:`Stopped` between calls, so the bound is
one call, not a shape's repeats) and drop the shape under way. Then they write
and print what finished and exit :data:`EXIT_INTERRUPTED`. A second one raises
:class:`StopNow` at once; the CLI turns that into one line and the same exit
status, never a traceback. Outside a tool's own handlers (before, or after its
graceful stop finished) a SIGTERM or SIGHUP is a :class:`StopNow` too
(:func:`terminate_as_interrupt`): one outcome, one exit status, 130.
Output files are replaced atomically (``tools.outputs.write_atomic``), so an interrupted
write leaves the old file, never half of a new one.

Tools wing only: the plugin never imports this module.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import IO, Any

from vllm_flydsl_indexer.tools.outputs import write_atomic, write_atomic_bytes
from vllm_flydsl_indexer.tools.settings import PROG

__all__ = [
    "EXIT_INTERRUPTED",
    "StopNow",
    "StopSignal",
    "Stopped",
    "interrupted_note",
    "terminate_as_interrupt",
    "write_atomic",
    "write_atomic_bytes",
]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
# SIGHUP (a closed terminal or ssh session) is handled as SIGTERM: what finished is kept.
HANGUPS = tuple(getattr(signal, name) for name in ("SIGHUP",) if hasattr(signal, name))
SIGNALS = (signal.SIGINT, signal.SIGTERM, *HANGUPS)


class StopNow(BaseException):
    """A second signal: stop at once. A BaseException, so no ``except Exception`` swallows it."""


class Stopped(Exception):
    """A requested stop, reached between two timed calls: the shape under way is dropped."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`StopNow` while the command runs (main thread only), as SIGINT
    raises ``KeyboardInterrupt``: the CLI exits 130 for each, never 143 for one and 130 for another."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop_now(signum: int, frame: FrameType | None) -> None:
        raise StopNow(signal.Signals(signum).name)

    previous = _install((signal.SIGTERM, *HANGUPS), stop_now)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _install(signums: tuple[int, ...], handler: Any) -> dict[int, Any]:
    """Set ``handler`` for each signal, the previous handlers returned; a SIGHUP that was ignored
    (``nohup``) stays ignored."""
    previous = {}
    for signum in signums:
        if signum in HANGUPS and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        previous[signum] = signal.signal(signum, handler)
    return previous


class StopSignal:
    """``with StopSignal() as stop:`` then ``if stop.requested: break`` between shapes.

    Installs handlers for SIGINT, SIGTERM and SIGHUP (in the main thread only; elsewhere
    it is inert) and restores the previous ones on exit. The first signal sets
    :attr:`requested` and :attr:`signal_name` and prints one line to stderr;
    the second raises :class:`StopNow`.
    """

    def __init__(self, unit: str = "shape", stream: IO[str] | None = None, per_call: bool = False) -> None:
        self.unit = unit
        self.stream = stream
        self.per_call = per_call  # the loop calls check() between calls: the unit under way is dropped
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = _install(SIGNALS, self._handle)
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
        when = (
            f"stopping after the current call; the {self.unit} under way is dropped"
            if self.per_call
            else f"stopping after the current {self.unit}"
        )
        stream.write(f"{lead}{PROG}: {name}: {when} (again to stop now)\n")
        stream.flush()

    def check(self) -> None:
        """Raise :class:`Stopped` once a stop was requested (call it between timed calls)."""
        if self.requested:
            raise Stopped(self.signal_name)


def interrupted_note(done: int, total: int) -> str:
    """The last line of an interrupted run."""
    return f"interrupted after {done}/{total}"
