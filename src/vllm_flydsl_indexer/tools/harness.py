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
from dataclasses import dataclass
from typing import Any

import torch

from vllm_flydsl_indexer import selftest
from vllm_flydsl_indexer.target import INDEX_TOPK
from vllm_flydsl_indexer.tools.interrupt import StopSignal, write_atomic
from vllm_flydsl_indexer.tools.streams import safe_line

__all__ = [
    "Agreement", "Timer", "compare_in_windows", "device_of", "plugin_logger", "quiet_logger", "with_once",
    "write_or_print",
]  # fmt: skip


@dataclass
class Agreement:
    """What the plugin's agreement rule (``selftest.compare_in_windows``) found, for the tools' reports."""

    rows: int
    read_columns: int
    max_rel_diff: float
    mask_equal: bool
    topk_equal: bool
    nan_free: bool

    def within(self, tolerance: float) -> bool:
        """The relative difference is inside the rule (exactly 0 when ``tolerance`` is 0)."""
        return self.max_rel_diff == 0.0 if tolerance == 0 else self.max_rel_diff < tolerance

    def ok(self, tolerance: float) -> bool:
        return selftest.disagreement(vars(self), tolerance) is None

    def describe(self) -> str:
        return selftest.describe_agreement(vars(self))


def compare_in_windows(
    expected: torch.Tensor, actual: torch.Tensor, ends: torch.Tensor, topk: int = INDEX_TOPK
) -> Agreement:
    """The plugin's agreement rule, as an :class:`Agreement`."""
    return Agreement(**selftest.compare_in_windows(expected, actual, ends, topk))


def device_of(args: Any) -> torch.device:
    """``--device``, else the GPU when there is one, else the CPU."""
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def with_once(logger: logging.Logger) -> logging.Logger:
    """``logger`` with the ``*_once`` methods the plugin calls (vLLM's logger has them; a stdlib one, where
    vLLM is absent, gets these: once per distinct text)."""
    seen: set[tuple[int, str]] = set()
    for name, level in (("debug", 10), ("info", 20), ("warning", 30), ("error", 40)):
        if callable(vars(logger).get(f"{name}_once")):
            continue

        def once(msg: str, *args: object, level: int = level, **_: object) -> None:
            text = msg % args if args else msg
            if (level, text) not in seen:
                seen.add((level, text))
                logger.log(level, "%s", text)

        setattr(logger, f"{name}_once", once)
    return logger


def plugin_logger() -> logging.Logger:
    """The plugin's logger: vLLM's where it imports, else the same name's stdlib logger."""
    from vllm_flydsl_indexer.envs import LOGGER_NAME, get_logger

    try:
        return get_logger()
    except Exception:  # noqa: BLE001 - no vLLM (check's fresh venv) or a broken one
        return with_once(logging.getLogger(LOGGER_NAME))


def quiet_logger() -> logging.Logger:
    """The routers' logger in the tools: their tables report what the routers would log."""
    logger = logging.getLogger("vllm_flydsl_indexer.tools.router")
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return with_once(logger)


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
    failure here is rare; what was measured is never lost to it. The path is a value the user gave:
    every line that names it is :func:`~vllm_flydsl_indexer.tools.streams.safe_line` (escaped,
    shortened); the file keeps its real name.
    """
    try:
        write_atomic(path, text, newline=newline)
    except OSError as e:
        print(safe_line(f"--- the {what} that could not be written to {path} ---"))
        print(f"{text.rstrip()}\n--- end ---")
        return False, safe_line(
            f"{tool}: could not write {what} to {path} ({e.strerror or e}); printed it above"
        )
    return True, safe_line(f"{tool}: wrote {what} to {os.path.abspath(path)}")
