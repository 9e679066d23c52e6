# SPDX-License-Identifier: Apache-2.0
"""vLLM plugin: route gfx950 sparse-indexer decode logits to aiter's FlyDSL kernel.

vLLM calls :func:`register` (entry point ``vllm.general_plugins: flydsl_indexer``) once in every process:
it evaluates the gates, installs the patch when all pass, and logs one line saying which arm is active and
why: DEBUG when the switch is off (nothing in vLLM changes), INFO when FlyDSL is active or vLLM routes to it
itself, WARNING when the switch is on and FlyDSL is not. It never raises.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

__version__ = "0.1.0"

_registered = False


def _register_environment_variables() -> None:
    """Tell vLLM's environment validation about the plugin's variables that are set, and leave them out
    of its torch.compile cache key (``compile_factors``): none of them changes a compiled graph."""
    from vllm_flydsl_indexer import envs

    vllm_envs = sys.modules.get("vllm.envs")
    table = getattr(vllm_envs, "environment_variables", None)
    if not isinstance(table, dict):
        return
    names = [name for name in envs.ALL_VARIABLES if name in os.environ and name not in table]
    table.update({name: envs.getter(name) for name in names})
    factors = getattr(vllm_envs, "compile_factors", None)
    if not names or not callable(factors) or getattr(factors, envs.OWN_GETTER, False):
        return

    @functools.wraps(factors)
    def compile_factors() -> dict[str, object]:
        hashed = factors()
        for name in (n for n in envs.ALL_VARIABLES if getattr(table.get(n), envs.OWN_GETTER, False)):
            hashed.pop(name, None)
        return hashed

    setattr(compile_factors, envs.OWN_GETTER, True)
    vllm_envs.compile_factors = compile_factors


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Cheap, idempotent, never raises."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_flydsl_indexer.envs import LOGGER_NAME, STOCK_LINE, get_logger

    # Never kill vLLM: whatever a probe raises (SystemExit too) leaves it as it was; only Ctrl-C goes on.
    logger, during = logging.getLogger(LOGGER_NAME), "vllm.logger unusable"  # until vLLM's logger is had
    try:
        logger, during = get_logger(), "unexpected error during registration"
        _register(logger)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - say so, go stock
        logger.warning("%s %s: %s: %s)", STOCK_LINE, during, type(e).__name__, e)


def _register(logger: logging.Logger) -> None:
    from vllm_flydsl_indexer import envs

    switch, error = envs.read_flag(envs.SWITCH)
    if not switch:
        # Off: import nothing more, change nothing, stay quiet; a malformed switch is a WARNING.
        level = logging.WARNING if error else logging.DEBUG
        logger.log(level, "%s %s)", envs.STOCK_LINE, envs.off_reason(envs.SWITCH))
        return
    from vllm_flydsl_indexer import gates

    decision = gates.evaluate()
    if decision.in_tree:  # vLLM declares the switch itself: it owns the variables and the call
        logger.info("%s", decision.log_line())
        return
    _register_environment_variables()
    if decision.active:
        from vllm_flydsl_indexer import patch, router, tuning

        variant, gfx, table, tune = decision.variant, tuning.arch_of(decision.gcn_arch or ""), None, None
        if not variant.own_table:
            table, decision.table = tuning.load(variant.name, gfx, logger)
            # Shapes no table covers: measured on this GPU, stock until then (no table chosen: FlyDSL).
            if (os.environ.get(envs.TUNED_CSV) or "").strip().lower() not in tuning.OFF_VALUES:
                tune, error = envs.read_flag(envs.TUNE, default=True)
                decision.warnings += [error] if error else []
        self_test, error = envs.read_flag(envs.SELFTEST, default=True)
        decision.warnings += [error] if error else []
        options = dict(table=table, self_test=self_test, tune=tune, gfx=gfx)
        patch.install(
            decision.target_module,
            lambda fn: router.FlyDSLRouter(fn, variant, decision.hooks, logger, **options),
        )
    line = decision.log_line() + (f" [{'; '.join(decision.warnings)}]" if decision.warnings else "")
    # The user asked for FlyDSL: not getting it, or with caveats, is a WARNING (shown below INFO logging).
    logger.log(logging.INFO if decision.active and not decision.warnings else logging.WARNING, "%s", line)
