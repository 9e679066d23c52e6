# SPDX-License-Identifier: Apache-2.0
"""vLLM plugin: route gfx950 sparse-indexer decode logits to aiter's FlyDSL kernel.

vLLM calls :func:`register` (entry point ``vllm.general_plugins:
flydsl_indexer``) once in every process. It evaluates the gates in
:mod:`vllm_flydsl_indexer.gates`, installs the patch of
:mod:`vllm_flydsl_indexer.patch` when all pass, and logs one line saying which
arm is active and why: INFO when the switch is off or FlyDSL is active,
WARNING when the switch is on and FlyDSL is not (the user asked for it). It
never raises: any failure leaves vLLM as it was.
"""

from __future__ import annotations

import logging

__all__ = ["register"]

__version__ = "0.1.0"

_registered = False


def _register_environment_variables() -> None:
    """Make vLLM's environment validation know the plugin's variables."""
    import os
    import sys

    from vllm_flydsl_indexer import envs

    vllm_envs = sys.modules.get("vllm.envs")
    if vllm_envs is None:
        return
    table = getattr(vllm_envs, "environment_variables", None)
    if not isinstance(table, dict):
        return
    for name in envs.ALL_VARIABLES:
        table.setdefault(name, lambda name=name: os.environ.get(name))


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Cheap, idempotent, never raises."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_flydsl_indexer._logging import STOCK_LINE, get_logger

    logger = get_logger()
    try:
        _register_environment_variables()
        _register(logger)
    except Exception as e:  # noqa: BLE001 - a plugin must never kill vLLM
        logger.warning(
            "%s unexpected %s during registration: %s)",
            STOCK_LINE,
            type(e).__name__,
            e,
        )


def _register(logger: logging.Logger) -> None:
    from vllm_flydsl_indexer import envs
    from vllm_flydsl_indexer._logging import STOCK_LINE

    switch = envs.read_flag(envs.SWITCH)
    if not switch.enabled:
        # Off: import nothing more and patch nothing.
        reason = envs.off_reason(switch)
        level = logging.WARNING if switch.error else logging.INFO
        logger.log(level, "%s %s)", STOCK_LINE, reason)
        return

    from vllm_flydsl_indexer import gates

    decision = gates.evaluate()
    if decision.active:
        from vllm_flydsl_indexer import patch

        verifier = None
        if decision.verify:
            from vllm_flydsl_indexer.agreement import make_verifier

            verifier = make_verifier()
        assert decision.target_module is not None and decision.variant is not None
        table = None
        if not decision.variant.own_table:
            from vllm_flydsl_indexer import tuning

            table = tuning.load(tuning.env_source(), tuning.arch_of(decision.gcn_arch or ""), logger)
        self_test = envs.read_self_test()
        if self_test.error:
            decision.warnings.append(self_test.error)
        patch.install(decision.target_module, decision.variant, logger, verifier, table, self_test.enabled)
    line = decision.log_line()
    if decision.warnings:
        line = f"{line} [{'; '.join(decision.warnings)}]"
    # The user asked for FlyDSL: not getting it (or getting it with caveats) is a
    # WARNING, so it shows even where vLLM has not configured logging at INFO.
    level = logging.INFO if decision.active and not decision.warnings else logging.WARNING
    logger.log(level, "%s", line)
