# SPDX-License-Identifier: Apache-2.0
"""vLLM plugin: route gfx950 sparse-indexer decode logits to aiter's FlyDSL kernel.

vLLM calls :func:`register` (entry point ``vllm.general_plugins: flydsl_indexer``) once in every
process. It evaluates the gates (:mod:`~vllm_flydsl_indexer.gates`), installs the patch
(:mod:`~vllm_flydsl_indexer.patch`) when all pass, and logs one line saying which arm is active and
why: DEBUG when the switch is off (then nothing in vLLM changes), INFO when FlyDSL is active or vLLM
routes to it itself, WARNING when the switch is on and FlyDSL is not. It never raises.
"""

from __future__ import annotations

import logging

__all__ = ["register"]

__version__ = "0.1.0"

_registered = False


def _register_environment_variables() -> None:
    """Tell vLLM's environment validation about the plugin's variables that are set, and only those.

    vLLM hashes every registered variable into its torch.compile cache key (``compile_factors``). None
    of the plugin's can change a compiled graph (the indexer op is opaque to Dynamo), so
    ``compile_factors`` is wrapped to leave them out, as vLLM's own ``ignored_factors``.
    """
    import functools
    import os
    import sys

    from vllm_flydsl_indexer import envs

    vllm_envs = sys.modules.get("vllm.envs")
    table = getattr(vllm_envs, "environment_variables", None)
    if not isinstance(table, dict):
        return
    names = [name for name in envs.ALL_VARIABLES if name in os.environ and name not in table]
    for name in names:
        table[name] = envs.getter(name)
    factors = getattr(vllm_envs, "compile_factors", None)
    if not names or not callable(factors) or envs.is_own_getter(factors):
        return

    @functools.wraps(factors)
    def compile_factors() -> dict[str, object]:
        hashed = factors()
        for name in envs.ALL_VARIABLES:
            if envs.is_own_getter(table.get(name)):
                hashed.pop(name, None)
        return hashed

    vllm_envs.compile_factors = envs.mark_own(compile_factors)


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Cheap, idempotent, never raises."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_flydsl_indexer.envs import STOCK_LINE, get_logger

    logger = get_logger()
    try:
        _register(logger)
    except Exception as e:  # noqa: BLE001 - a plugin must never kill vLLM
        logger.warning("%s unexpected %s during registration: %s)", STOCK_LINE, type(e).__name__, e)


def _register(logger: logging.Logger) -> None:
    from vllm_flydsl_indexer import envs
    from vllm_flydsl_indexer.envs import STOCK_LINE

    switch = envs.read_flag(envs.SWITCH)
    if not switch.enabled:
        # Off: import nothing more, change nothing in vLLM, and stay quiet (vLLM's
        # loader already lists the plugins it loads); a malformed switch is a WARNING.
        reason = envs.off_reason(switch)
        level = logging.WARNING if switch.error else logging.DEBUG
        logger.log(level, "%s %s)", STOCK_LINE, reason)
        return

    from vllm_flydsl_indexer import gates

    decision = gates.evaluate()
    if decision.in_tree:
        # vLLM declares the switch or routes to FlyDSL itself: it owns the variables and the call.
        logger.info("%s", decision.log_line())
        return
    _register_environment_variables()
    if decision.active:
        from vllm_flydsl_indexer import patch, selftest

        verifier = selftest.make_verifier() if decision.verify else None
        assert decision.target_module is not None and decision.variant is not None
        table = None
        if not decision.variant.own_table:
            from vllm_flydsl_indexer import tuning

            source = tuning.env_source(decision.variant.name)
            table = tuning.load_source(source, tuning.arch_of(decision.gcn_arch or ""), logger)
            decision.table = tuning.in_use(source, table)
        self_test = envs.read_self_test()
        if self_test.error:
            decision.warnings.append(self_test.error)
        patch.install(
            decision.target_module,
            decision.variant,
            logger,
            verifier,
            table,
            self_test.enabled,
            decision.hooks,
        )
    line = decision.log_line()
    if decision.warnings:
        line = f"{line} [{'; '.join(decision.warnings)}]"
    # The user asked for FlyDSL: not getting it (or getting it with caveats) is a
    # WARNING, so it shows even where vLLM has not configured logging at INFO.
    level = logging.INFO if decision.active and not decision.warnings else logging.WARNING
    logger.log(level, "%s", line)
