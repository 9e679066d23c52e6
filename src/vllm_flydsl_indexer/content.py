# SPDX-License-Identifier: Apache-2.0
"""What vLLM's ``rocm_fp8_paged_mqa_logits`` must do for the router to answer for it, read from its AST.

The router takes only the calls the original would send to aiter's gfx950 Gluon kernel, and launches
FlyDSL with what the original passes Gluon (:mod:`vllm_flydsl_indexer.stock` asks vLLM the same
questions). So, before the patch goes in, the target gate reads the original's source and holds it to
what this package audited:

* the C4A guard that sends compress ratio 4 to vLLM's own Triton route;
* the aiter lookup (aiter enabled, then ``paged_mqa_logits_module()``) and the branch test that
  reaches the Gluon call;
* that call's arguments: the per-sequence lengths, the workspace buffer it writes and returns,
  ``Preshuffle``, and the knobs (``ChunkK``, ``KVBlockSize``, ``WavePerEU``).

Anything missing or different is one problem, in words, and vLLM stays stock. The two forms that
differ between releases are pinned per release in :data:`RELEASES`; the check accepts any audited
form of each, and ``tests/test_drift.py`` holds each installed release to its own. No torch here.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

from vllm_flydsl_indexer import files
from vllm_flydsl_indexer.target import TARGET_NAME

__all__ = [
    "AITER_LOOKUP",
    "AITER_ON",
    "Audited",
    "BLOCK_SIZE",
    "C4A_GUARD",
    "ContentDrift",
    "GLUON",
    "GLUON_ARGS",
    "GLUON_KNOBS",
    "GLUON_MODULE_FOUND",
    "MAX_SOURCE_BYTES",
    "OUTPUT",
    "PRESHUFFLE_BY_LAYOUT",
    "PRESHUFFLE_BY_SIZE",
    "RELEASES",
    "audit",
    "calls_flydsl",
    "function_node",
]

# vLLM's target module is about 100 kB; the cap keeps a FIFO or a runaway file out of start-up.
MAX_SOURCE_BYTES = 4 * 2**20
# Every expression below is written as ``ast.unparse`` writes it.
GLUON = "deepgemm_fp8_paged_mqa_logits"
BLOCK_SIZE = "kv_cache_fp8.shape[1]"
C4A_GUARD = "(_ON_GFX950 or _ON_GFX942) and _indexer_k_is_c4a_block_flat(compress_ratio) and (block_size > 1)"
AITER_ON = "rocm_aiter_ops.is_enabled() or rocm_aiter_ops.is_rdna_aiter_enabled()"
AITER_LOOKUP = "paged_mqa_logits_module()"
GLUON_MODULE_FOUND = "aiter_paged_mqa_logits_module is not None"
OUTPUT = "current_workspace_manager().get_simultaneous(((batch_size * next_n, max_model_len), torch.float32))"
GLUON_ARGS = (
    "q_fp8",
    "kv_cache_fp8",
    "weights",
    "out_logits",
    "_per_sequence_context_lens(context_lens)",
    "block_tables",
    "max_model_len",
)
_LENGTHS = 4  # GLUON_ARGS' index of the per-sequence lengths
GLUON_KNOBS = {"ChunkK": "256", "KVBlockSize": "block_size", "WavePerEU": "2"}


@dataclass(frozen=True)
class Audited:
    """The forms that differ between releases: ``Preshuffle``, and the test of the branch reaching Gluon."""

    preshuffle: str
    gluon_branch: str


# Preshuffle's two audited forms: by block size alone, and by vLLM's layout helper.
PRESHUFFLE_BY_SIZE = "block_size > 1"
PRESHUFFLE_BY_LAYOUT = "indexer_k_cache_is_shuffled(block_size) and (not _ON_RDNA)"
_GFX9 = Audited(preshuffle=PRESHUFFLE_BY_SIZE, gluon_branch="_ON_GFX942 or _ON_GFX950")
RELEASES: dict[tuple[int, int], Audited] = {
    (0, 32): _GFX9,
    (0, 33): _GFX9,
    # The layout helper, Preshuffle off on RDNA (gfx950 is not), the branch also taken on RDNA but gfx1151.
    (0, 34): Audited(
        preshuffle=PRESHUFFLE_BY_LAYOUT,
        gluon_branch="_ON_GFX942 or _ON_GFX950 or (_ON_RDNA and (not _ON_GFX1151))",
    ),
}


class ContentDrift(Exception):
    """vLLM's target does not do what this package audited; the message says what differed."""


def function_node(
    source: str, name: str = TARGET_NAME, first_line: int | None = None
) -> ast.FunctionDef | None:
    """The module-level ``def name`` of ``source``, the one starting at ``first_line`` where given."""
    found = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    for node in found:
        if first_line in (node.lineno, *(d.lineno for d in node.decorator_list)):
            return node
    return found[-1] if found else None


def _names_in(expr: ast.AST) -> list[str]:
    return [
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(expr)
        if isinstance(n, (ast.Name, ast.Attribute))
    ]


def calls_flydsl(module: ast.Module, fn: ast.FunctionDef) -> bool:
    """Whether ``fn`` calls a FlyDSL function: a callee named ``*flydsl*``, or imported from a FlyDSL module.

    Code only: a comment, a docstring or a string argument that mentions FlyDSL is not a call.
    """
    imported = set()
    for node in (*ast.walk(module), *ast.walk(fn)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            source = getattr(node, "module", None) or ""
            for alias in node.names:
                if "flydsl" in f"{source}.{alias.name}".lower():
                    imported.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            names = _names_in(node.func)
            if any("flydsl" in name.lower() for name in names) or (names and names[-1] in imported):
                return True
    return False


def _forms(field: str) -> str:
    """Every audited form of ``field``, with the releases that have it."""
    by_form: dict[str, list[str]] = {}
    for (major, minor), audited in RELEASES.items():
        by_form.setdefault(getattr(audited, field), []).append(f"{major}.{minor}")
    return " or ".join(f"{form} (vLLM {', '.join(releases)})" for form, releases in by_form.items())


def _parents(fn: ast.FunctionDef) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}


def _enclosing_ifs(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> list[ast.If]:
    """The ``if`` statements whose body (not ``else``) holds ``node``, innermost first."""
    found = []
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.If) and any(node is s for s in parent.body):
            found.append(parent)
        node = parent
    return found


def _problems(fn: ast.FunctionDef) -> tuple[list[str], str | None]:
    """What differs from the audit, and the ``Preshuffle`` form found (``None`` where none is audited)."""
    problems: list[str] = []
    statements = list(ast.walk(fn))
    calls = [n for n in statements if isinstance(n, ast.Call) and ast.unparse(n.func) == GLUON]
    if len(calls) != 1:
        return [f"calls aiter's Gluon {GLUON} {len(calls)} times; audited: once"], None
    (call,) = calls
    parents = _parents(fn)
    ifs = _enclosing_ifs(call, parents)
    tests = [ast.unparse(i.test) for i in ifs]

    assigns = {
        ast.unparse(t): ast.unparse(n.value)
        for n in statements
        if isinstance(n, ast.Assign)
        for t in n.targets
    }
    if assigns.get("block_size") != BLOCK_SIZE:
        problems.append(f"reads block_size as {assigns.get('block_size')}; audited: {BLOCK_SIZE}")
    guards = [
        n for n in fn.body if isinstance(n, ast.If) and "_indexer_k_is_c4a_block_flat" in _names_in(n.test)
    ]
    if not guards:
        problems.append(f"has no C4A guard; audited: if {C4A_GUARD}: return (vLLM's C4A route)")
    elif ast.unparse(guards[0].test) != C4A_GUARD or not isinstance(guards[0].body[-1], ast.Return):
        problems.append(
            f"guards its C4A route with if {ast.unparse(guards[0].test)}; audited: if {C4A_GUARD}: return"
        )
    lookup = [
        n
        for n in fn.body
        if isinstance(n, ast.If) and any(ast.unparse(s).endswith(f" = {AITER_LOOKUP}") for s in n.body)
    ]
    if not lookup or ast.unparse(lookup[0].test) != AITER_ON:
        found = f"under {ast.unparse(lookup[0].test)}" if lookup else "nowhere"
        problems.append(f"looks aiter's Gluon module up {found}; audited: {AITER_LOOKUP} if {AITER_ON}")
    if GLUON_MODULE_FOUND not in tests:
        problems.append(f"calls Gluon outside if {GLUON_MODULE_FOUND}")
    branch = tests[0] if tests else "(no test)"
    if branch not in {a.gluon_branch for a in RELEASES.values()}:
        problems.append(f"reaches Gluon under {branch}; audited: {_forms('gluon_branch')}")

    args = [ast.unparse(a) for a in call.args]
    if len(args) != len(GLUON_ARGS):
        problems.append(f"passes Gluon {len(args)} positional arguments; audited: {', '.join(GLUON_ARGS)}")
    else:
        for i, (passed, audited) in enumerate(zip(args, GLUON_ARGS, strict=True)):
            if passed == audited:
                continue
            if i == _LENGTHS:
                what = "context_lens unreduced" if passed == "context_lens" else f"{passed} as the lengths"
                problems.append(f"passes {what} to Gluon; audited: {audited}")
            else:
                problems.append(f"passes {passed} as Gluon's argument {i + 1}; audited: {audited}")
    body = ifs[0].body if ifs else []
    buffer = next(
        (
            ast.unparse(s.value)
            for s in body
            if isinstance(s, ast.Assign) and "out_logits" in ast.unparse(s.targets[0])
        ),
        None,
    )
    if buffer != OUTPUT:
        problems.append(f"takes Gluon's output from {buffer}; audited: {OUTPUT}")
    if not body or ast.unparse(body[-1]) != "return out_logits":
        problems.append("does not return Gluon's output as it is; audited: return out_logits")

    knobs = {k.arg: ast.unparse(k.value) for k in call.keywords}
    preshuffle = knobs.pop("Preshuffle", None)
    for name in sorted(set(knobs) | set(GLUON_KNOBS)):
        passed, audited = knobs.get(name), GLUON_KNOBS.get(name)
        if passed != audited:
            problems.append(
                f"passes {name}={passed} to Gluon; audited: "
                + (f"{name}={audited}" if audited is not None else f"no {name}")
            )
    if preshuffle not in {a.preshuffle for a in RELEASES.values()}:
        problems.append(f"passes Preshuffle={preshuffle} to Gluon; audited: {_forms('preshuffle')}")
        preshuffle = None
    return problems, preshuffle


def audit(fn: Callable) -> str:
    """The ``Preshuffle`` expression the original ``fn`` passes Gluon, one of :data:`RELEASES`' forms.

    Reads ``fn``'s source file (through :func:`files.read_text`) and finds its ``def`` by name and
    first line. Raises :class:`ContentDrift` naming everything that differs from the audit, or why
    the source is unreadable.
    """
    where = f"vLLM's {TARGET_NAME}"
    code = getattr(fn, "__code__", None)
    if code is None:
        raise ContentDrift(f"{where} has no Python source to check")
    try:
        node = function_node(
            files.read_text(code.co_filename, MAX_SOURCE_BYTES), fn.__name__, code.co_firstlineno
        )
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
        raise ContentDrift(f"{where}'s source is unreadable ({type(e).__name__}: {e})") from None
    if node is None:
        raise ContentDrift(f"{where}'s source is not in {code.co_filename}")
    problems, preshuffle = _problems(node)
    if problems or preshuffle is None:
        raise ContentDrift(f"{where} " + "; it also ".join(problems))
    return preshuffle
