# SPDX-License-Identifier: Apache-2.0
"""A dependency-free progress bar on stderr."""

from __future__ import annotations

import sys
import time

BAR_WIDTH = 24


class Progress:
    """``with Progress(n, label) as p: p.step(text)``; redraws in place on a TTY."""

    def __init__(self, total: int, label: str, stream=None):
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __enter__(self) -> Progress:
        return self

    def step(self, text: str) -> None:
        filled = BAR_WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        line = f"{self.label} [{bar}] {self.done + 1}/{self.total} {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.done += 1

    def __exit__(self, *exc) -> None:
        elapsed = time.monotonic() - self.start
        end = f"{self.label} [{'#' * BAR_WIDTH}] {self.done}/{self.total} done in {elapsed:.1f}s"
        self.stream.write(("\r\033[K" if self.tty else "") + end + "\n")
        self.stream.flush()
