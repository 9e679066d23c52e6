# SPDX-License-Identifier: Apache-2.0
"""The two wings: the plugin that vLLM loads never imports the tools around it."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_flydsl_indexer

PACKAGE = Path(vllm_flydsl_indexer.__file__).parent
# The CLI's ``python -m`` entry lives in the package root but register() never imports it.
ENTRY = "__main__.py"
# Issue 38: one module per seam (docs/design.md). 17 modules became 10: what vLLM is (target: the
# target, its content, its objects and its callers), what aiter has (kernels: identification and
# contracts), the route (router: rules and memo), the self-test (selftest: with the agreement rule),
# the measured table (tuning), and start-up (__init__, envs with the log lines, gates, patch), plus
# files, the one reader. What only the tools use went to tools/.
MAX_PLUGIN_MODULES = 10


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def plugin_modules() -> list[Path]:
    """The runtime wing: every module directly under the package but the CLI's entry."""
    return [p for p in sorted(PACKAGE.glob("*.py")) if p.name != ENTRY]


def test_no_plugin_module_imports_the_tools():
    plugin = plugin_modules()
    assert plugin and len(plugin) <= MAX_PLUGIN_MODULES, [p.name for p in plugin]
    for path in plugin:
        tools = {m for m in imported_modules(path) if m.startswith("vllm_flydsl_indexer.tools")}
        assert not tools, f"{path.name} imports the tools wing: {sorted(tools)}"


def test_the_tools_are_a_subpackage_and_the_entry_points_reach_them():
    assert (PACKAGE / "tools" / "__init__.py").is_file()
    assert "vllm_flydsl_indexer.tools.cli" in imported_modules(PACKAGE / ENTRY)


COMMANDS = ("doctor", "check", "bench", "tune")


def test_the_commands_are_siblings():
    """doctor, check, bench and tune share the harness and the settings, never each other."""
    for name in COMMANDS:
        imported = imported_modules(PACKAGE / "tools" / f"{name}.py")
        others = {f"vllm_flydsl_indexer.tools.{other}" for other in COMMANDS if other != name}
        assert not imported & others, f"tools/{name}.py imports {sorted(imported & others)}"


def test_the_argument_module_is_imported_by_the_cli_alone():
    """cli_args parses and validates; the settings the tools run with live in settings.py."""
    for path in sorted((PACKAGE / "tools").glob("*.py")):
        if path.name in ("cli.py", "cli_args.py", "tune.py"):
            continue  # tune re-checks its --tune file with the parser's own check before it merges
        names = imported_modules(path)
        assert "vllm_flydsl_indexer.tools.cli_args" not in names, path.name
        assert "vllm_flydsl_indexer.tools.cli_args" not in {n.rsplit(".", 1)[0] for n in names}, path.name


def test_every_module_marks_its_public_names():
    """Each module says what it offers (``__all__``), and every name it lists exists."""
    import importlib

    for path in sorted([*PACKAGE.glob("*.py"), *(PACKAGE / "tools").glob("*.py")]):
        if path.name in (ENTRY, "__init__.py") and path.parent.name == "tools":
            continue
        if path.name == ENTRY:
            continue
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(relative.parts).removesuffix(".__init__")
        module = importlib.import_module(name)
        assert isinstance(getattr(module, "__all__", None), list), f"{path.name} has no __all__"
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"{path.name} lists {missing}"


# The runtime wing's size, every line counted (blank, comment and docstring lines too), and its
# classes (a ``class`` statement each), pinned where issue 38 left them: 10 modules, 3,099 lines and
# 23 classes, from 17, 4,224 and 28. Its ask, 2,000 lines and 12 classes, is not met: the code alone
# (no docstring, comment or blank line) is 2,172 lines, and each class left is a record some test
# reads by name (docs/design.md, "The size of the runtime wing"). Lower these as the wing shrinks.
MAX_PLUGIN_LINES = 3099
MAX_PLUGIN_CLASSES = 23


def test_the_runtime_wing_stays_small():
    lines = classes = 0
    for path in plugin_modules():
        text = path.read_text()
        lines += len(text.splitlines())
        classes += sum(isinstance(n, ast.ClassDef) for n in ast.walk(ast.parse(text)))
    assert lines <= MAX_PLUGIN_LINES, f"the runtime wing is {lines} lines"
    assert classes <= MAX_PLUGIN_CLASSES, f"the runtime wing has {classes} classes"


# A taken call, from the patched function to the kernel launch: the patch's wrapper, the router, and
# vLLM's objects that the hooks hold (target.py). Nothing else of the plugin runs per call.
TAKEN_PATH = {"patch.py", "router.py", "target.py"}


def test_a_taken_call_runs_through_three_plugin_modules(target, workspace, installed, aiter_calls):
    import importlib
    import sys

    import torch

    from vllm_flydsl_indexer.target import TARGET_MODULE
    from vllm_flydsl_indexer.tools.paths import call_site_in
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    p = make_paged_problem(
        [70, 130, 3],
        next_n=1,
        heads=32,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        generator=torch.Generator().manual_seed(38),
    )
    args = (p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, p.max_model_len)
    call = call_site_in(importlib.import_module(TARGET_MODULE))
    call(target.rocm_fp8_paged_mqa_logits, args, {})  # the shape's first call: its self-test, then FlyDSL
    taken = installed.router.calls_taken
    assert taken == 1, installed.router.failed
    seen: set[str] = set()

    def profile(frame, event, arg):  # the plugin's modules only: the kernel double runs tools.reference
        if event == "call" and Path(frame.f_code.co_filename).parent == PACKAGE:
            seen.add(Path(frame.f_code.co_filename).name)

    aiter_calls.clear()
    sys.setprofile(profile)
    try:
        call(target.rocm_fp8_paged_mqa_logits, args, {})
    finally:
        sys.setprofile(None)
    assert installed.router.calls_taken == taken + 1 and [a for a, _ in aiter_calls] == ["flydsl"]
    assert seen == TAKEN_PATH, sorted(seen)
