# SPDX-License-Identifier: Apache-2.0
"""What aiter has: which FlyDSL paged-MQA-logits API, its exact contract and its graph-safe launch, as values.

One public name has meant several kernels, so :func:`find_kernel` identifies what it found from
signatures, module constants and the wrapper's source, never from the name alone, and returns a
:class:`KernelVariant` carrying that API's contract (:class:`Limits` beyond :func:`common_violation`)
and launch (:meth:`KernelVariant.launch_kwargs`):

* ``dispatcher``: aiter's tuned dispatcher (PR #6140), ``aiter.paged_mqa_logits.paged_mqa_logits``
  beside ``get_paged_mqa_logits_config`` and ``run_paged_mqa_logits``. Preferred: its table picks
  Gluon or FlyDSL per shape; the router hands it only its FlyDSL picks, and the self-test forces
  FlyDSL through ``run_paged_mqa_logits``, as aiter's tuner does.
* ``gfx950``: the gfx950 kernel (``next_n_lens``, module constants ``NUM_HEADS``... ``MAX_NN``).
  Its automatic SplitKV reads ``context_lens.max().item()``, a host sync that breaks graph capture,
  so every launch passes SplitKV from shapes, as aiter's dispatcher computes it. A revision that
  takes q padded to ``MAX_NN`` rows (aiter f5b390371d) is refused: only its source tells it apart.
* ``gfx950-early``: an earlier revision (aiter 9661da3a): ``SUPPORTED_HEADS``, ``next_n`` as its
  wrapper's literal check allows; its own SplitKV rule, passed explicitly.
* ``general``: aiter PR #4221's kernel (``ChunkK``, ``WavePerEU``, ``variant``): launched with
  KVBlockSize and Preshuffle only; its other knobs keep their defaults.

Anything else keeps vLLM stock, with the reason. Importing aiter can fail with errors other than
ImportError (an aiter/flydsl mismatch), so every probe catches any exception. Imports no vLLM.
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

import torch

from vllm_flydsl_indexer.target import I32_OFFSET_LIMIT, SCALE_BYTES, Call

__all__ = [
    "AITER_DISTRIBUTIONS", "BLOCK_OUTER_LAYOUTS", "BLOCK_OUTER_NOTE", "DISPATCHER_MODULE",
    "GFX950_EARLY_WORKGROUPS_PER_CU", "KERNEL_MODULES", "KERNEL_NAME", "KernelLookup", "KernelVariant",
    "LAYOUT_VARIABLE", "Limits", "MIN_HEAD_DIM_MULTIPLE", "MIN_HEAD_MULTIPLE", "PRESHUFFLE_ALIGN", "Q_NEXT_N",
    "Q_PADDED", "TUNER_WG_PER_CU", "WORKGROUPS_PER_CU", "common_violation", "cu_count", "explicit_split_kv",
    "find_kernel", "gfx950_next_n_values", "gfx950_q_contract", "identify", "identify_dispatcher",
    "identify_flydsl", "installed_version", "strided_cache_reason",
]  # fmt: skip

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
PRESHUFFLE_ALIGN = 16
MIN_HEAD_MULTIPLE = 32
MIN_HEAD_DIM_MULTIPLE = 64
# aiter's dispatcher: workgroups per CU when it picks SplitKV for FlyDSL (its FLYDSL_DEFAULT_WG_PER_CU,
# aiter/paged_mqa_logits.py at 1eb1a7b5), and what its tuner sweeps (FLYDSL_WG_PER_CU, csrc/
# paged_mqa_logits/paged_mqa_logits_tune.py).
WORKGROUPS_PER_CU = 3
TUNER_WG_PER_CU = (1, 2, 3, 4)
# The earlier gfx950 kernel's own automatic SplitKV: ``total_cu * 4 * 2`` one-wave workgroups.
GFX950_EARLY_WORKGROUPS_PER_CU = 8

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
# aiter's ROCm wheels are published as amd-aiter ("aiter" on PyPI is an unrelated library).
AITER_DISTRIBUTIONS = ("amd-aiter", "aiter")
Q_NEXT_N = "next_n"
Q_PADDED = "padded"


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class Limits:
    """What a kernel API accepts beyond the common contract. ``None``: the general rule."""

    heads: frozenset[int] | None = None
    head_dims: frozenset[int] | None = None
    block_sizes: frozenset[int] | None = None
    index_dim: int | None = None
    max_next_n: int | None = None
    preshuffle_required: bool = False
    # q only when contiguous: the later gfx950 wrapper raises otherwise, and the earlier one reads q in
    # dwords at q's strides, assuming a dense head_dim (vLLM's q is contiguous, so nothing is lost).
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


def common_violation(q_fp8, kv_cache, weights, context_lens, block_tables) -> str | None:
    """Why the call breaks what every FlyDSL API takes, or ``None`` (the cache's contiguity is a rule of
    its own, part of the router's memo key)."""
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
    if not weights.is_contiguous():  # aiter's gfx950 wrapper asserts it, its dispatcher requires it
        return f"weights are not contiguous (strides {tuple(weights.stride())})"
    if (
        context_lens.dtype != torch.int32
        or context_lens.dim() not in (1, 2)
        or context_lens.shape[0] != batch
    ):
        return f"context_lens ({context_lens.dtype}, {tuple(context_lens.shape)}) are not int32 with B rows"
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        return f"block_tables ({block_tables.dtype}, {block_tables.dim()}-D) are not int32 (B, max_blocks)"
    return None


def strided_cache_reason(kv_cache: torch.Tensor) -> str:
    """The stock-path reason for a cache view that is not layer-contiguous, in actionable words."""
    blocks, block_size, _, index_dim = (tuple(kv_cache.shape) + (0, 0, 0, 0))[:4]
    return (
        f"kv_cache is strided (block stride {kv_cache.stride(0) if kv_cache.dim() else '?'} bytes, "
        f"not KVBlockSize*index_dim = {block_size * index_dim}), so this layer stays on the stock path. "
        f"{BLOCK_OUTER_NOTE}"
    )


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
    """aiter's dispatcher rule, ``max(1, min(pages, ceil(cu * wg_per_cu / batch)))``, ``pages`` the KV
    blocks of ``max_model_len``; shapes only. With ``workgroups_per_cu=8``, the earlier gfx950 rule."""
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
    # Picks Gluon or FlyDSL itself from aiter's own table (the dispatcher): the plugin's is not used.
    own_table: bool = False
    # The dispatcher's own choice for (call, Preshuffle), from shapes: ``None`` where it launches FlyDSL,
    # else why not (where it would launch Gluon with its own knobs, vLLM's original runs instead).
    dispatch_objection: Callable[[Call, bool], str | None] | None = None
    # FlyDSL itself with ``fn``'s signature, for the self-test, where ``fn`` is not the kernel (the
    # dispatcher's ``run_paged_mqa_logits`` forced to FlyDSL).
    flydsl: Callable[..., object] | None = None

    def violation(self, call: Call) -> str | None:
        """Why this API cannot take the call exactly, or ``None``."""
        q_fp8, kv_cache = call.q_fp8, call.kv_cache
        problem = common_violation(*call[:5])
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

    def knob_problem(self, wg_per_cu: int) -> str | None:
        """Why a tuned FlyDSL row's ``wg_per_cu`` cannot be launched here as measured, or ``None``:
        ``0`` is the default launch; a positive value sets SplitKV, which only the gfx950 APIs take."""
        if wg_per_cu == 0 or self.split_kv_workgroups_per_cu is not None:
            return None
        return (
            f"wg_per_cu={wg_per_cu}, a SplitKV that the {self.name} FlyDSL kernel is not launched with "
            "(this package passes it no SplitKV), so it cannot launch what was measured"
        )

    def launch_kwargs(
        self, batch: int, block_size: int, max_model_len: int, cus: int, wg_per_cu: int = 0
    ) -> dict[str, object]:
        """Every launch's keyword arguments for this shape, from shapes only: KVBlockSize and Preshuffle;
        for the gfx950 APIs an explicit SplitKV from ``wg_per_cu`` (a tuned row's knob; ``0``: this
        API's default), as aiter's dispatcher computes it."""
        kwargs: dict[str, object] = {"Preshuffle": self.preshuffle(block_size), "KVBlockSize": block_size}
        if self.split_kv_workgroups_per_cu is not None:
            wg = wg_per_cu or self.split_kv_workgroups_per_cu
            kwargs["SplitKV"] = explicit_split_kv(cus, batch, max_model_len, block_size, wg)
        elif wg_per_cu:
            raise ValueError(self.knob_problem(wg_per_cu))
        return kwargs

    def self_test_launches(
        self, kwargs: dict[str, object], top_split_kv: int
    ) -> dict[str, dict[str, object]]:
        """The self-test's launches of a shape whose live launches take ``kwargs``, by name: SplitKV 1
        and ``top_split_kv`` (the largest a live launch reaches) where SplitKV is passed, else ``kwargs``."""
        if "SplitKV" not in kwargs:
            return {"at its default launch": kwargs}
        return {f"at SplitKV {s}": {**kwargs, "SplitKV": s} for s in sorted({1, top_split_kv})}

    def describe_launch(self, wg_per_cu: int) -> str:
        """The knob of a launch, for the first-taken log line."""
        if self.own_table:
            return "aiter's dispatcher picks the arm and its knobs from its own table"
        if self.split_kv_workgroups_per_cu is None:
            return "the kernel's default launch"
        if wg_per_cu:
            return f"SplitKV from wg_per_cu={wg_per_cu}"
        return f"SplitKV from wg_per_cu={self.split_kv_workgroups_per_cu} (default)"


# --- Identification (start-up only). ---


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
    if isinstance(value, int) and not isinstance(value, bool):
        return frozenset({value})
    ints = isinstance(value, (tuple, list, set, frozenset)) and value
    if ints and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return frozenset(value)
    return None


def _parameters(fn: Callable) -> dict[str, inspect.Parameter] | str:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        return f"signature unreadable ({e})"


def _keyword_only(params: dict[str, inspect.Parameter], name: str) -> bool:
    return name in params and params[name].kind is inspect.Parameter.KEYWORD_ONLY


def _constants(fn: Callable, module: ModuleType | None, names: Iterable[str]) -> dict[str, frozenset | None]:
    """The module constants of ``fn``'s defining module (else ``module``), as sets of ints."""
    try:
        source = importlib.import_module(fn.__module__) if getattr(fn, "__module__", None) else module
    except Exception:  # noqa: BLE001 - fall back to where it was found
        source = module
    return {name: _as_set(getattr(source, name, None)) for name in names}


def identify_flydsl(fn: Callable, module: ModuleType | None, location: str) -> KernelVariant | str:
    """The variant of a ``flydsl_fp8_paged_mqa_logits`` found at ``location``, or why it is unknown."""
    params = _parameters(fn)
    if isinstance(params, str):
        return params
    missing = [n for n in ("Preshuffle", "KVBlockSize") if not _keyword_only(params, n)]
    if missing:
        return f"lacks keyword-only {', '.join(missing)}"
    general_knobs = {"ChunkK", "WavePerEU", "variant"}
    if "next_n_lens" in params and not general_knobs & set(params):
        if not _keyword_only(params, "SplitKV"):
            return "gfx950-style API without a keyword-only SplitKV (cannot launch it graph-safely)"
        constants = _constants(fn, module, ("NUM_HEADS", "HEAD_DIM", "KV_BLOCK_SIZE", "INDEX_DIM", "MAX_NN"))
        unreadable = [name for name, value in constants.items() if value is None]
        if unreadable:
            return f"gfx950-style API whose module lacks readable {', '.join(unreadable)}"
        if len(constants["INDEX_DIM"]) != 1 or len(constants["MAX_NN"]) != 1:
            return "gfx950-style API with ambiguous INDEX_DIM or MAX_NN"
        (index_dim,), (max_nn,) = constants["INDEX_DIM"], constants["MAX_NN"]
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
            constants["NUM_HEADS"],
            constants["HEAD_DIM"],
            constants["KV_BLOCK_SIZE"],
            index_dim,
            max_nn,
            True,
            True,
        )
        return KernelVariant(
            "gfx950", fn, location, limits, "gfx950-specialised FlyDSL kernel", WORKGROUPS_PER_CU
        )
    if general_knobs <= set(params) and "next_n_lens" not in params:
        return KernelVariant("general", fn, location, Limits(), "general FlyDSL kernel (aiter PR #4221)")
    if "next_n_lens" in params or general_knobs & set(params):
        return "an API of an unknown shape (neither the PR #4221 kernel nor the gfx950 kernel)"
    # The earlier gfx950 revision: SUPPORTED_HEADS, no next_n_lens.
    if not _keyword_only(params, "SplitKV"):
        return (
            "an API of an unknown shape (no next_n_lens, no ChunkK/WavePerEU/variant and no "
            "keyword-only SplitKV)"
        )
    constants = _constants(fn, module, ("SUPPORTED_HEADS", "HEAD_DIM", "KV_BLOCK_SIZE", "INDEX_DIM"))
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
        constants["SUPPORTED_HEADS"],
        constants["HEAD_DIM"],
        constants["KV_BLOCK_SIZE"],
        index_dim,
        max(next_ns),
        True,
        True,
    )
    description = "gfx950-specialised FlyDSL kernel, earlier revision (SUPPORTED_HEADS, no next_n_lens)"
    return KernelVariant("gfx950-early", fn, location, limits, description, GFX950_EARLY_WORKGROUPS_PER_CU)


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _paired(left: ast.AST, right: ast.AST, a: str, b: str) -> bool:
    """``a == b`` or ``(.., a, ..) == (.., b, ..)`` at the same position, either side."""
    if (_is_name(left, a) and _is_name(right, b)) or (_is_name(left, b) and _is_name(right, a)):
        return True
    if isinstance(left, ast.Tuple) and isinstance(right, ast.Tuple) and len(left.elts) == len(right.elts):
        return any(_paired(x, y, a, b) for x, y in zip(left.elts, right.elts, strict=True))
    return False


def _q_row_checks(fn: Callable) -> tuple[str, str, list[tuple[ast.cmpop, ast.AST, ast.AST]]] | str:
    """A gfx950 wrapper's q parameter, the name it unpacks ``q.shape[1]`` into, and every comparison
    that names it, read from its source; or why that cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except Exception as e:  # noqa: BLE001 - any failure means "cannot tell"
        return f"source unreadable: {type(e).__name__}: {e}"
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
    checks = []
    for node in ast.walk(func):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            checks += [
                (op, left, right)
                for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True)
                if _is_name(left, rows) or _is_name(right, rows) or _paired(left, right, rows, "MAX_NN")
            ]
    return q_name, rows, checks


def gfx950_q_contract(fn: Callable) -> str:
    """How a gfx950 wrapper checks q's second dimension, read from its source: ``Q_NEXT_N`` where it
    range-checks it against ``MAX_NN`` (``1 <= next_n <= MAX_NN``), ``Q_PADDED`` where it requires it to
    equal ``MAX_NN``; anything else (no source, both checks or neither) a reason: "cannot tell"."""
    found = _q_row_checks(fn)
    if isinstance(found, str):
        return found
    q_name, rows, checks = found
    ranged = padded = False
    for op, left, right in checks:
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


def gfx950_next_n_values(fn: Callable) -> frozenset[int] | str:
    """The ``next_n`` values an earlier gfx950 wrapper accepts: its one membership check of
    ``q.shape[1]`` against a literal of ints ``1..k``; anything else a reason: "cannot tell"."""
    found = _q_row_checks(fn)
    if isinstance(found, str):
        return found
    q_name, rows, checks = found
    checks = [c for c in checks if _is_name(c[1], rows) or _is_name(c[2], rows)]
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
    supports = getattr(module, DISPATCHER_SUPPORTS_NAME, None)

    def dispatch_objection(call: Call, preshuffle: bool) -> str | None:
        """Its table row (``get_paged_mqa_logits_config``, host-side, memoised by aiter) and, for FlyDSL,
        ``flydsl_supports``, exactly as the dispatcher asks: ``None`` where it launches FlyDSL."""
        batch, next_n, heads, head_dim = call.q_fp8.shape
        block_size = call.kv_cache.shape[1]
        backend = config(batch, next_n, heads, head_dim, block_size, preshuffle).get("backend")
        shape = f"batch={batch} next_n={next_n} heads={heads} head_dim={head_dim} KVBlockSize={block_size}"
        if backend != "flydsl":
            return f"aiter's dispatcher picks {backend} for {shape}: vLLM's own Gluon call runs"
        if supports is not None and not supports(
            call.q_fp8, call.kv_cache, call.weights, preshuffle, block_size
        ):
            return f"aiter's dispatcher would not launch FlyDSL for {shape} ({DISPATCHER_SUPPORTS_NAME})"
        return None

    def forced_flydsl(q, kv, weights, out, lens, tables, max_model_len: int, *, Preshuffle, KVBlockSize):
        """The dispatcher made to launch FlyDSL whatever its table says, at its default SplitKV."""
        return run(
            dict(FORCED_FLYDSL), q, kv, weights, out, lens, tables, max_model_len, Preshuffle, KVBlockSize
        )

    description = "aiter's tuned Gluon/FlyDSL dispatcher"
    return KernelVariant(
        "dispatcher", fn, location, Limits(), description, None, True, dispatch_objection, forced_flydsl
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


def find_kernel() -> KernelLookup:
    """The dispatcher if aiter has it, else the first FlyDSL kernel found; never raises."""
    problems: list[str] = []
    seen: list[Callable] = []
    for path in (DISPATCHER_MODULE, *KERNEL_MODULES):
        try:
            module = importlib.import_module(path)
        except Exception as e:  # noqa: BLE001 - any import failure is a reason
            problems.append(f"{path}: {type(e).__name__}: {e}")
            continue
        if path == DISPATCHER_MODULE:
            found = identify_dispatcher(module, f"{DISPATCHER_MODULE}.{DISPATCHER_NAME}")
            if isinstance(found, KernelVariant):
                return KernelLookup(found, "found")
            problems.append(f"{path}: {found}")
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
