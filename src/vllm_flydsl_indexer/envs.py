# SPDX-License-Identifier: Apache-2.0
"""The plugin's environment variables, parsed once per process, and the log lines an operator greps for."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "ACCEPTED", "ACTIVE_LINE", "ALLOW_UNTESTED_VLLM", "ALL_VARIABLES", "DISAGREE_LINE", "Flag", "HEAD",
    "IN_TREE_LINE", "LOGGER_NAME", "MODEL_STOCK_LINE", "SELFTEST", "STOCK_CALL_LINE", "STOCK_LINE", "SWITCH",
    "TABLE_IGNORED_LINE", "TUNED_CSV", "VERIFY", "declared_by_vllm", "get_logger", "getter", "is_own_getter",
    "log_once", "mark_own", "off_reason", "parse_bool", "read_flag", "read_self_test",
]  # fmt: skip

# The switch: route eligible decode-logits calls to aiter's FlyDSL kernel.
SWITCH = "VLLM_ROCM_USE_AITER_FLYDSL_PAGED_MQA_LOGITS"
# Let a vLLM newer than the tested window through the version gate (the target gate still applies).
ALLOW_UNTESTED_VLLM = "VLLM_FLYDSL_INDEXER_ALLOW_UNTESTED_VLLM"
# The canary: both arms on the live inputs at each configuration's first eligible call.
VERIFY = "VLLM_FLYDSL_INDEXER_VERIFY"
# The per-shape self-test against stock; on unless set to 0/false.
SELFTEST = "VLLM_FLYDSL_INDEXER_SELFTEST"
# An aiter-format tuned CSV that picks FlyDSL or stock per shape (tuning.py).
TUNED_CSV = "VLLM_FLYDSL_INDEXER_TUNED_CSV"
ALL_VARIABLES = (SWITCH, ALLOW_UNTESTED_VLLM, VERIFY, SELFTEST, TUNED_CSV)
ACCEPTED = ("1", "0", "true", "false")

# Under the "vllm" logger, so vLLM's handler, format and VLLM_LOGGING_LEVEL apply.
LOGGER_NAME = "vllm.plugins.flydsl_indexer"
# The heads of the lines an operator greps for (examples/_common.sh greps the same text).
HEAD = "vllm-flydsl-indexer:"
ACTIVE_LINE = f"{HEAD} FlyDSL paged MQA logits ACTIVE"
STOCK_LINE = f"{HEAD} stock paged MQA logits (FlyDSL inactive:"
STOCK_CALL_LINE = f"{HEAD} stock path for this call:"
IN_TREE_LINE = f"{HEAD} vLLM routes the paged MQA logits itself"
MODEL_STOCK_LINE = f"{HEAD} FlyDSL never runs for this model:"
TABLE_IGNORED_LINE = f"{HEAD} tuned table ignored:"
DISAGREE_LINE = "paged MQA logits DISAGREE"

# Set on the getters this package adds to ``vllm.envs.environment_variables``, so a declaration
# of the switch by vLLM itself (an in-tree route) is told apart from ours.
_OWN_GETTER = "_vllm_flydsl_indexer_getter"
_F = TypeVar("_F", bound=Callable)


def parse_bool(text: str) -> bool | None:
    """``1``/``true`` -> True, ``0``/``false`` -> False (case-insensitive, trimmed), else ``None``."""
    value = text.strip().lower()
    return True if value in ("1", "true") else False if value in ("0", "false") else None


@dataclass(frozen=True)
class Flag:
    """A parsed boolean variable: its value and, if it did not parse, why."""

    name: str
    raw: str | None
    enabled: bool
    error: str | None = None


def read_flag(name: str, environ: dict[str, str] | None = None, default: bool = False) -> Flag:
    """``name`` as ``1``/``0``/``true``/``false``; unset or empty is ``default``, anything else is
    ``default`` with an error naming the variable and the accepted values."""
    raw = (os.environ if environ is None else environ).get(name)
    value = parse_bool(raw) if raw and raw.strip() else default
    if value is not None:
        return Flag(name, raw, value)
    error = (
        f"{name}={raw!r} is not one of {'/'.join(ACCEPTED)} (case-insensitive); treating it as {int(default)}"
    )
    return Flag(name, raw, default, error)


def read_self_test(environ: dict[str, str] | None = None) -> Flag:
    """:data:`SELFTEST`: on unless set to ``0``/``false``."""
    return read_flag(SELFTEST, environ, default=True)


def off_reason(flag: Flag) -> str:
    """Why ``flag`` is off, naming the values that turn it on (the switch gate's words)."""
    if flag.error:
        return flag.error
    if not (flag.raw or "").strip():
        return f"{flag.name} is not set (1/true enables it)"
    return f"{flag.name}={flag.raw.strip()} (off; 1/true enables it)"


def getter(name: str) -> Callable[[], str | None]:
    """The getter this package registers for ``name`` in ``vllm.envs.environment_variables``."""
    return mark_own(lambda: os.environ.get(name))


def mark_own(fn: _F) -> _F:
    """Mark ``fn`` as this package's addition to ``vllm.envs``."""
    setattr(fn, _OWN_GETTER, True)
    return fn


def is_own_getter(fn: object) -> bool:
    return bool(getattr(fn, _OWN_GETTER, False))


def declared_by_vllm(table: object, name: str = SWITCH) -> bool:
    """Whether vLLM's own ``environment_variables`` declares ``name`` (not through this package)."""
    return isinstance(table, dict) and name in table and not is_own_getter(table[name])


def get_logger() -> logging.Logger:
    """``vllm.logger.init_logger`` when vLLM is installed, else stdlib."""
    try:
        from vllm.logger import init_logger
    except ImportError:
        return logging.getLogger(LOGGER_NAME)
    return init_logger(LOGGER_NAME)


# vLLM's logger methods that log a text once per process, by level (vllm/logger.py).
_VLLM_ONCE = {
    logging.DEBUG: "debug_once",
    logging.INFO: "info_once",
    logging.WARNING: "warning_once",
    logging.ERROR: "error_once",
}
_seen: set[tuple[int, str]] = set()  # what log_once logged, where the logger is not vLLM's


def log_once(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """Log ``msg % args`` once per process per distinct text: vLLM's ``*_once`` (``scope="process"``)
    where the logger is vLLM's, else a set here. Only the instance's method counts: transformers adds
    a class attribute of that name to ``logging.Logger`` that takes other arguments."""
    text = msg % args if args else msg
    once = vars(logger).get(_VLLM_ONCE.get(level, ""))
    if callable(once):
        once("%s", text, scope="process")
    elif (level, text) not in _seen:
        _seen.add((level, text))
        logger.log(level, "%s", text)
