# SPDX-License-Identifier: Apache-2.0
"""What aiter has: which FlyDSL paged-MQA-logits API, its exact contract and its graph-safe launch, as values.

One public name has meant several kernels, so :func:`find_kernel` identifies what it found from signatures,
module constants and the wrapper's source, never the name alone, as a :class:`KernelVariant` carrying that
API's contract and launch: ``dispatcher`` (aiter's tuned dispatcher, PR #6140; preferred), ``gfx950`` (the
gfx950 kernel with ``next_n_lens``; its automatic SplitKV syncs the host, so every launch passes one from
shapes) or ``general`` (PR #4221's kernel). Two revisions aiter moved past are refused
(:data:`UNSUPPORTED`); anything else keeps stock with the reason (``docs/aiter-kernels.md``). A
``flydsl_fp8_paged_mqa_logits_gfx950`` beside the general kernel (two unreleased aiter revisions, f33a573e
and 6c1c496c; later aiter made the name an alias of the gfx950 kernel) is not used: the general kernel is.
Importing aiter can raise more than ImportError: every probe catches anything.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from vllm_flydsl_indexer.target import I32_OFFSET_LIMIT, SCALE_BYTES, parameters_of

BLOCK_OUTER_NOTE = (
    "FlyDSL needs a layer-contiguous indexer cache (vLLM's default LBNHC, or LBHNC). A block-outer KV cache "
    "layout (BLHNC/BLNHC, BHLNC) packs every layer's page inside each block, so each layer's indexer cache "
    "is strided and every call stays stock: DeepSeek-V4/V4.1 and GLM-5-next (kpool tail cache) "
    "require one; VLLM_KV_CACHE_LAYOUT or a KV connector can choose one for DeepSeek-V3.2 and GLM-5.x."
)
# aiter's dispatcher's FLYDSL_DEFAULT_WG_PER_CU and its tuner's FLYDSL_WG_PER_CU (at 1eb1a7b5).
WORKGROUPS_PER_CU = 3
TUNER_WG_PER_CU = (1, 2, 3, 4)
KERNEL_NAME = "flydsl_fp8_paged_mqa_logits"
# Probed in order after the dispatcher: the re-export, the PR branch's module, earlier revisions.
KERNEL_MODULES = (
    "aiter.ops.flydsl",
    "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits",
    "aiter.ops.flydsl.kernels.fp8_paged_mqa_logits",
)
DISPATCHER_MODULE = "aiter.paged_mqa_logits"
# aiter's ROCm wheels are published as amd-aiter ("aiter" on PyPI is an unrelated library).
AITER_DISTRIBUTIONS = ("amd-aiter", "aiter")
SUPPORTED = (
    "supported: aiter's tuned dispatcher (PR #6140), the gfx950 kernel with next_n_lens, "
    "PR #4221's general kernel"
)
UNSUPPORTED = {
    "early": "the earlier gfx950 kernel (SUPPORTED_HEADS, no next_n_lens; aiter 9661da3a)",
    "padded": "the gfx950 kernel that takes q padded to MAX_NN rows (aiter f5b390371d)",
}


def _pow2_multiple(n: int, of: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0 and n % of == 0


@dataclass(frozen=True)
class KernelVariant:
    """One identified FlyDSL API: its function, contract (``None``: the general rule) and launch."""

    name: str
    fn: Callable[..., object]
    location: str
    description: str
    heads: frozenset[int] | None = None
    head_dims: frozenset[int] | None = None
    block_sizes: frozenset[int] | None = None
    index_dim: int | None = None
    max_next_n: int | None = None
    # The gfx950 API: Preshuffle on, q contiguous (its wrapper raises otherwise), an explicit SplitKV at
    # this many workgroups per CU (``None``: SplitKV not passed).
    gfx950: bool = False
    split_kv_workgroups_per_cu: int | None = None
    # Picks Gluon or FlyDSL itself from aiter's own table (the dispatcher): the plugin's is not used.
    own_table: bool = False
    # The dispatcher's own choice for (args, Preshuffle), from shapes: ``None`` where it launches FlyDSL.
    dispatch_objection: Callable[[tuple, bool], str | None] | None = None
    # FlyDSL itself with ``fn``'s signature, for the self-test, where ``fn`` is not the kernel.
    flydsl: Callable[..., object] | None = None

    def shape_violation(
        self, heads: int, head_dim: int, block_size: int, index_dim: int, next_n: int
    ) -> str | None:
        """Why this API does not take the shape, or ``None``."""
        if self.heads is None and not _pow2_multiple(heads, 32):
            return f"heads={heads} is not a power of two and a multiple of 32"
        if self.heads is not None and heads not in self.heads:
            return f"heads={heads} is not one of {sorted(self.heads)}"
        if self.head_dims is None and not _pow2_multiple(head_dim, 64):
            return f"head_dim={head_dim} is not a power of two and a multiple of 64"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"head_dim={head_dim} is not one of {sorted(self.head_dims)}"
        if self.block_sizes is None and block_size > 1 and block_size % 16:
            return f"KVBlockSize={block_size} is not 1 or a multiple of 16"
        if self.block_sizes is not None and block_size not in self.block_sizes:
            return f"KVBlockSize={block_size} is not one of {sorted(self.block_sizes)}"
        if self.gfx950 and block_size == 1:
            return "KVBlockSize=1 (no preshuffle) but this kernel requires Preshuffle"
        if self.index_dim is not None and index_dim != self.index_dim:
            return f"kv_cache index_dim={index_dim} is not {self.index_dim}"
        if self.max_next_n is not None and next_n > self.max_next_n:
            return f"next_n={next_n} is above this kernel's maximum {self.max_next_n}"
        return None

    def violation(self, q_fp8, kv_cache, weights, lens, tables) -> str | None:
        """Why this API cannot take the call exactly, or ``None`` (the cache's contiguity is a rule of its
        own, part of the router's memo key)."""
        if q_fp8.dim() != 4:
            return f"q_fp8 is {q_fp8.dim()}-D, not (B, next_n, H, D)"
        batch, next_n, heads, head_dim = q_fp8.shape
        if q_fp8.dtype != torch.float8_e4m3fn:
            return f"q_fp8 dtype {q_fp8.dtype} is not float8_e4m3fn"
        if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
            return f"kv_cache ({kv_cache.dtype}, {tuple(kv_cache.shape)}) is not uint8 (blocks, KVB, 1, dim)"
        num_blocks, block_size, _, index_dim = kv_cache.shape
        if index_dim < head_dim + SCALE_BYTES:
            return f"kv_cache index_dim={index_dim} < head_dim + 4"
        if num_blocks * block_size * index_dim >= I32_OFFSET_LIMIT:
            return "kv_cache pool is 2**31 bytes or more (FlyDSL uses i32 offsets)"
        # A reason names no batch-sized dimension: the stock line is logged once per shape, not per batch.
        if weights.dtype != torch.float32 or tuple(weights.shape) != (batch * next_n, heads):
            return f"weights ({weights.dtype}, {weights.dim()}-D) are not float32 (B*next_n, {heads})"
        if not weights.is_contiguous():  # aiter's gfx950 wrapper asserts it, its dispatcher requires it
            return "weights are not contiguous"
        if lens.dtype != torch.int32 or lens.dim() not in (1, 2) or len(lens) != batch:
            return f"context_lens ({lens.dtype}, {lens.dim()}-D) are not int32 with B rows"
        if tables.dtype != torch.int32 or tables.dim() != 2 or len(tables) != batch:
            return f"block_tables ({tables.dtype}, {tables.dim()}-D) are not int32 (B, max_blocks)"
        problem = self.shape_violation(heads, head_dim, block_size, index_dim, next_n)
        if problem is None and self.gfx950 and not q_fp8.is_contiguous():
            problem = "q_fp8 is not contiguous"
        return None if problem is None else f"{problem} ({self.name} FlyDSL kernel)"

    def knob_problem(self, wg_per_cu: int) -> str | None:
        """Why a tuned FlyDSL row's ``wg_per_cu`` cannot be launched as measured (``0``: the default launch;
        a positive value sets SplitKV, which only the gfx950 API takes), or ``None``."""
        if wg_per_cu == 0 or self.split_kv_workgroups_per_cu is not None:
            return None
        return (
            f"wg_per_cu={wg_per_cu}, a SplitKV that the {self.name} FlyDSL kernel is not launched with "
            "(this package passes it no SplitKV), so it cannot launch what was measured"
        )

    def launch_kwargs(
        self, batch: int, block_size: int, max_model_len: int, cus: int, wg_per_cu: int = 0
    ) -> dict:
        """A launch's keyword arguments, from shapes only: KVBlockSize, Preshuffle (``block_size > 1``) and,
        for the gfx950 API, aiter's dispatcher's SplitKV at ``wg_per_cu`` (a tuned row's; ``0``: default)."""
        kwargs: dict[str, object] = {"Preshuffle": block_size > 1, "KVBlockSize": block_size}
        if self.split_kv_workgroups_per_cu is not None:
            wg = wg_per_cu or self.split_kv_workgroups_per_cu
            kwargs["SplitKV"] = explicit_split_kv(cus, batch, max_model_len, block_size, wg)
        elif wg_per_cu:
            raise ValueError(self.knob_problem(wg_per_cu))
        return kwargs


def shape_of(q, kv) -> tuple:
    """What FlyDSL compiles: ``(heads, head_dim, KVBlockSize, next_n)``."""
    return q.shape[2], q.shape[3], kv.shape[1], q.shape[1]


def describe(shape: tuple) -> str:
    """A shape ``(heads, head_dim, KVBlockSize, next_n)`` in words."""
    return "heads={} head_dim={} KVBlockSize={} next_n={}".format(*shape)


def cu_count(device: torch.device) -> int:
    """Compute units of ``device`` (a host-side property read, cached; no sync)."""
    return _cu_count(device.type, device.index)


@functools.lru_cache(maxsize=16)
def _cu_count(device_type: str, index: int | None) -> int:
    return torch.cuda.get_device_properties(index or 0).multi_processor_count if device_type == "cuda" else 1


def explicit_split_kv(
    cus: int, batch: int, max_model_len: int, block_size: int, wg_per_cu: int = WORKGROUPS_PER_CU
) -> int:
    """aiter's dispatcher rule, ``max(1, min(pages, ceil(cu * wg_per_cu / batch)))``, ``pages`` the KV
    blocks of ``max_model_len``; shapes only."""
    pages = -(-max_model_len // block_size)
    return max(1, min(pages, -(-cus * wg_per_cu // max(batch, 1))))


def installed_version(distributions: tuple[str, ...]) -> str:
    """The version of the first of ``distributions`` installed, or ``"unknown"``."""
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _ints(value: object) -> frozenset[int] | None:
    """A module constant as a set of ints: ``32`` or ``(32, 64)``; ``None`` if unreadable."""
    values = (value,) if isinstance(value, int) else value
    if isinstance(values, (tuple, list, set, frozenset)) and values:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return frozenset(values)
    return None


def _q_rows_contract(fn: Callable) -> str | None:
    """``None`` where the gfx950 wrapper range-checks q's rows against ``MAX_NN`` and never requires them to
    equal it; else the unsupported revision's key, or why its source cannot tell."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError) as e:
        return f"source unreadable: {e}"
    if re.search(r"[!=]=\s*\(?\s*MAX_NN\b|\bMAX_NN\s*[!=]=", source):
        return "padded"
    if re.search(r"[<>]=?\s*MAX_NN\b|\bMAX_NN\s*[<>]", source):
        return None
    return "no range check of q's rows against MAX_NN in its source"


def identify_flydsl(fn: Callable, module: ModuleType | None, location: str) -> KernelVariant | str:
    """The variant of a ``flydsl_fp8_paged_mqa_logits`` found at ``location``, or why it is not usable."""
    if isinstance(params := parameters_of(fn), str):
        return params
    keyword_only = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    missing = [n for n in ("Preshuffle", "KVBlockSize") if n not in keyword_only]
    if missing:
        return f"lacks keyword-only {', '.join(missing)}"
    general_knobs = {"ChunkK", "WavePerEU", "variant"} & set(params)
    if len(general_knobs) == 3 and "next_n_lens" not in params:
        return KernelVariant("general", fn, location, "general FlyDSL kernel (aiter PR #4221)")
    if general_knobs or "SplitKV" not in keyword_only:
        return "an API of an unknown shape (neither PR #4221's kernel nor the gfx950 kernel)"
    try:
        home = importlib.import_module(fn.__module__)
    except Exception:  # noqa: BLE001 - read the constants where it was found
        home = module
    names = ("NUM_HEADS", "HEAD_DIM", "KV_BLOCK_SIZE", "INDEX_DIM", "MAX_NN")
    constants = {n: _ints(getattr(home, n, None)) for n in names}
    if "next_n_lens" in params:
        unreadable = [
            n for n, v in constants.items() if v is None or (n in ("INDEX_DIM", "MAX_NN") and len(v) != 1)
        ]
        if unreadable:
            return f"gfx950-style API whose module lacks a readable {', '.join(unreadable)}"
        unsupported = _q_rows_contract(fn)
    elif getattr(home, "SUPPORTED_HEADS", None) is not None:
        unsupported = "early"
    else:
        return "an API of an unknown shape (no next_n_lens, no ChunkK/WavePerEU/variant)"
    if unsupported is not None:
        what = UNSUPPORTED.get(
            unsupported, f"a gfx950 kernel whose q contract cannot be told ({unsupported})"
        )
        return f"this aiter revision is not supported: {what} ({SUPPORTED}); the stock path is kept"
    heads, head_dims, block_sizes, (index_dim,), (max_nn,) = constants.values()
    contract = (heads, head_dims, block_sizes, index_dim, max_nn, True, WORKGROUPS_PER_CU)
    return KernelVariant("gfx950", fn, location, "gfx950-specialised FlyDSL kernel", *contract)


def identify_dispatcher(module: ModuleType, location: str) -> KernelVariant | str:
    """aiter's tuned dispatcher in ``module`` (identified by its functions, not its name), or why not."""
    names = ("paged_mqa_logits", "get_paged_mqa_logits_config", "run_paged_mqa_logits", "flydsl_supports")
    fn, config, run, supports = (getattr(module, name, None) for name in names)
    if not callable(fn) or not callable(config):
        return "no paged_mqa_logits with get_paged_mqa_logits_config (not aiter's tuned dispatcher)"
    if isinstance(params := parameters_of(fn), str):
        return params
    if "Preshuffle" not in params or "KVBlockSize" not in params:
        return "paged_mqa_logits lacks Preshuffle/KVBlockSize"
    if not callable(run):
        return "no run_paged_mqa_logits: the self-test could not launch FlyDSL alone through it"

    def objection(args: tuple, preshuffle: bool) -> str | None:
        """Its table row (host-side, memoised by aiter) and ``flydsl_supports``, exactly as the dispatcher
        asks: ``None`` where it launches FlyDSL. The reason names the shape, not the batch."""
        q, kv, w = args[:3]
        block_size, shape = kv.shape[1], describe(shape_of(q, kv))
        backend = config(*q.shape, block_size, preshuffle).get("backend")
        if backend != "flydsl":
            return (
                f"aiter's dispatcher picks {backend} at some batch sizes of {shape}: vLLM's Gluon call runs"
            )
        if supports is not None and not supports(q, kv, w, preshuffle, block_size):
            return f"aiter's dispatcher would not launch FlyDSL for {shape} (flydsl_supports)"
        return None

    def forced(q, kv, weights, out, lens, tables, max_model_len: int, *, Preshuffle, KVBlockSize, live):
        """The dispatcher made to launch FlyDSL on this problem with its row for the ``live`` call's
        arguments (FlyDSL, as ``objection`` passed it), whatever its table says for this one."""
        row = config(*live[0].shape, KVBlockSize, Preshuffle)
        if row.get("backend") != "flydsl":
            raise ValueError(f"aiter's dispatcher row for the live call is {row}, not FlyDSL")
        return run(dict(row), q, kv, weights, out, lens, tables, max_model_len, Preshuffle, KVBlockSize)

    description = "aiter's tuned Gluon/FlyDSL dispatcher"
    return KernelVariant(
        "dispatcher", fn, location, description, own_table=True, dispatch_objection=objection, flydsl=forced
    )


def find_kernel() -> tuple[KernelVariant | None, str]:
    """The dispatcher if aiter has it, else the first FlyDSL kernel found, and what each probe found;
    never raises."""
    problems: list[str] = []
    seen: list[Callable] = []
    for path in (DISPATCHER_MODULE, *KERNEL_MODULES):
        try:
            module = importlib.import_module(path)
            if path == DISPATCHER_MODULE:
                found = identify_dispatcher(module, f"{path}.paged_mqa_logits")
            elif not callable(fn := getattr(module, KERNEL_NAME, None)):
                found = f"no {KERNEL_NAME}"
            elif any(fn is other for other in seen):
                found = f"the same {KERNEL_NAME} (a re-export)"
            else:
                seen.append(fn)
                found = identify_flydsl(fn, module, f"{path}.{KERNEL_NAME}")
        except Exception as e:  # noqa: BLE001 - any import or probe failure is a reason
            found = f"{type(e).__name__}: {e}"
        if isinstance(found, KernelVariant):
            return found, "found"
        problems.append(f"{path}: {found}")
    return None, "; ".join(problems)
