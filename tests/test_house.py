# SPDX-License-Identifier: Apache-2.0
"""The two wings: the plugin that vLLM loads never imports the tools around it."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_flydsl_indexer

PACKAGE = Path(vllm_flydsl_indexer.__file__).parent
# The CLI's ``python -m`` entry lives in the package root but register() never imports it.
ENTRY = "__main__.py"
MAX_PLUGIN_MODULES = 13


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
