# SPDX-License-Identifier: Apache-2.0
"""The two wings: the plugin that vLLM loads never imports the tools around it."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_flydsl_indexer

PACKAGE = Path(vllm_flydsl_indexer.__file__).parent
# The CLI's ``python -m`` entry lives in the package root but register() never imports it.
ENTRY = "__main__.py"
# 17 plugin modules and __main__: issue 25 added rules.py (every rule in one module) and
# identification.py (startup probing apart from the contract); issue 31 files.py (the one file
# layer: register() reads the tuned table through it, and the plugin never imports the tools);
# issue 32 selftest.py (each configuration's self-test: its synthetic problem and both arms,
# apart from the router); issue 37 content.py (vLLM's target held to its audited content, read from
# its AST once at start-up, apart from the stock hooks that mirror it).
MAX_PLUGIN_MODULES = 18


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_plugin_module_imports_the_tools():
    plugin = [p for p in sorted(PACKAGE.glob("*.py")) if p.name != ENTRY]
    assert plugin and len(plugin) + 1 <= MAX_PLUGIN_MODULES, [p.name for p in plugin]
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
