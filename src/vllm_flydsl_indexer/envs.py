# SPDX-License-Identifier: Apache-2.0
"""The plugin's environment variables, read once per process, and the log lines an operator greps for."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

# The switch: route eligible decode-logits calls to aiter's FlyDSL kernel.
SWITCH = "VLLM_ROCM_USE_AITER_FLYDSL_PAGED_MQA_LOGITS"
# The per-shape self-test against stock; on unless set to 0/false.
SELFTEST = "VLLM_FLYDSL_INDEXER_SELFTEST"
# An aiter-format tuned CSV that picks FlyDSL or stock per shape (tuning.py).
TUNED_CSV = "VLLM_FLYDSL_INDEXER_TUNED_CSV"
# Time shapes no table covers on this GPU at their first eager call (measure.py); on unless 0/false.
TUNE = "VLLM_FLYDSL_INDEXER_TUNE"
ALL_VARIABLES = (SWITCH, SELFTEST, TUNED_CSV, TUNE)
ACCEPTED = ("1", "0", "true", "false")

# Under the "vllm" logger, so vLLM's handler, format and VLLM_LOGGING_LEVEL apply.
LOGGER_NAME = "vllm.plugins.flydsl_indexer"
# The heads of the lines an operator greps for (examples/_common.sh greps the same text).
HEAD = "vllm-flydsl-indexer:"
ACTIVE_LINE = f"{HEAD} FlyDSL paged MQA logits ACTIVE"
STOCK_LINE = f"{HEAD} stock paged MQA logits (FlyDSL inactive:"
STOCK_CALL_LINE = f"{HEAD} stock path for this call:"
IN_TREE_LINE = f"{HEAD} vLLM routes the paged MQA logits itself"
TABLE_IGNORED_LINE = f"{HEAD} tuned table ignored:"

# Set on the getters this package adds to ``vllm.envs.environment_variables``; any other is vLLM's (in-tree).
OWN_GETTER = "_vllm_flydsl_indexer_getter"


def cache_root(environ: dict[str, str] | None = None) -> Path:
    """vLLM's cache root, as ``vllm.envs.VLLM_CACHE_ROOT`` reads a non-empty value (no vLLM import).

    Not quite as vLLM reads it: an empty ``VLLM_CACHE_ROOT`` or ``XDG_CACHE_HOME`` counts as unset here
    (vLLM reads an empty root as the current directory, so its cache lands wherever a process starts), and
    a ``~user`` of no such user raises ``RuntimeError`` here (``Path.expanduser``) where vLLM keeps the text.
    """
    env = os.environ if environ is None else environ
    default = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"
    return Path(env.get("VLLM_CACHE_ROOT") or default).expanduser()


def parse_bool(text: str) -> bool | None:
    """``1``/``true`` -> True, ``0``/``false`` -> False (case-insensitive, trimmed), else ``None``."""
    value = text.strip().lower()
    return True if value in ("1", "true") else False if value in ("0", "false") else None


def read_flag(
    name: str, environ: dict[str, str] | None = None, default: bool = False
) -> tuple[bool, str | None]:
    """``name`` as ``1``/``0``/``true``/``false``: ``(value, None)``; unset or empty is ``default``; anything
    else is ``(default, why)``, naming the variable and the accepted values."""
    raw = (os.environ if environ is None else environ).get(name)
    value = parse_bool(raw) if raw and raw.strip() else default
    if value is not None:
        return value, None
    why = f"{name}={raw!r} is not one of {'/'.join(ACCEPTED)} (any case); treating it as {int(default)}"
    return default, why


def off_reason(name: str, environ: dict[str, str] | None = None) -> str:
    """Why the boolean ``name`` is off, naming the values that turn it on (the switch gate's words)."""
    raw = ((os.environ if environ is None else environ).get(name) or "").strip()
    if error := read_flag(name, environ)[1]:
        return error
    return f"{name}={raw} (off; 1/true enables it)" if raw else f"{name} is not set (1/true enables it)"


def getter(name: str) -> Callable[[], str | None]:
    """The getter this package registers for ``name`` in ``vllm.envs.environment_variables``."""
    fn = lambda: os.environ.get(name)  # noqa: E731 - vLLM's own table is of lambdas
    setattr(fn, OWN_GETTER, True)
    return fn


def get_logger() -> logging.Logger:
    """vLLM's logger for the plugin; ``register()`` catches what importing ``vllm.logger`` raises."""
    from vllm.logger import init_logger

    return init_logger(LOGGER_NAME)
