# SPDX-License-Identifier: Apache-2.0
"""Progress on stderr: tqdm's bar on a terminal, one plain line per step elsewhere."""

from __future__ import annotations

import sys
import time

__all__ = ["BAR_WIDTH", "Progress"]

BAR_WIDTH = 24


def _tqdm(total: int, label: str, stream):
    """A tqdm bar (tqdm comes with vLLM), or ``None`` where tqdm is not importable."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, file=stream, unit="case", dynamic_ncols=True, leave=True)


class Progress:
    """``with Progress(n, label) as p: p.step(text)``; ``step`` announces the next of ``n`` steps.

    On a TTY: tqdm's bar, or a hand-drawn one redrawn in place without tqdm. In
    a log or a pipe: one plain line per step, and a last line with the time taken.
    Set ``stopped`` when the run ends early on purpose: the last line then says
    ``k/n interrupted after ...`` (and ``failed after`` when an exception ends it),
    never ``done``.
    """

    def __init__(self, total: int, label: str, stream=None):
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.done = 0
        self.stopped = False
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = _tqdm(total, label, self.stream) if self.tty else None

    def __enter__(self) -> Progress:
        return self

    def step(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.done - self.bar.n)  # the steps before this one are finished
            self.bar.set_postfix_str(text)
            self.done += 1
            return
        filled = BAR_WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        line = f"{self.label} [{bar}] {self.done + 1}/{self.total} {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.done += 1

    def drop(self) -> None:
        """The step under way was stopped, not finished: the last line counts it out."""
        self.done = max(self.done - 1, 0)
        self.stopped = True

    def close(self, interrupted: bool = False) -> None:
        """Mark the run as stopped early (``interrupted``); ``__exit__`` writes the last line."""
        self.stopped = self.stopped or interrupted

    def __exit__(self, exc_type, exc, tb) -> None:
        finished = self.done
        if exc_type is not None:
            finished = max(self.done - 1, 0)  # the step under way did not finish
            how = "interrupted" if not issubclass(exc_type, Exception) else "failed"
        elif self.stopped:
            how = "interrupted"
        else:
            how = "done"
        if self.bar is not None:
            self.bar.update(finished - self.bar.n)
            self.bar.set_postfix_str("" if how == "done" else how)
            self.bar.close()
            return
        elapsed = time.monotonic() - self.start
        filled = BAR_WIDTH * finished // max(self.total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        when = "in" if how == "done" else "after"
        end = f"{self.label} [{bar}] {finished}/{self.total} {how} {when} {elapsed:.1f}s"
        self.stream.write(("\r\033[K" if self.tty else "") + end + "\n")
        self.stream.flush()
