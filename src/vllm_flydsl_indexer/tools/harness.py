# SPDX-License-Identifier: Apache-2.0
"""What check, bench and tune share to run and report: the device, the timer, the quiet logger,
and an output write that never loses what was measured.

The tools are siblings over this module and :mod:`~vllm_flydsl_indexer.tools.settings`;
none imports another.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_flydsl_indexer.tools.interrupt import StopSignal, write_atomic

__all__ = ["Timer", "device_of", "quiet_logger", "write_or_print"]


def device_of(args: Any) -> torch.device:
    """``--device``, else the GPU when there is one, else the CPU."""
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def quiet_logger() -> logging.Logger:
    """The routers' logger in the tools: their tables report what the routers would log."""
    logger = logging.getLogger("vllm_flydsl_indexer.tools.router")
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


class Timer:
    """Device time per call (CUDA/HIP events around each call), else host wall time, in microseconds."""

    def __init__(self, device: torch.device, stop: StopSignal | None = None):
        self.cuda = device.type == "cuda"
        self.stop = stop  # checked before every call: a requested stop waits for one call, not the repeats

    def _check(self) -> None:
        if self.stop is not None:
            self.stop.check()

    def time_us(self, fn: Callable[[int], object], warmup: int, repeats: int) -> list[float]:
        for i in range(warmup):
            self._check()
            fn(i)
        samples = []
        for i in range(repeats):
            self._check()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(i)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn(i)
                samples.append((time.perf_counter() - t0) * 1e6)
        return samples


def write_or_print(
    tool: str, what: str, path: str, text: str, newline: str | None = None
) -> tuple[bool, str]:
    """Write ``text`` to ``path`` atomically: ``(True, "wrote ...")``, or, should that fail, print it
    to stdout between markers and return ``(False, "could not write ...; printed it above")``.

    Every output was opened for writing before the run (``cli_args.output_problem``), so a
    failure here is rare; what was measured is never lost to it.
    """
    try:
        write_atomic(path, text, newline=newline)
    except OSError as e:
        print(f"--- the {what} that could not be written to {path} ---\n{text.rstrip()}\n--- end ---")
        return False, f"{tool}: could not write {what} to {path} ({e.strerror or e}); printed it above"
    return True, f"{tool}: wrote {what} to {os.path.abspath(path)}"
