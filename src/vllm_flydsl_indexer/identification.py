# SPDX-License-Identifier: Apache-2.0
"""Which FlyDSL paged-MQA-logits API the installed aiter has (startup only).

One public name has meant several kernels, so the lookup identifies what it
found from signatures and module constants, never from the name alone, and
returns a :class:`~vllm_flydsl_indexer.kernels.KernelVariant` carrying that
API's exact contract:

* ``dispatcher``: aiter's tuned dispatcher (aiter PR #6140),
  ``aiter.paged_mqa_logits.paged_mqa_logits`` beside
  ``get_paged_mqa_logits_config`` and ``run_paged_mqa_logits``. Its measured
  table picks Gluon or FlyDSL per shape, so it is preferred; the router hands
  it only the calls it would launch on FlyDSL (where it would pick Gluon it
  would re-tune Gluon's knobs, so vLLM's own call runs instead). Identified by
  its functions (a fork ships an unrelated module of that name); the self-test
  makes it launch FlyDSL through ``run_paged_mqa_logits``, the entry point
  aiter's own tuner uses.
* ``gfx950``: the gfx950-specialised ``flydsl_fp8_paged_mqa_logits``
  (``fp8_paged_mqa_logits_gfx950.py``): fixed heads, head_dim, KVBlockSize and
  index_dim read from its module constants, Preshuffle required, ``next_n`` up
  to ``MAX_NN``; keyword-only ``next_n_lens``, no ``ChunkK``. Its automatic
  SplitKV reads ``context_lens.max().item()``, a host sync that breaks graph
  capture, so the launch always passes an explicit ``SplitKV`` computed from
  shapes as aiter's dispatcher does. One revision (e.g. aiter f5b390371d) has
  the same signature and constants but takes q padded to ``(B, MAX_NN, H, D)``
  and writes row ``b*MAX_NN + i``; only the wrapper's source tells them apart
  (:func:`gfx950_q_contract`). That one is refused with its reason: feeding it
  would need padded copies of q and weights and a ``B*MAX_NN``-row output
  outside vLLM's workspace, an extra pass on every call.
* ``gfx950-early``: an earlier revision of the same gfx950 file and name (e.g.
  aiter 9661da3a): heads from its module's ``SUPPORTED_HEADS`` (32 and 64, so
  DeepSeek-V3.2 too), ``HEAD_DIM``, ``KV_BLOCK_SIZE`` and ``INDEX_DIM``,
  Preshuffle required, ``next_n`` only as its wrapper's literal check allows
  (``next_n not in (1, 2)``, read from the source); keyword-only
  ``Preshuffle``, ``KVBlockSize``, ``SplitKV``, ``TotalCuCount``, ``stream``,
  no ``next_n_lens`` and no ``ChunkK``. Its automatic SplitKV reads shapes
  only (``max_model_len``, the CU count, the batch), but the launch passes
  the same value explicitly (:data:`GFX950_EARLY_WORKGROUPS_PER_CU`), so graph
  safety never rests on the default.
* ``general``: aiter PR #4221's kernel: heads and head_dim powers of two
  (multiples of 32 and 64), KVBlockSize 1 or a multiple of 16; keyword-only
  ``ChunkK``, ``WavePerEU``, ``variant``. Launched with KVBlockSize and
  Preshuffle only; its other knobs keep their defaults.

Anything else (an API of another shape) is ``unknown`` and keeps vLLM on the
stock path with the reason. Importing aiter can fail with errors other than
ImportError (an aiter/flydsl mismatch), so every probe catches any exception
and records it. Nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import inspect
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType

from vllm_flydsl_indexer.kernels import (
    GFX950_EARLY_WORKGROUPS_PER_CU,
    WORKGROUPS_PER_CU,
    KernelVariant,
    Limits,
)
from vllm_flydsl_indexer.target import Call

__all__ = [
    "AITER_DISTRIBUTIONS",
    "DISPATCHER_MODULE",
    "KERNEL_MODULES",
    "KERNEL_NAME",
    "KernelLookup",
    "find_kernel",
    "gfx950_next_n_values",
    "gfx950_q_contract",
    "identify",
    "identify_dispatcher",
    "identify_flydsl",
    "installed_version",
]

KERNEL_NAME = "flydsl_fp8_paged_mqa_logits"
# Probed in order: the re-export, the PR branch's module, earlier revisions.
KERNEL_MODULES = (
    "aiter.ops.flydsl",
    "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits",
    "aiter.ops.flydsl.kernels.fp8_paged_mqa_logits",
)
DISPATCHER_MODULE = "aiter.paged_mqa_logits"
DISPATCHER_NAME = "paged_mqa_logits"
DISPATCHER_CONFIG_NAME = "get_paged_mqa_logits_config"
DISPATCHER_SUPPORTS_NAME = "flydsl_supports"
# Launches one explicit config (aiter's tuner and the dispatcher share it): the self-test's FlyDSL.
DISPATCHER_RUN_NAME = "run_paged_mqa_logits"
FORCED_FLYDSL = {"backend": "flydsl", "ChunkK": 256, "WavePerEU": 2, "wg_per_cu": 0}
# Distribution names of aiter, first found wins: its ROCm wheels are published as
# amd-aiter ("aiter" on PyPI is an unrelated library).
AITER_DISTRIBUTIONS = ("amd-aiter", "aiter")


def installed_version(distributions: Iterable[str]) -> tuple[str, str] | None:
    """``(version, distribution)`` of the first of ``distributions`` installed, or ``None``."""
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution), distribution
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _as_set(value: object) -> frozenset[int] | None:
    """A module constant as a set of ints: ``32`` or ``(32, 64)``; ``None`` if unreadable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return frozenset({value})
    if (
        isinstance(value, (tuple, list, set, frozenset))
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return frozenset(value)
    return None


def _parameters(fn: Callable) -> dict[str, inspect.Parameter] | str:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        return f"signature unreadable ({e})"


def _keyword_only(params: dict[str, inspect.Parameter], names: Iterable[str]) -> list[str]:
    return [n for n in names if n not in params or params[n].kind is not inspect.Parameter.KEYWORD_ONLY]


def identify_flydsl(fn: Callable, module: ModuleType | None, location: str) -> KernelVariant | str:
    """The variant of a ``flydsl_fp8_paged_mqa_logits`` found at ``location``, or why it is unknown."""
    params = _parameters(fn)
    if isinstance(params, str):
        return params
    missing = _keyword_only(params, ("Preshuffle", "KVBlockSize"))
    if missing:
        return f"lacks keyword-only {', '.join(missing)}"
    general_knobs = {"ChunkK", "WavePerEU", "variant"}
    if "next_n_lens" in params and not general_knobs & set(params):
        if "SplitKV" not in params or params["SplitKV"].kind is not inspect.Parameter.KEYWORD_ONLY:
            return "gfx950-style API without a keyword-only SplitKV (cannot launch it graph-safely)"
        source = _defining_module(fn, module)
        constants = {
            name: _as_set(getattr(source, name, None))
            for name in ("NUM_HEADS", "HEAD_DIM", "KV_BLOCK_SIZE", "INDEX_DIM", "MAX_NN")
        }
        unreadable = [name for name, value in constants.items() if value is None]
        if unreadable:
            return f"gfx950-style API whose module lacks readable {', '.join(unreadable)}"
        (index_dim,) = constants["INDEX_DIM"] if len(constants["INDEX_DIM"]) == 1 else (None,)
        if index_dim is None or len(constants["MAX_NN"]) != 1:
            return "gfx950-style API with ambiguous INDEX_DIM or MAX_NN"
        max_nn = next(iter(constants["MAX_NN"]))
        q_contract = gfx950_q_contract(fn)
        if q_contract == Q_PADDED:
            return (
                f"gfx950 kernel that takes q padded to next_n {max_nn} (q (B, {max_nn}, H, D), "
                f"weights (B*{max_nn}, H), output row b*{max_nn}+i; aiter revisions like f5b390371d): "
                "not supported, stock path kept"
            )
        if q_contract != Q_NEXT_N:
            return f"gfx950-style API whose q contract cannot be read from its source ({q_contract})"
        limits = Limits(
            heads=constants["NUM_HEADS"],
            head_dims=constants["HEAD_DIM"],
            block_sizes=constants["KV_BLOCK_SIZE"],
            index_dim=index_dim,
            max_next_n=max_nn,
            preshuffle_required=True,
            q_contiguous=True,
        )
        return KernelVariant(
            "gfx950", fn, location, limits, "gfx950-specialised FlyDSL kernel", WORKGROUPS_PER_CU
        )
    if general_knobs <= set(params) and "next_n_lens" not in params:
        return KernelVariant("general", fn, location, Limits(), "general FlyDSL kernel (aiter PR #4221)")
    if "next_n_lens" not in params and not general_knobs & set(params):
        return _identify_gfx950_early(fn, module, location, params)
    return "an API of an unknown shape (neither the PR #4221 kernel nor the gfx950 kernel)"


GFX950_EARLY_CONSTANTS = ("SUPPORTED_HEADS", "HEAD_DIM", "KV_BLOCK_SIZE", "INDEX_DIM")


def _identify_gfx950_early(
    fn: Callable, module: ModuleType | None, location: str, params: dict[str, inspect.Parameter]
) -> KernelVariant | str:
    """The earlier gfx950 revision (``SUPPORTED_HEADS``, no ``next_n_lens``), or why this is not it."""
    if "SplitKV" not in params or params["SplitKV"].kind is not inspect.Parameter.KEYWORD_ONLY:
        return (
            "an API of an unknown shape (no next_n_lens, no ChunkK/WavePerEU/variant and no "
            "keyword-only SplitKV)"
        )
    source = _defining_module(fn, module)
    constants = {name: _as_set(getattr(source, name, None)) for name in GFX950_EARLY_CONSTANTS}
    unreadable = [name for name, value in constants.items() if value is None]
    if unreadable:
        return (
            "an API of an unknown shape (no next_n_lens and no ChunkK/WavePerEU/variant, like the "
            f"earlier gfx950 kernel, but its module lacks readable {', '.join(unreadable)})"
        )
    if len(constants["INDEX_DIM"]) != 1:
        return "earlier-gfx950-style API with an ambiguous INDEX_DIM"
    next_ns = gfx950_next_n_values(fn)
    if isinstance(next_ns, str):
        return f"earlier-gfx950-style API whose next_n range cannot be read from its source ({next_ns})"
    (index_dim,) = constants["INDEX_DIM"]
    limits = Limits(
        heads=constants["SUPPORTED_HEADS"],
        head_dims=constants["HEAD_DIM"],
        block_sizes=constants["KV_BLOCK_SIZE"],
        index_dim=index_dim,
        max_next_n=max(next_ns),
        preshuffle_required=True,
        q_contiguous=True,
    )
    return KernelVariant(
        "gfx950-early",
        fn,
        location,
        limits,
        "gfx950-specialised FlyDSL kernel, earlier revision (SUPPORTED_HEADS, no next_n_lens)",
        GFX950_EARLY_WORKGROUPS_PER_CU,
    )


Q_NEXT_N = "next_n"
Q_PADDED = "padded"


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _paired(left: ast.AST, right: ast.AST, a: str, b: str) -> bool:
    """``a == b`` or ``(.., a, ..) == (.., b, ..)`` at the same position, either side."""
    if (_is_name(left, a) and _is_name(right, b)) or (_is_name(left, b) and _is_name(right, a)):
        return True
    if isinstance(left, ast.Tuple) and isinstance(right, ast.Tuple) and len(left.elts) == len(right.elts):
        return any(_paired(x, y, a, b) for x, y in zip(left.elts, right.elts, strict=True))
    return False


def gfx950_q_contract(fn: Callable) -> str:
    """How a gfx950 wrapper checks q's second dimension, read from its source.

    ``Q_NEXT_N``: q is ``(B, next_n, H, D)`` and the wrapper range-checks that
    dimension against ``MAX_NN`` (``1 <= next_n <= MAX_NN``). ``Q_PADDED``: the
    wrapper requires it to equal ``MAX_NN`` (``(max_nn, ...) != (MAX_NN, ...)``),
    i.e. q padded to ``MAX_NN`` rows. Anything else (no source, no unpacking of
    ``q.shape``, both checks or neither) is returned as a reason string, which
    the caller treats as "cannot tell": stock.
    """
    try:
        return _q_contract_in(_source_tree(fn))
    except Exception as e:  # noqa: BLE001 - any failure means "cannot tell"
        return f"source unreadable: {type(e).__name__}: {e}"


def _q_rows(tree: ast.Module) -> tuple[ast.AST, str, str] | str:
    """The wrapper's function, its q parameter and the name it unpacks ``q.shape[1]`` into."""
    func = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if func is None:
        return "no function definition in its source"
    positional = [*func.args.posonlyargs, *func.args.args]
    if not positional:
        return "no positional q parameter"
    q_name = positional[0].arg
    rows_names = {
        target.elts[1].id
        for node in ast.walk(func)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "shape"
        and _is_name(node.value.value, q_name)
        for target in node.targets
        if isinstance(target, ast.Tuple) and len(target.elts) == 4 and isinstance(target.elts[1], ast.Name)
    }
    if len(rows_names) != 1:
        return f"no single 4-way unpacking of {q_name}.shape"
    (rows,) = rows_names
    return func, q_name, rows


def _source_tree(fn: Callable) -> ast.Module:
    return ast.parse(textwrap.dedent(inspect.getsource(fn)))


def gfx950_next_n_values(fn: Callable) -> frozenset[int] | str:
    """The ``next_n`` values an earlier gfx950 wrapper accepts, read from its source.

    That wrapper checks ``next_n not in (1, 2)`` (or ``in``) against a literal
    after unpacking ``q.shape``. Exactly one such check of positive ints
    ``1..k`` is accepted; anything else (no source, no check, two checks, a
    gap, a check against a name such as ``MAX_NN``) is returned as a reason
    string, which the caller treats as "cannot tell": stock.
    """
    try:
        found = _q_rows(_source_tree(fn))
    except Exception as e:  # noqa: BLE001 - any failure means "cannot tell"
        return f"source unreadable: {type(e).__name__}: {e}"
    if isinstance(found, str):
        return found
    func, q_name, rows = found
    checks = []
    for node in ast.walk(func):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
            if _is_name(left, rows) or _is_name(right, rows):
                checks.append((op, left, right))
    if len(checks) != 1:
        return f"{len(checks)} comparisons of {q_name}.shape[1], not one membership check"
    op, left, right = checks[0]
    if not (isinstance(op, (ast.In, ast.NotIn)) and _is_name(left, rows)):
        return f"{q_name}.shape[1] is compared with {type(op).__name__}, not a membership check"
    try:
        values = ast.literal_eval(right)
    except ValueError:
        return f"{q_name}.shape[1] is checked against a name, not a literal"
    if (
        not isinstance(values, (tuple, list, set, frozenset))
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        or set(values) != set(range(1, max(values) + 1))
    ):
        return f"{q_name}.shape[1] is checked against {values!r}, not 1..k"
    return frozenset(values)


def _q_contract_in(tree: ast.Module) -> str:
    found = _q_rows(tree)
    if isinstance(found, str):
        return found
    func, q_name, rows = found
    ranged = padded = False
    for node in ast.walk(func):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
            if isinstance(op, (ast.Lt, ast.LtE)) and _is_name(left, rows) and _is_name(right, "MAX_NN"):
                ranged = True
            elif isinstance(op, (ast.Gt, ast.GtE)) and _is_name(left, "MAX_NN") and _is_name(right, rows):
                ranged = True
            elif isinstance(op, (ast.Eq, ast.NotEq)) and _paired(left, right, rows, "MAX_NN"):
                padded = True
    if ranged == padded:
        found = "both" if ranged else "neither"
        return f"{found} of a range check and an equality check of {q_name}.shape[1] against MAX_NN"
    return Q_PADDED if padded else Q_NEXT_N


def _defining_module(fn: Callable, fallback: ModuleType | None) -> ModuleType | None:
    name = getattr(fn, "__module__", None)
    try:
        return importlib.import_module(name) if name else fallback
    except Exception:  # noqa: BLE001 - fall back to where it was found
        return fallback


def identify_dispatcher(module: ModuleType, location: str) -> KernelVariant | str:
    """The tuned dispatcher in ``module``, or why this is not it."""
    fn = getattr(module, DISPATCHER_NAME, None)
    config = getattr(module, DISPATCHER_CONFIG_NAME, None)
    if not callable(fn) or not callable(config):
        return f"no {DISPATCHER_NAME} with {DISPATCHER_CONFIG_NAME} (not aiter's tuned dispatcher)"
    params = _parameters(fn)
    if isinstance(params, str):
        return params
    if "Preshuffle" not in params or "KVBlockSize" not in params:
        return f"{DISPATCHER_NAME} lacks Preshuffle/KVBlockSize"
    run = getattr(module, DISPATCHER_RUN_NAME, None)
    if not callable(run):
        return f"no {DISPATCHER_RUN_NAME}: the self-test could not launch FlyDSL alone through it"
    return KernelVariant(
        "dispatcher",
        fn,
        location,
        Limits(),
        "aiter's tuned Gluon/FlyDSL dispatcher",
        own_table=True,
        dispatch_objection=functools.partial(
            _dispatcher_objection, config, getattr(module, DISPATCHER_SUPPORTS_NAME, None)
        ),
        flydsl=functools.partial(_forced_flydsl, run),
    )


def _forced_flydsl(
    run: Callable[..., object],
    q_fp8,
    kv_cache,
    weights,
    out,
    context_lens,
    block_tables,
    max_model_len: int,
    *,
    Preshuffle: bool,
    KVBlockSize: int,
) -> object:
    """The dispatcher made to launch FlyDSL whatever its table says, at its default SplitKV."""
    config = dict(FORCED_FLYDSL)
    args = (q_fp8, kv_cache, weights, out, context_lens, block_tables, max_model_len)
    return run(config, *args, Preshuffle, KVBlockSize)


def _dispatcher_objection(
    config: Callable[..., dict], supports: Callable[..., bool] | None, call: Call, preshuffle: bool
) -> str | None:
    """``None`` where aiter's dispatcher launches FlyDSL for ``call``, else why it would launch Gluon.

    Its table row (``get_paged_mqa_logits_config``, host-side and memoised by aiter) and, when it
    picks FlyDSL, ``flydsl_supports`` (shapes, dtypes, contiguity), exactly as the dispatcher asks.
    """
    batch, next_n, heads, head_dim = call.q_fp8.shape
    block_size = call.kv_cache.shape[1]
    backend = config(batch, next_n, heads, head_dim, block_size, preshuffle).get("backend")
    shape = f"batch={batch} next_n={next_n} heads={heads} head_dim={head_dim} KVBlockSize={block_size}"
    if backend != "flydsl":
        return f"aiter's dispatcher picks {backend} for {shape}: vLLM's own Gluon call runs"
    if supports is not None and not supports(call.q_fp8, call.kv_cache, call.weights, preshuffle, block_size):
        return f"aiter's dispatcher would not launch FlyDSL for {shape} ({DISPATCHER_SUPPORTS_NAME})"
    return None


def identify(fn: Callable, module: ModuleType | None) -> KernelVariant | str:
    """Identify ``fn`` (a kernel or the dispatcher) found in ``module``."""
    location = f"{getattr(module, '__name__', '?')}.{getattr(fn, '__name__', '?')}"
    if module is not None and getattr(fn, "__name__", None) == DISPATCHER_NAME:
        return identify_dispatcher(module, location)
    return identify_flydsl(fn, module, location)


@dataclass(frozen=True)
class KernelLookup:
    """The identified API (or ``None``) and what each probe found."""

    variant: KernelVariant | None
    reason: str

    @property
    def location(self) -> str | None:
        return self.variant.location if self.variant else None


def _import(path: str) -> ModuleType | str:
    try:
        return importlib.import_module(path)
    except Exception as e:  # noqa: BLE001 - any import failure is a reason
        return f"{path}: {type(e).__name__}: {e}"


def find_kernel() -> KernelLookup:
    """The dispatcher if aiter has it, else the first FlyDSL kernel found; never raises."""
    problems: list[str] = []
    module = _import(DISPATCHER_MODULE)
    if isinstance(module, str):
        problems.append(module)
    else:
        found = identify_dispatcher(module, f"{DISPATCHER_MODULE}.{DISPATCHER_NAME}")
        if isinstance(found, KernelVariant):
            return KernelLookup(found, "found")
        problems.append(f"{DISPATCHER_MODULE}: {found}")
    seen: list[Callable] = []
    for path in KERNEL_MODULES:
        module = _import(path)
        if isinstance(module, str):
            problems.append(module)
            continue
        fn = getattr(module, KERNEL_NAME, None)
        if not callable(fn):
            problems.append(f"{path}: no {KERNEL_NAME}")
            continue
        if any(fn is other for other in seen):
            problems.append(f"{path}: the same {KERNEL_NAME} (a re-export)")
            continue
        seen.append(fn)
        try:
            found = identify_flydsl(fn, module, f"{path}.{KERNEL_NAME}")
        except Exception as e:  # noqa: BLE001 - a probe reports, never raises
            found = f"identification failed ({type(e).__name__}: {e})"
        if isinstance(found, KernelVariant):
            return KernelLookup(found, "found")
        problems.append(f"{path}.{KERNEL_NAME}: {found}")
    return KernelLookup(None, "; ".join(problems))
