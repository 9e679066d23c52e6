# SPDX-License-Identifier: Apache-2.0
"""Environment variables of the plugin, parsed once per process."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "ACCEPTED",
    "ALLOW_UNTESTED_VLLM",
    "ALL_VARIABLES",
    "Flag",
    "SELFTEST",
    "SWITCH",
    "TUNED_CSV",
    "VERIFY",
    "declared_by_vllm",
    "getter",
    "is_own_getter",
    "mark_own",
    "off_reason",
    "parse_bool",
    "read_flag",
    "read_self_test",
]

# The switch: route eligible decode-logits calls to aiter's FlyDSL kernel.
SWITCH = "VLLM_ROCM_USE_AITER_FLYDSL_PAGED_MQA_LOGITS"
# Let a vLLM newer than the tested window through the version gate. The
# target gate (signature and content) still applies.
ALLOW_UNTESTED_VLLM = "VLLM_FLYDSL_INDEXER_ALLOW_UNTESTED_VLLM"
# Canary: compare both arms on the live inputs at each configuration's first eligible call.
VERIFY = "VLLM_FLYDSL_INDEXER_VERIFY"
# Per-configuration self-test against stock on a small synthetic problem; on unless set to 0/false.
SELFTEST = "VLLM_FLYDSL_INDEXER_SELFTEST"

# An aiter-format tuned CSV that picks FlyDSL or stock per shape (see tuning.py).
TUNED_CSV = "VLLM_FLYDSL_INDEXER_TUNED_CSV"

ALL_VARIABLES = (SWITCH, ALLOW_UNTESTED_VLLM, VERIFY, SELFTEST, TUNED_CSV)
ACCEPTED = ("1", "0", "true", "false")

# Set on the getters this package adds to ``vllm.envs.environment_variables``, so a
# declaration of the switch by vLLM itself (an in-tree route) is told apart from ours.
_OWN_GETTER = "_vllm_flydsl_indexer_getter"
_F = TypeVar("_F", bound=Callable)

_TRUE = {"1", "true"}
_FALSE = {"0", "false"}


def parse_bool(text: str) -> bool | None:
    """``1``/``true`` -> True, ``0``/``false`` -> False (case-insensitive, trimmed), else ``None``."""
    value = text.strip().lower()
    return True if value in _TRUE else False if value in _FALSE else None


@dataclass(frozen=True)
class Flag:
    """A parsed boolean variable: its value and, if it did not parse, why."""

    name: str
    raw: str | None
    enabled: bool
    error: str | None = None


def read_flag(name: str, environ: dict[str, str] | None = None, default: bool = False) -> Flag:
    """Parse ``name`` as ``1``/``0``/``true``/``false`` (case-insensitive).

    Unset or empty is ``default``. Any other value is ``default``, with an
    error that names the variable and the accepted values.
    """
    env = os.environ if environ is None else environ
    raw = env.get(name)
    value = parse_bool(raw) if raw and raw.strip() else default
    if value is not None:
        return Flag(name, raw, value)
    return Flag(
        name,
        raw,
        default,
        f"{name}={raw!r} is not one of {'/'.join(ACCEPTED)} (case-insensitive); "
        f"treating it as {int(default)}",
    )


def read_self_test(environ: dict[str, str] | None = None) -> Flag:
    """:data:`SELFTEST`: on unless set to ``0``/``false``."""
    return read_flag(SELFTEST, environ, default=True)


def off_reason(flag: Flag) -> str:
    """Why ``flag`` is off, naming the values that turn it on (the switch's gate-1 text)."""
    if flag.error:
        return flag.error
    if not (flag.raw or "").strip():
        return f"{flag.name} is not set (1/true enables it)"
    return f"{flag.name}={flag.raw.strip()} (off; 1/true enables it)"


def getter(name: str) -> Callable[[], str | None]:
    """The getter this package registers for ``name`` in ``vllm.envs.environment_variables``."""

    def read() -> str | None:
        return os.environ.get(name)

    return mark_own(read)


def mark_own(fn: _F) -> _F:
    """Mark ``fn`` as this package's addition to ``vllm.envs``."""
    setattr(fn, _OWN_GETTER, True)
    return fn


def is_own_getter(fn: object) -> bool:
    """Whether ``fn`` is a getter made by :func:`getter`."""
    return bool(getattr(fn, _OWN_GETTER, False))


def declared_by_vllm(table: object, name: str = SWITCH) -> bool:
    """Whether vLLM's own ``environment_variables`` table declares ``name`` (not through this package)."""
    return isinstance(table, dict) and name in table and not is_own_getter(table[name])
