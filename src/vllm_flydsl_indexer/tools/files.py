# SPDX-License-Identifier: Apache-2.0
"""Every file the tools read (tuned CSVs, model configs, Ray's list): a regular file, size-capped.

The open never blocks, so a FIFO never hangs start-up; anything but a regular file of at most
:data:`MAX_READ_BYTES` (a FIFO, a device such as ``/dev/zero``, a directory, an oversized file)
raises :class:`FileRefused` and nothing is read. The tools write through ``tools/outputs.py``.
"""

from __future__ import annotations

import os
import stat

from vllm_flydsl_indexer.target import KINDS

__all__ = ["FileRefused", "MAX_READ_BYTES", "kind_of", "read_text"]

# Larger than any tuned table or model config.json by far; /dev/zero and a runaway file stop here.
MAX_READ_BYTES = 16 * 1024 * 1024


class FileRefused(OSError):
    """A file that is not read or written: not a regular file, or over the size cap."""


def kind_of(mode: int) -> str:
    """What a non-regular file is, in the plugin's words (``target.KINDS``)."""
    return KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_text(path: str, limit: int = MAX_READ_BYTES) -> str:
    """The UTF-8 text of the regular file ``path`` (links followed, a BOM dropped), at most ``limit`` bytes.

    Raises :class:`FileRefused` for anything else before reading a byte; ``OSError`` and
    ``UnicodeDecodeError`` as reading does.
    """
    mode = os.stat(path).st_mode  # before the open: a socket cannot be opened, and says what it is
    if not stat.S_ISREG(mode):
        raise FileRefused(f"{path} is {kind_of(mode)}, not a regular file; nothing read")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileRefused(f"{path} is {kind_of(mode)}, not a regular file; nothing read")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileRefused(f"{path} is larger than {limit} bytes; nothing read")
    return data.decode("utf-8-sig")  # a byte-order mark, as spreadsheet programs write, is not text
