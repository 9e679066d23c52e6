# SPDX-License-Identifier: Apache-2.0
"""The CLI's standard streams: printing is the last thing that can fail, and it never fails the work.

While a command runs, ``sys.stdout`` and ``sys.stderr`` are :class:`GuardedStream` s. A write that the
real stream refuses (stdout closed, ``/dev/full``, a pipe whose reader went away, a terminal that hung
up) is recorded once and every later write is dropped; a character the stream's encoding cannot show
is written escaped (``\\xe9``). The command goes on, writes its files and returns its own verdict;
the CLI then says in one line on stderr what could not be printed (nothing for a broken pipe, as Unix
tools do) and exits with that verdict, or 141 for a broken pipe.

:func:`shown` makes an echoed value safe to print: control characters escaped, and anything over
:data:`SHOWN_LIMIT` characters shortened with a count of what was cut.

Tools wing only: the plugin never imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from collections.abc import Iterator
from typing import IO, Any

__all__ = [
    "SHOWN_LIMIT",
    "GuardedStream",
    "guarded",
    "occupy_closed_descriptors",
    "safe_line",
    "safe_text",
    "shown",
]

# An echoed value longer than this is shortened, with a count of what was cut.
SHOWN_LIMIT = 200


class GuardedStream:
    """A text stream that never raises from ``write`` or ``flush``: the first failure is kept in
    :attr:`failure` (``"closed"`` when there is no stream at all) and later writes are dropped."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.stream = stream
        self.failure: BaseException | str | None = None if stream is not None else "closed"
        self.written = False  # anything at all was asked to be written

    def _fail(self, error: BaseException) -> None:
        self.failure = error
        # The interpreter flushes the real stream again at exit; a descriptor that took nothing then
        # prints "Exception ignored" and exits 120. Point it at the null device: that flush succeeds.
        with contextlib.suppress(Exception):
            fd = self.stream.fileno()  # type: ignore[union-attr]
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)

    def write(self, text: str) -> int:
        if text:
            self.written = True
        if self.failure is not None:
            return len(text)
        assert self.stream is not None
        try:
            try:
                return self.stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(self.stream, "encoding", None) or "ascii"
                return self.stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        except (OSError, ValueError) as e:  # ValueError: a stream closed under us
            self._fail(e)
            return len(text)

    def flush(self) -> None:
        if self.failure is not None or self.stream is None:
            return
        try:
            self.stream.flush()
        except (OSError, ValueError) as e:
            self._fail(e)

    def isatty(self) -> bool:
        try:
            return self.failure is None and bool(self.stream.isatty())  # type: ignore[union-attr]
        except (OSError, ValueError, AttributeError):
            return False

    def __getattr__(self, name: str) -> Any:
        if self.stream is None:
            raise AttributeError(name)
        return getattr(self.stream, name)

    @property
    def broken_pipe(self) -> bool:
        return isinstance(self.failure, OSError) and self.failure.errno == errno.EPIPE

    def problem(self) -> str | None:
        """What went wrong, in a few words, or ``None`` (also for a closed stream nothing was sent to)."""
        if self.failure is None:
            return None
        if self.failure == "closed":
            return "standard output is closed; nothing was printed" if self.written else None
        error = self.failure
        why = getattr(error, "strerror", None) or str(error) or type(error).__name__
        return f"could not print to standard output ({why}); the rest of the report was dropped"


@contextlib.contextmanager
def guarded() -> Iterator[tuple[GuardedStream, GuardedStream]]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`GuardedStream` s for the block, flushed and put
    back after it, whatever ends it."""
    saved = sys.stdout, sys.stderr
    out, err = GuardedStream(sys.stdout), GuardedStream(sys.stderr)
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    try:
        yield out, err
    finally:
        out.flush()
        err.flush()
        sys.stdout, sys.stderr = saved


def occupy_closed_descriptors() -> None:
    """Put the null device on each of descriptors 0-2 that is closed.

    Otherwise the next file this process opens takes that number, and whatever writes to
    "standard output" (a C library, a child) writes into it. ``sys.stdout`` stays ``None``.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                new = os.open(os.devnull, os.O_RDWR)
                if new != fd:
                    os.dup2(new, fd)
                    os.close(new)


def safe_text(text: str) -> str:
    """``text`` with every control character but newline and tab escaped (``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text
    )


def shown(value: object, limit: int = SHOWN_LIMIT) -> str:
    """``value`` quoted as ``repr`` quotes a string, control characters escaped, and shortened to
    ``limit`` characters with a count of the rest: safe to echo to a terminal."""
    text = str(value)
    cut = len(text) - limit
    quoted = repr(text[:limit]) if cut > 0 else repr(text)
    return f"{quoted}... ({cut} more characters)" if cut > 0 else quoted


def safe_line(text: str, limit: int = SHOWN_LIMIT) -> str:
    """``text`` safe to print as one line: control characters escaped (:func:`safe_text`), a newline too
    (a path may hold one), and every run of non-space characters over ``limit`` shortened, with a count of
    what was cut (an echoed value)."""
    text = safe_text(text).replace("\n", "\\n")
    if len(text) <= limit:
        return text
    return re.sub(
        rf"\S{{{limit + 1},}}",
        lambda m: f"{m.group()[:limit]}... ({len(m.group()) - limit} more characters)",
        text,
    )
