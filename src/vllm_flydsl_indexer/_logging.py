# SPDX-License-Identifier: Apache-2.0
"""Logger that is vLLM's when vLLM is importable, plus once-only helpers."""

from __future__ import annotations

import logging

__all__ = [
    "ACTIVE_LINE",
    "DISAGREE_LINE",
    "HEAD",
    "IN_TREE_LINE",
    "LOGGER_NAME",
    "MODEL_STOCK_LINE",
    "STOCK_CALL_LINE",
    "STOCK_LINE",
    "TABLE_IGNORED_LINE",
    "get_logger",
    "log_once",
]

# Under the "vllm" logger so vLLM's handler, format and VLLM_LOGGING_LEVEL apply.
LOGGER_NAME = "vllm.plugins.flydsl_indexer"

# The heads of the lines an operator greps for; examples/_common.sh greps the
# same text and tests/test_examples.py holds it to these.
HEAD = "vllm-flydsl-indexer:"
ACTIVE_LINE = f"{HEAD} FlyDSL paged MQA logits ACTIVE"
STOCK_LINE = f"{HEAD} stock paged MQA logits (FlyDSL inactive:"
STOCK_CALL_LINE = f"{HEAD} stock path for this call:"
IN_TREE_LINE = f"{HEAD} vLLM routes the paged MQA logits itself"
MODEL_STOCK_LINE = f"{HEAD} FlyDSL never runs for this model:"
TABLE_IGNORED_LINE = f"{HEAD} tuned table ignored:"
DISAGREE_LINE = "paged MQA logits DISAGREE"

# vLLM's logger methods that log a text once per process, by level (vllm/logger.py).
_VLLM_ONCE = {
    logging.DEBUG: "debug_once",
    logging.INFO: "info_once",
    logging.WARNING: "warning_once",
    logging.ERROR: "error_once",
}
# What log_once has logged, where the logger is not vLLM's.
_seen: set[tuple[int, str]] = set()


def get_logger() -> logging.Logger:
    """``vllm.logger.init_logger`` when vLLM is installed, else stdlib."""
    try:
        from vllm.logger import init_logger
    except ImportError:
        return logging.getLogger(LOGGER_NAME)
    return init_logger(LOGGER_NAME)


def log_once(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """Log ``msg % args`` once per process for each distinct formatted text.

    vLLM's ``*_once`` methods (``scope="process"``) where the logger is vLLM's, else a set here.
    vLLM sets them on each logger it makes (``init_logger``); the class attribute of the same name
    that transformers adds to ``logging.Logger`` takes other arguments, so only the instance's counts.
    """
    text = msg % args if args else msg
    once = vars(logger).get(_VLLM_ONCE.get(level, ""))
    if callable(once):
        once("%s", text, scope="process")
        return
    key = (level, text)
    if key in _seen:
        return
    _seen.add(key)
    logger.log(level, "%s", text)
