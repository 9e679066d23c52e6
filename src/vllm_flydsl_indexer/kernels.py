# SPDX-License-Identifier: Apache-2.0
"""Which FlyDSL paged-MQA-logits API the installed aiter has, and its exact contract.

One public name has meant several kernels, so the lookup identifies what it
found from signatures and module constants, never from the name alone:

* ``dispatcher``: aiter's tuned dispatcher (aiter PR #6140),
  ``aiter.paged_mqa_logits.paged_mqa_logits`` beside
  ``get_paged_mqa_logits_config``. Its measured table picks Gluon or FlyDSL
  per shape and it falls back to vLLM's exact Gluon call, so it is preferred.
  Identified by both functions (a fork ships an unrelated module of that name).
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
import inspect
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType

import torch

from vllm_flydsl_indexer.target import I32_OFFSET_LIMIT, SCALE_BYTES, Call, RouterView

# vLLM's KV cache layouts with the block dimension outside the layer dimension
# (vllm/v1/kv_cache_layout.py; tests/test_drift.py pins them).
BLOCK_OUTER_LAYOUTS = ("BLHNC", "BLNHC", "BHLNC")
LAYOUT_VARIABLE = "VLLM_KV_CACHE_LAYOUT"
BLOCK_OUTER_NOTE = (
    "FlyDSL needs a layer-contiguous indexer cache (vLLM's default LBNHC, or LBHNC). A block-outer KV cache "
    "layout (BLHNC/BLNHC, BHLNC) packs every layer's page inside each block, so each layer's indexer cache "
    "is strided and every call stays stock: DeepSeek-V4/V4.1 and GLM-5-next (kpool tail cache) "
    f"require one; {LAYOUT_VARIABLE} or a KV connector can choose one for DeepSeek-V3.2 and GLM-5.x."
)

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

PRESHUFFLE_ALIGN = 16
MIN_HEAD_MULTIPLE = 32
MIN_HEAD_DIM_MULTIPLE = 64
# aiter's dispatcher: workgroups per CU when it picks SplitKV for FlyDSL.
WORKGROUPS_PER_CU = 3
# The earlier gfx950 kernel's own automatic SplitKV: ``total_cu * 4 * 2``
# one-wave workgroups, capped by the pages of ``max_model_len``.
GFX950_EARLY_WORKGROUPS_PER_CU = 8


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


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


@dataclass(frozen=True)
class Limits:
    """What a kernel API accepts beyond the common contract. ``None``: the general rule."""

    heads: frozenset[int] | None = None
    head_dims: frozenset[int] | None = None
    block_sizes: frozenset[int] | None = None
    index_dim: int | None = None
    max_next_n: int | None = None
    preshuffle_required: bool = False
    # Take q only when contiguous: the later gfx950 wrapper raises otherwise,
    # and the earlier one reads q in dwords at q's strides, assuming a dense
    # head_dim (vLLM's q is contiguous, so nothing is lost).
    q_contiguous: bool = False

    def violation(
        self, heads: int, head_dim: int, block_size: int, index_dim: int, next_n: int
    ) -> str | None:
        if self.heads is None:
            if not _is_pow2(heads) or heads % MIN_HEAD_MULTIPLE:
                return f"heads={heads} is not a power of two and a multiple of 32"
        elif heads not in self.heads:
            return f"heads={heads} is not one of {sorted(self.heads)}"
        if self.head_dims is None:
            if not _is_pow2(head_dim) or head_dim % MIN_HEAD_DIM_MULTIPLE:
                return f"head_dim={head_dim} is not a power of two and a multiple of 64"
        elif head_dim not in self.head_dims:
            return f"head_dim={head_dim} is not one of {sorted(self.head_dims)}"
        if self.block_sizes is None:
            if block_size > 1 and block_size % PRESHUFFLE_ALIGN:
                return f"KVBlockSize={block_size} is not 1 or a multiple of 16"
        elif block_size not in self.block_sizes:
            return f"KVBlockSize={block_size} is not one of {sorted(self.block_sizes)}"
        if self.preshuffle_required and block_size == 1:
            return "KVBlockSize=1 (no preshuffle) but this kernel requires Preshuffle"
        if self.index_dim is not None and index_dim != self.index_dim:
            return f"kv_cache index_dim={index_dim} is not {self.index_dim}"
        if self.max_next_n is not None and next_n > self.max_next_n:
            return f"next_n={next_n} is above this kernel's maximum {self.max_next_n}"
        return None


def common_violation(
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> str | None:
    """Why the call breaks what every FlyDSL API takes, or ``None``.

    The cache's contiguity is :func:`contiguity_rule`'s (part of the router's memo key).
    """
    if q_fp8.dim() != 4:
        return f"q_fp8 is {q_fp8.dim()}-D, not (B, next_n, H, D)"
    batch, next_n, heads, head_dim = q_fp8.shape
    if q_fp8.dtype != torch.float8_e4m3fn:
        return f"q_fp8 dtype {q_fp8.dtype} is not float8_e4m3fn"
    if kv_cache.dtype != torch.uint8:
        return f"kv_cache dtype {kv_cache.dtype} is not uint8"
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        return f"kv_cache shape {tuple(kv_cache.shape)} is not (blocks, KVB, 1, dim)"
    num_blocks, block_size, _, index_dim = kv_cache.shape
    if index_dim < head_dim + SCALE_BYTES:
        return f"kv_cache index_dim={index_dim} < head_dim + 4"
    if num_blocks * block_size * index_dim >= I32_OFFSET_LIMIT:
        return "kv_cache pool is 2**31 bytes or more (FlyDSL uses i32 offsets)"
    if weights.dtype != torch.float32 or tuple(weights.shape) != (batch * next_n, heads):
        return f"weights ({weights.dtype}, {tuple(weights.shape)}) are not float32 (B*next_n, H)"
    if (
        context_lens.dtype != torch.int32
        or context_lens.dim() not in (1, 2)
        or context_lens.shape[0] != batch
    ):
        return f"context_lens ({context_lens.dtype}, {tuple(context_lens.shape)}) are not int32 with B rows"
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        return f"block_tables ({block_tables.dtype}, {block_tables.dim()}-D) are not int32 (B, max_blocks)"
    return None


@functools.lru_cache(maxsize=16)
def _device_cu_count(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index if index is not None else 0).multi_processor_count
    return 1


def cu_count(device: torch.device) -> int:
    """Compute units of ``device`` (a host-side property read, cached; no sync)."""
    return _device_cu_count(device.type, device.index)


def explicit_split_kv(
    cus: int, batch: int, max_model_len: int, block_size: int, workgroups_per_cu: int = WORKGROUPS_PER_CU
) -> int:
    """aiter's dispatcher rule: ``max(1, min(pages, ceil(cu * wg_per_cu / batch)))``.

    ``pages`` counts the KV blocks of ``max_model_len``. Shapes only: no device read.
    With ``workgroups_per_cu=8`` it is the earlier gfx950 wrapper's own automatic rule.
    """
    pages = -(-max_model_len // block_size)
    return max(1, min(pages, -(-cus * workgroups_per_cu // max(batch, 1))))


@dataclass(frozen=True)
class KernelVariant:
    """One identified FlyDSL API: its name, function, contract and graph-safe launch."""

    name: str
    fn: Callable[..., torch.Tensor]
    location: str
    limits: Limits
    description: str
    # Workgroups per CU of the explicit SplitKV every launch passes; ``None``: SplitKV not passed.
    split_kv_workgroups_per_cu: int | None = None
    # Picks Gluon or FlyDSL itself from aiter's own tuned table (the dispatcher): the plugin's
    # table is not used, and Gluon's -inf past the read windows may be written.
    own_table: bool = False

    def violation(self, call: Call) -> str | None:
        """Why this API cannot take the call exactly, or ``None``."""
        q_fp8, kv_cache, weights, context_lens, block_tables = call[:5]
        problem = common_violation(q_fp8, kv_cache, weights, context_lens, block_tables)
        if problem is not None:
            return problem
        _, next_n, heads, head_dim = q_fp8.shape
        problem = self.limits.violation(heads, head_dim, kv_cache.shape[1], kv_cache.shape[3], next_n)
        if problem is not None:
            return f"{problem} ({self.name} FlyDSL kernel)"
        if self.limits.q_contiguous and not q_fp8.is_contiguous():
            return f"q_fp8 is not contiguous ({self.name} FlyDSL kernel)"
        return None

    def takes_shape(self, heads: int, head_dim: int, block_size: int, next_n: int) -> bool:
        """Whether this API's limits take vLLM's cache at this shape (for reports)."""
        index_dim = self.limits.index_dim or head_dim + SCALE_BYTES
        return self.limits.violation(heads, head_dim, block_size, index_dim, next_n) is None

    @staticmethod
    def preshuffle(block_size: int) -> bool:
        """The ``Preshuffle`` this package launches a ``block_size`` cache with: vLLM's ROCm layout rule."""
        return block_size > 1

    def launch_kwargs(self, batch: int, block_size: int, max_model_len: int, cus: int) -> dict[str, object]:
        """The keyword arguments of every launch of this shape: shapes only, so graph-safe.

        KVBlockSize and Preshuffle always; an explicit SplitKV for the gfx950
        kernels: the later one's automatic SplitKV reads device memory on the
        host, and the earlier one's gets the value its own rule would compute.
        """
        kwargs: dict[str, object] = {"Preshuffle": self.preshuffle(block_size), "KVBlockSize": block_size}
        if self.split_kv_workgroups_per_cu is not None:
            kwargs["SplitKV"] = explicit_split_kv(
                cus, batch, max_model_len, block_size, self.split_kv_workgroups_per_cu
            )
        return kwargs

    def launch(
        self,
        q_fp8: torch.Tensor,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        out_logits: torch.Tensor,
        per_sequence_lens: torch.Tensor,
        block_tables: torch.Tensor,
        max_model_len: int,
        cu_count: int,
    ) -> torch.Tensor:
        """One launch writing ``out_logits`` in place: no prefill, no host read.

        The router calls ``fn`` with memoised :meth:`launch_kwargs` instead; this
        is the same launch, for tools and tests.
        """
        kwargs = self.launch_kwargs(q_fp8.shape[0], kv_cache.shape[1], max_model_len, cu_count)
        self.fn(
            q_fp8, kv_cache, weights, out_logits, per_sequence_lens, block_tables, max_model_len, **kwargs
        )
        return out_logits


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
    return KernelVariant(
        "dispatcher", fn, location, Limits(), "aiter's tuned Gluon/FlyDSL dispatcher", own_table=True
    )


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
    def kernel(self) -> Callable | None:
        return self.variant.fn if self.variant else None

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


def strided_cache_reason(kv_cache: torch.Tensor) -> str:
    """The stock-path reason for a cache view that is not layer-contiguous, in actionable words."""
    blocks, block_size, _, index_dim = (tuple(kv_cache.shape) + (0, 0, 0, 0))[:4]
    return (
        f"kv_cache is strided (block stride {kv_cache.stride(0) if kv_cache.dim() else '?'} bytes, "
        f"not KVBlockSize*index_dim = {block_size * index_dim}), so this layer stays on the stock path. "
        f"{BLOCK_OUTER_NOTE}"
    )


def contiguity_rule(call: Call, router: RouterView) -> str | None:
    """Every FlyDSL API needs a layer-contiguous cache: checked live (strides are not memoised)."""
    return None if call.kv_cache.is_contiguous() else strided_cache_reason(call.kv_cache)


def contract_rule(call: Call, router: RouterView) -> str | None:
    """The found API's exact contract: the common one plus its own limits."""
    return router.variant.violation(call)
