# SPDX-License-Identifier: Apache-2.0
"""The two wings: the plugin that vLLM loads never imports the tools around it."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_flydsl_indexer

PACKAGE = Path(vllm_flydsl_indexer.__file__).parent
# The CLI's ``python -m`` entry lives in the package root but register() never imports it.
ENTRY = "__main__.py"
# Issue 38: one module per seam (docs/design.md). 17 modules became 10, and issue 43 moved files.py to the
# tools (the runtime's one read is target.read_capped): what vLLM is (target: the target, its fingerprint,
# its objects and its callers), what aiter has (kernels: identification and contracts), the route
# (router: one objection and the memo), the self-test (selftest: with the agreement rule), the measured
# table (tuning), and start-up (__init__, envs with the log lines, gates, patch). What only the tools use
# is in tools/.
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
            continue  # tune re-checks its --out file with the parser's own check before it merges
        names = imported_modules(path)
        assert "vllm_flydsl_indexer.tools.cli_args" not in names, path.name
        assert "vllm_flydsl_indexer.tools.cli_args" not in {n.rsplit(".", 1)[0] for n in names}, path.name


def star_imports() -> set[str]:
    """Every module some file of the project imports with ``*``."""
    root = PACKAGE.parents[1]
    found = set()
    for path in [*root.glob("src/**/*.py"), *root.glob("tests/**/*.py"), *root.glob("benchmarks/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
                found.add(node.module)
    return found


def test_the_tools_mark_their_public_names_and_the_runtime_does_not():
    """Each tools module says what it offers (``__all__``), and every name it lists exists. The runtime has
    no ``__all__`` except where a module is imported with ``*`` (issue 43: 46 lines of them went)."""
    import importlib

    for path in sorted((PACKAGE / "tools").glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"vllm_flydsl_indexer.tools.{path.stem}")
        assert isinstance(getattr(module, "__all__", None), list), f"tools/{path.name} has no __all__"
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"tools/{path.name} lists {missing}"
    starred = star_imports()
    for path in plugin_modules():
        name = "vllm_flydsl_indexer" + ("" if path.stem == "__init__" else f".{path.stem}")
        assigned = {
            getattr(target, "id", None)
            for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for target in getattr(node, "targets", [getattr(node, "target", None)])
        }
        assert "__all__" not in assigned or name in starred, (
            f"{path.name} has an __all__; nothing imports it with *"
        )


# The runtime wing's size, counted as the before-stop hook counts it: the modules directly under the
# package but __main__.py; code lines only (a line that is not blank, not a comment and not inside a module,
# class or function docstring), so docstrings and comments are never squeezed to fit; every class statement
# (ast.ClassDef). Issue 49 pins code lines instead of all lines and asked for at most 1,500. Issue 44 left
# 1,450; issue 49's measurement as serving runs it, its one bounded agreement, the node cache keyed on the
# whole stack and the callers' fingerprints, issue 51's hot path and issue 49 item 4's sweep came to 1,600.
# The sixth session reached the ask by dropping concepts, not squeezing: aiter's _gfx950 entry as a second
# measured candidate (-60: two unreleased aiter revisions; later aiter aliases the name), the per-signature
# scope of a kernel's argument errors (-13), the opt-in for unaudited vLLM (-10: the mission keeps unaudited
# code stock), the signature check the fingerprint already covers (-9), and small merges. 10 modules,
# 7 classes.
ISSUE_49_ASK = {"modules": 10, "code_lines": 1500, "classes": 8}
MAX_PLUGIN_CODE_LINES = 1500
MAX_PLUGIN_CLASSES = 7


def code_lines(text: str) -> int:
    """Lines that are not blank, not a comment and not inside a module, class or function docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        body = getattr(node, "body", None) if isinstance(node, kinds) else None
        first = body[0] if body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def wing_size() -> dict[str, int]:
    modules = plugin_modules()
    texts = [path.read_text() for path in modules]
    return {
        "modules": len(modules),
        "code_lines": sum(map(code_lines, texts)),
        "classes": sum(isinstance(n, ast.ClassDef) for text in texts for n in ast.walk(ast.parse(text))),
    }


def test_code_lines_leave_out_docstrings_comments_and_blanks():
    text = 'def f():\n    """Doc\n    more."""\n\n    # a comment\n    return 1  # kept\n'
    assert code_lines(text) == 2  # the def and the return
    assert code_lines('"""Module doc."""\nx = "not a docstring"\n') == 1


def test_the_runtime_wing_stays_small():
    size = wing_size()
    assert size["modules"] <= MAX_PLUGIN_MODULES == ISSUE_49_ASK["modules"], size
    assert size["code_lines"] <= MAX_PLUGIN_CODE_LINES == ISSUE_49_ASK["code_lines"], size
    assert size["classes"] <= MAX_PLUGIN_CLASSES <= ISSUE_49_ASK["classes"], size


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
