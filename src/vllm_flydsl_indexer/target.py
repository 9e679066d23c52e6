# SPDX-License-Identifier: Apache-2.0
"""What vLLM is: the patched function, what it must do, who calls it, and its objects resolved once.

* **The target**: ``rocm_fp8_paged_mqa_logits``, its signature, and the :class:`Call` the rules read.
* **Its content** (:func:`audit`): the router takes only the calls the original sends to aiter's
  gfx950 Gluon kernel and launches FlyDSL with what it passes Gluon, so before anything is patched
  the original's AST is held to what was audited: the C4A guard, the aiter lookup and the branch
  reaching Gluon, and that call's arguments. The forms that differ between releases are pinned per
  release in :data:`RELEASES`; anything else is a :class:`ContentDrift` and vLLM stays stock.
* **Its objects** (:func:`vllm_stock_hooks`): every vLLM name the router's stock side uses, resolved
  at install, so per call the router reads no vLLM module attribute.
* **Its callers** (:data:`MULTI_ROW`): FlyDSL writes row ``(b, i)`` over ``[0, L_b - next_n + i]``,
  which equals what the consumers read only for vLLM's native ``(B, next_n)`` table, one apart, so
  ``next_n > 1`` is taken only from a call site audited to pass it. The audit, release by release,
  is in ``docs/vllm-audit.md``; ``tests/test_drift.py`` fails when a release differs from it.

No vLLM at import; torch only for the hooks' buffer.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm_flydsl_indexer import files

if TYPE_CHECKING:
    import torch

__all__ = [
    "AITER_LOOKUP", "AITER_ON", "Audited", "BLOCK_SIZE", "C4A_GUARD", "Call", "ContentDrift",
    "DEFINING_MODULE", "FP8_SETTING", "GLUON", "GLUON_ARGS", "GLUON_KNOBS", "GLUON_MODULE_FOUND",
    "GluonQuestion", "I32_OFFSET_LIMIT", "INDEX_TOPK", "MARKER", "MAX_SOURCE_BYTES", "MULTI_ROW",
    "MXFP4_DEFAULT_FUNCTION", "MXFP4_DEFAULT_MODULE", "OUTPUT", "PRESHUFFLE_BY_LAYOUT", "PRESHUFFLE_BY_SIZE",
    "RELEASES", "SCALE_BYTES", "StockHooks", "TARGET_KEYWORD_ONLY", "TARGET_MODULE", "TARGET_NAME",
    "TARGET_POSITIONAL", "audit", "calls_flydsl", "config_objection", "function_node", "multi_row_objection",
    "mxfp4_reason", "signature_problem", "unpatched", "vllm_stock_hooks",
]  # fmt: skip

TARGET_MODULE = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"
TARGET_NAME = "rocm_fp8_paged_mqa_logits"
# The module that defines the target; its own indexer calls it.
DEFINING_MODULE = TARGET_MODULE
# The signature this package was written against (vLLM 0.32.0, 0.33.0 and 0.34.0).
TARGET_POSITIONAL = tuple(
    "q_fp8 kv_cache_fp8 weights context_lens block_tables schedule_metadata max_model_len".split()
)
TARGET_KEYWORD_ONLY = {"compress_ratio": 1}
# vLLM's fp8 indexer cache: per token, head_dim fp8 bytes, then one float32 scale.
SCALE_BYTES = 4
# FlyDSL addresses the cache with i32 byte offsets: a pool must stay under this.
I32_OFFSET_LIMIT = 2**31
# vLLM's index_topk: the columns the indexer's top-k keeps per row (the agreement rule compares them).
INDEX_TOPK = 2048
# Set on the patch's wrappers, so the original can always be found behind them.
MARKER = "_vllm_flydsl_indexer"


def signature_problem(fn: object) -> str | None:
    """Why ``fn`` does not have the target signature, or ``None``."""
    if not callable(fn):
        return f"{TARGET_NAME} is missing"
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        return f"signature unreadable ({e})"
    kinds = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    positional = tuple(p.name for p in params if p.kind is kinds[0])
    keyword_only = {p.name: p.default for p in params if p.kind is kinds[1]}
    others = [p.name for p in params if p.kind not in kinds]
    if positional != TARGET_POSITIONAL or keyword_only != TARGET_KEYWORD_ONLY or others:
        return f"signature {inspect.signature(fn)} differs from the one this package supports"
    return None


def unpatched(fn: Callable) -> Callable:
    """``fn`` itself, or the original function when ``fn`` is this package's wrapper."""
    return fn.__wrapped__ if getattr(fn, MARKER, False) else fn


class Call(NamedTuple):
    """One call as the rules see it."""

    q_fp8: torch.Tensor
    kv_cache: torch.Tensor
    weights: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_model_len: int
    compress_ratio: int
    caller: str | None
    dcp_world_size: int

    @classmethod
    def of(cls, args: tuple, compress_ratio: int, caller: str | None, dcp: int) -> Call:
        """The Call of the target's positional ``args`` (``schedule_metadata`` is not read)."""
        q, kv, weights, lens, tables, _, max_model_len = args
        return cls(q, kv, weights, lens, tables, max_model_len, compress_ratio, caller, dcp)


# --- Its content: every expression as ``ast.unparse`` writes it. ---

# vLLM's target module is about 100 kB; the cap keeps a FIFO or a runaway file out of start-up.
MAX_SOURCE_BYTES = 4 * 2**20
GLUON = "deepgemm_fp8_paged_mqa_logits"
BLOCK_SIZE = "kv_cache_fp8.shape[1]"
C4A_GUARD = "(_ON_GFX950 or _ON_GFX942) and _indexer_k_is_c4a_block_flat(compress_ratio) and (block_size > 1)"
AITER_ON = "rocm_aiter_ops.is_enabled() or rocm_aiter_ops.is_rdna_aiter_enabled()"
AITER_LOOKUP = "paged_mqa_logits_module()"
GLUON_MODULE_FOUND = "aiter_paged_mqa_logits_module is not None"
OUTPUT = "current_workspace_manager().get_simultaneous(((batch_size * next_n, max_model_len), torch.float32))"
GLUON_ARGS = ("q_fp8", "kv_cache_fp8", "weights", "out_logits", "_per_sequence_context_lens(context_lens)")
GLUON_ARGS += ("block_tables", "max_model_len")
_LENGTHS = 4  # GLUON_ARGS' index of the per-sequence lengths
GLUON_KNOBS = {"ChunkK": "256", "KVBlockSize": "block_size", "WavePerEU": "2"}
# Preshuffle's two audited forms: by block size alone, and by vLLM's layout helper.
PRESHUFFLE_BY_SIZE = "block_size > 1"
PRESHUFFLE_BY_LAYOUT = "indexer_k_cache_is_shuffled(block_size) and (not _ON_RDNA)"


class Audited(NamedTuple):
    """The forms that differ between releases: ``Preshuffle``, and the test of the branch reaching Gluon."""

    preshuffle: str
    gluon_branch: str


_GFX9 = Audited(PRESHUFFLE_BY_SIZE, "_ON_GFX942 or _ON_GFX950")
RELEASES: dict[tuple[int, int], Audited] = {
    (0, 32): _GFX9,
    (0, 33): _GFX9,
    # The layout helper, Preshuffle off on RDNA (gfx950 is not), the branch also taken on RDNA but gfx1151.
    (0, 34): Audited(PRESHUFFLE_BY_LAYOUT, "_ON_GFX942 or _ON_GFX950 or (_ON_RDNA and (not _ON_GFX1151))"),
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
    nodes = ast.walk(expr)
    return [
        n.id if isinstance(n, ast.Name) else n.attr for n in nodes if isinstance(n, (ast.Name, ast.Attribute))
    ]


def calls_flydsl(module: ast.Module, fn: ast.FunctionDef) -> bool:
    """Whether ``fn`` calls a FlyDSL function: a callee named ``*flydsl*`` or imported from a FlyDSL
    module. Code only: a comment, a docstring or a string that mentions FlyDSL is not a call."""
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


def _problems(fn: ast.FunctionDef) -> tuple[list[str], str | None]:
    """What differs from the audit, and the ``Preshuffle`` form found (``None`` where none is audited)."""
    statements = list(ast.walk(fn))
    calls = [n for n in statements if isinstance(n, ast.Call) and ast.unparse(n.func) == GLUON]
    if len(calls) != 1:
        return [f"calls aiter's Gluon {GLUON} {len(calls)} times; audited: once"], None
    (call,) = calls
    # The ``if`` statements whose body (not ``else``) holds the Gluon call, innermost first.
    parents = {child: node for node in statements for child in ast.iter_child_nodes(node)}
    ifs, node = [], call
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.If) and any(node is s for s in parent.body):
            ifs.append(parent)
        node = parent
    tests = [ast.unparse(i.test) for i in ifs]
    problems: list[str] = []
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
            if passed != audited and i == _LENGTHS:
                what = "context_lens unreduced" if passed == "context_lens" else f"{passed} as the lengths"
                problems.append(f"passes {what} to Gluon; audited: {audited}")
            elif passed != audited:
                problems.append(f"passes {passed} as Gluon's argument {i + 1}; audited: {audited}")
    body = ifs[0].body if ifs else []
    outputs = (s for s in body if isinstance(s, ast.Assign) and "out_logits" in ast.unparse(s.targets[0]))
    buffer = next((ast.unparse(s.value) for s in outputs), None)
    if buffer != OUTPUT:
        problems.append(f"takes Gluon's output from {buffer}; audited: {OUTPUT}")
    if not body or ast.unparse(body[-1]) != "return out_logits":
        problems.append("does not return Gluon's output as it is; audited: return out_logits")
    knobs = {k.arg: ast.unparse(k.value) for k in call.keywords}
    preshuffle = knobs.pop("Preshuffle", None)
    for name in sorted(set(knobs) | set(GLUON_KNOBS)):
        passed, audited = knobs.get(name), GLUON_KNOBS.get(name)
        if passed != audited:
            wanted = f"{name}={audited}" if audited is not None else f"no {name}"
            problems.append(f"passes {name}={passed} to Gluon; audited: {wanted}")
    if preshuffle not in {a.preshuffle for a in RELEASES.values()}:
        problems.append(f"passes Preshuffle={preshuffle} to Gluon; audited: {_forms('preshuffle')}")
        preshuffle = None
    return problems, preshuffle


def audit(fn: Callable) -> str:
    """The ``Preshuffle`` expression the original ``fn`` passes Gluon, one of :data:`RELEASES`' forms.

    Reads ``fn``'s source file (:func:`files.read_text`) and finds its ``def`` by name and first line.
    Raises :class:`ContentDrift` naming everything that differs from the audit, or why the source is
    unreadable.
    """
    where = f"vLLM's {TARGET_NAME}"
    code = getattr(fn, "__code__", None)
    if code is None:
        raise ContentDrift(f"{where} has no Python source to check")
    try:
        source = files.read_text(code.co_filename, MAX_SOURCE_BYTES)
        node = function_node(source, fn.__name__, code.co_firstlineno)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
        raise ContentDrift(f"{where}'s source is unreadable ({type(e).__name__}: {e})") from None
    if node is None:
        raise ContentDrift(f"{where}'s source is not in {code.co_filename}")
    problems, preshuffle = _problems(node)
    if problems or preshuffle is None:
        raise ContentDrift(f"{where} " + "; it also ".join(problems))
    return preshuffle


# --- Its objects, resolved once. ---


@dataclass(frozen=True)
class StockHooks:
    """What the router asks of vLLM, as the original asks it, injected so the router imports no vLLM.

    ``gluon_objection(compress_ratio, block_size)``: why the original would not call aiter's gfx950
    Gluon kernel here, or ``None``. ``output_buffer(rows, max_model_len)``: the logits buffer, taken as
    the original takes it. ``per_sequence_lens(context_lens)``: vLLM's reduction to one length per
    sequence. ``dcp_world_size()``. ``preshuffle(block_size)``: the ``Preshuffle`` the original passes.
    """

    gluon_objection: Callable[[int, int], str | None]
    output_buffer: Callable[[int, int], torch.Tensor]
    per_sequence_lens: Callable[[torch.Tensor], torch.Tensor]
    dcp_world_size: Callable[[], int]
    preshuffle: Callable[[int], bool]


def _resolve(owner: object, name: str, flag: bool = False) -> Any:
    """``owner.name``: a callable, or a bool where ``flag``; :class:`ContentDrift` otherwise."""
    value = getattr(owner, name, None)
    if not (isinstance(value, bool) if flag else callable(value)):
        where = getattr(owner, "__name__", type(owner).__name__)
        raise ContentDrift(
            f"vLLM's {where} has no {'flag' if flag else 'function'} {name} (the router's stock side uses it)"
        )
    return value


@dataclass(frozen=True)
class GluonQuestion:
    """Whether the original would call aiter's gfx950 Gluon kernel, asked of vLLM's objects in hand, by
    its own conditions (:func:`audit` checks them): not its C4A route on gfx9, gfx950, aiter enabled,
    aiter's Gluon module found. The flags are read once; the helpers are vLLM's own function objects."""

    on_gfx950: bool
    on_gfx942: bool
    c4a_block_flat: Callable[[int], object]
    aiter_enabled: Callable[[], object]
    rdna_aiter_enabled: Callable[[], object]
    gluon_module: Callable[[], object]

    @classmethod
    def of(cls, target: object, aiter_ops: object) -> GluonQuestion:
        """The question with ``target``'s names (a module, or a stand-in) resolved; :class:`ContentDrift`
        names the first that is missing."""
        return cls(
            on_gfx950=bool(_resolve(target, "_ON_GFX950", flag=True)),
            on_gfx942=bool(_resolve(target, "_ON_GFX942", flag=True)),
            c4a_block_flat=_resolve(target, "_indexer_k_is_c4a_block_flat"),
            aiter_enabled=_resolve(aiter_ops, "is_enabled"),
            rdna_aiter_enabled=_resolve(aiter_ops, "is_rdna_aiter_enabled"),
            gluon_module=_resolve(target, "paged_mqa_logits_module"),
        )

    def __call__(self, compress_ratio: int, block_size: int) -> str | None:
        """Why the original would not call aiter's gfx950 Gluon kernel here, or ``None``."""
        if (self.on_gfx950 or self.on_gfx942) and self.c4a_block_flat(compress_ratio) and block_size > 1:
            return f"vLLM's own C4A Triton route (compress_ratio={compress_ratio}, block_size={block_size})"
        if not self.on_gfx950:
            return "vLLM does not report gfx950, so its stock call would not run aiter's Gluon kernel"
        if not (self.aiter_enabled() or self.rdna_aiter_enabled()):
            return "VLLM_ROCM_USE_AITER is not 1, so vLLM would not call aiter's Gluon kernel"
        if self.gluon_module() is None:
            return "vLLM finds no aiter Gluon paged-MQA-logits module"
        return None


def vllm_stock_hooks(target: ModuleType) -> StockHooks:
    """Hooks that answer as ``target.rocm_fp8_paged_mqa_logits``, every vLLM name resolved now.

    First holds the original to its audited content (:func:`audit`): the hooks mirror it only where it
    does what was audited. Raises :class:`ContentDrift` naming what differs or is missing.
    """
    form = audit(unpatched(_resolve(target, TARGET_NAME)))
    import torch
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.distributed import parallel_state

    question = GluonQuestion.of(target, rocm_aiter_ops)
    workspace = _resolve(target, "current_workspace_manager")
    per_sequence_lens = _resolve(target, "_per_sequence_context_lens")
    dcp = _resolve(parallel_state, "get_dcp_world_size_and_rank")

    def output_buffer(rows: int, max_model_len: int) -> torch.Tensor:
        (out,) = workspace().get_simultaneous(((rows, max_model_len), torch.float32))
        return out

    if form == PRESHUFFLE_BY_LAYOUT:
        shuffled = _resolve(target, "indexer_k_cache_is_shuffled")
        rdna = _resolve(target, "_ON_RDNA", flag=True)

        def preshuffle(block_size: int) -> bool:
            return bool(shuffled(block_size)) and not rdna

    else:
        assert form == PRESHUFFLE_BY_SIZE, form

        def preshuffle(block_size: int) -> bool:
            return block_size > 1

    return StockHooks(question, output_buffer, per_sequence_lens, lambda: dcp()[0], preshuffle)


# --- Its callers (docs/vllm-audit.md, "The call-site audit"; tools/audit.py holds the whole record). ---

# Every audited call site: ``None`` where FlyDSL may take ``next_n > 1`` from it (with
# ``compress_ratio == 1`` and DCP 1), else why its bounds are not vLLM's native table.
MULTI_ROW: dict[str, str | None] = {
    DEFINING_MODULE: None,
    "vllm.models.deepseek_v41.amd.ops.sparse_indexer": None,
    "vllm.models.glm5next.amd.sparse_indexer": "pool-granular (it does NOT pass compress_ratio although its "
    "bounds are compressed)",
}


def multi_row_objection(caller: str | None) -> str | None:
    """Why FlyDSL may not take a ``next_n > 1`` call from ``caller``, or ``None``."""
    if caller not in MULTI_ROW:
        return (
            f"next_n > 1 from a caller this package has not audited ({caller or 'unknown'}): "
            "only next_n == 1 is always safe"
        )
    why = MULTI_ROW[caller]
    return None if why is None else f"next_n > 1 from {caller}: its bounds are {why}"


# The path that never calls the target: aiter's MXFP4 indexer, which vLLM resolves "auto" to for
# DeepSeek-V4 on CDNA4 with aiter (vLLM 0.33.0 and later), and the setting that keeps FP8.
MXFP4_DEFAULT_MODULE = "vllm.platforms.rocm"
MXFP4_DEFAULT_FUNCTION = "_maybe_default_dsv4_mxfp4_indexer"
FP8_SETTING = """--attention-config '{"indexer_kv_dtype": "fp8"}'"""


def mxfp4_reason(model_type: str) -> str:
    """Why a model on the MXFP4 indexer never reaches FlyDSL (the runtime WARNING and doctor's reason)."""
    return (
        f"{model_type} runs aiter's MXFP4 indexer (indexer_kv_dtype 'mxfp4', vLLM's default for it on "
        f"MI350/MI355 with aiter: {MXFP4_DEFAULT_FUNCTION}), which never calls {TARGET_NAME}; "
        f"{FP8_SETTING} selects the FP8 indexer, which does"
    )


def config_objection(vllm_config: object) -> str | None:
    """Why no call of the model ``vllm_config`` describes reaches the target, or ``None``.
    Reads attributes only, with defaults, so any object is accepted."""
    attention = getattr(vllm_config, "attention_config", None)
    if getattr(attention, "indexer_kv_dtype", None) != "mxfp4":
        return None
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    return mxfp4_reason(str(getattr(hf_config, "model_type", None) or "this model"))
