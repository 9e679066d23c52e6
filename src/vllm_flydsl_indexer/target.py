# SPDX-License-Identifier: Apache-2.0
"""What vLLM is: the patched function, the code of it we audited, its objects resolved once, its callers.

The router launches FlyDSL with what the original passes Gluon, so the original must be audited code
(``docs/vllm-audit.md``): :func:`fingerprint` hashes its syntax tree, :data:`AUDITED` holds one per release.
:func:`vllm_stock_hooks` resolves every vLLM name the router uses at install; :data:`MULTI_ROW` names the
call sites audited to pass vLLM's native ``(B, next_n)`` bounds, and :data:`CALLER_CODE` holds their own code
to the audit, fingerprinted as the target is. No vLLM at import.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

TARGET_MODULE = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"
TARGET_NAME = "rocm_fp8_paged_mqa_logits"
# The signature of the audited releases (vLLM 0.32.0, 0.33.0 and 0.34.0; their fingerprints hold it).
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
# Set on the patch's wrapper, so the original can always be found behind it.
MARKER = "_vllm_flydsl_indexer"
# Larger than any file the plugin reads; /dev/zero and a runaway file stop here.
MAX_READ_BYTES = 16 * 2**20

# The audited targets (docs/vllm-audit.md): fingerprint -> (releases, how it passes Gluon ``Preshuffle``:
# "size" for ``block_size > 1``, "layout" for ``indexer_k_cache_is_shuffled(block_size) and not _ON_RDNA``).
# tests/test_drift.py recomputes each from its release's wheel.
AUDITED = {
    "10f441fd98e3401d9c96e83409889a6a96b68c2cd0808001d32b2d9be856268c": ("0.32.0", "size"),
    "c5c4952973def00a01a98b33260f7caac09310cf8f73d96ad1d508406a04dae4": ("0.33.0", "size"),
    "c820ba2f2af9b5cfa5a92d3b682ee7411660d39cbff6a1d6bd58724278e55d36": ("0.34.0", "layout"),
}


def parameters_of(fn: object) -> Mapping[str, inspect.Parameter] | str:
    """``fn``'s parameters by name, or why its signature is unreadable."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        return f"signature unreadable ({e})"


def unpatched(fn: Callable) -> Callable:
    """``fn`` itself, or the original function when ``fn`` is this package's wrapper."""
    return fn.__wrapped__ if getattr(fn, MARKER, False) else fn


# What a file that is not a regular one is, in the words the plugin and the tools both use.
KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}  # fmt: skip


def read_capped(path: str, limit: int = MAX_READ_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes; ``OSError`` naming what it is
    otherwise, checked before the open (a socket cannot be opened) and after it (opened non-blocking, a
    FIFO that took its place never hangs start-up)."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(limit + 1) if stat.S_ISREG(mode) else b""
        if len(data) > limit:
            raise OSError(f"{path} is larger than {limit} bytes")
    if not stat.S_ISREG(mode):
        raise OSError(f"{path} is {KINDS.get(stat.S_IFMT(mode), 'something else')}, not a regular file")
    return data.decode("utf-8-sig")


def _canonical(node: object) -> str:
    """``node`` as text without positions, contexts, or empty fields (which Python versions add or drop)."""
    if isinstance(node, list):
        return "[" + ",".join(map(_canonical, node)) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = (
        f"{name}={_canonical(value)}"
        for name, value in ast.iter_fields(node)
        if name not in ("ctx", "kind", "type_comment", "type_params") and value is not None and value != []
    )
    return f"{type(node).__name__}({' '.join(fields)})"


@functools.cache
def _defs(filename: str) -> dict[tuple[str, int], str]:
    """The SHA-256 of each top-level ``def`` of ``filename`` (its syntax tree, docstring left out), by its
    name and each of its lines (its own and its decorators'). Read and parsed once per process (the target
    and its caller share a file); raises ``OSError``, ``SyntaxError`` or ``UnicodeDecodeError``."""
    found = {}
    for node in ast.parse(read_capped(filename)).body:
        if isinstance(node, ast.FunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                node.body = body[1:]  # the docstring
            digest = hashlib.sha256(_canonical(node).encode()).hexdigest()
            found.update({(node.name, n.lineno): digest for n in (node, *node.decorator_list)})
    return found


def fingerprint(filename: str, first_line: int, name: str = TARGET_NAME) -> str:
    """SHA-256 of the ``def name`` at ``first_line`` of ``filename`` (:func:`_defs`); raises ``OSError``,
    ``SyntaxError``, ``UnicodeDecodeError`` or ``LookupError``."""
    if (digest := _defs(filename).get((name, first_line))) is None:
        raise LookupError(f"no def {name} at line {first_line} of {filename}")
    return digest


def fingerprint_of(fn: Callable) -> str:
    """:func:`fingerprint` of the function object ``fn``."""
    return fingerprint(fn.__code__.co_filename, fn.__code__.co_firstlineno, fn.__name__)


@dataclass(frozen=True)
class StockHooks:
    """What the router asks of vLLM, as the original asks it, injected so the router imports no vLLM."""

    gluon_objection: Callable[[int, int], str | None]  # why the original would not call Gluon, or None
    output_buffer: Callable[[int, int], object]  # (rows, max_model_len): the logits buffer, as it takes it
    per_sequence_lens: Callable[[object], object]  # vLLM's reduction to one length per sequence
    dcp_world_size: Callable[[], int]
    preshuffle: Callable[[int], bool]  # (block_size): the ``Preshuffle`` the original passes
    tp_group: Callable[[], tuple[object, int]] = lambda: (None, 0)  # TP CPU group (None alone), rank
    serving: Callable[[], bool] = lambda: False  # vLLM serves: its workspace is locked after capture
    max_batch: Callable[[], int] = lambda: 0  # the largest decode batch, vLLM's max_num_seqs (0: unknown)


def _resolve(owner: object, name: str, flag: bool = False):
    """``owner.name``: a callable, or a bool where ``flag``; ``LookupError`` naming it otherwise."""
    value = getattr(owner, name, None)
    if not (isinstance(value, bool) if flag else callable(value)):
        where, what = getattr(owner, "__name__", type(owner).__name__), "flag" if flag else "function"
        raise LookupError(f"vLLM's {where} has no {what} {name} (the router uses it)")
    return value


def vllm_stock_hooks(target: ModuleType, form: str, aiter_ops: object = None) -> StockHooks:
    """Hooks that answer as the target (its ``Preshuffle`` by ``form``, an :data:`AUDITED` form), every
    vLLM name resolved now (``aiter_ops``: a stand-in for ``rocm_aiter_ops``); ``LookupError`` if missing."""
    import torch
    from vllm import config
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.distributed import parallel_state

    rocm_aiter_ops = aiter_ops or rocm_aiter_ops
    on_gfx950 = _resolve(target, "_ON_GFX950", flag=True)
    on_gfx9 = on_gfx950 or _resolve(target, "_ON_GFX942", flag=True)
    c4a = _resolve(target, "_indexer_k_is_c4a_block_flat")
    aiter_on = _resolve(rocm_aiter_ops, "is_enabled")
    rdna_aiter_on = _resolve(rocm_aiter_ops, "is_rdna_aiter_enabled")
    gluon_module = _resolve(target, "paged_mqa_logits_module")
    workspace = _resolve(target, "current_workspace_manager")
    dcp = _resolve(parallel_state, "get_dcp_world_size_and_rank")
    tp = _resolve(parallel_state, "get_tp_group")
    tp_ready = _resolve(parallel_state, "model_parallel_is_initialized")
    vllm_config = _resolve(config, "get_current_vllm_config_or_none")

    def tp_group() -> tuple[object, int]:
        group = tp() if tp_ready() else None  # not initialised: a process alone
        return (group.cpu_group, group.rank_in_group) if group and group.world_size > 1 else (None, 0)

    def gluon_objection(compress_ratio: int, block_size: int) -> str | None:
        """The original's own conditions, in its order (the fingerprint holds them to the audit)."""
        if on_gfx9 and c4a(compress_ratio) and block_size > 1:
            return f"vLLM's own C4A Triton route (compress_ratio={compress_ratio}, block_size={block_size})"
        if not on_gfx950:
            return "vLLM does not report gfx950, so its stock call would not run aiter's Gluon kernel"
        if not (aiter_on() or rdna_aiter_on()):
            return "VLLM_ROCM_USE_AITER is not 1, so vLLM would not call aiter's Gluon kernel"
        if gluon_module() is None:
            return "vLLM finds no aiter Gluon paged-MQA-logits module"
        return None

    def output_buffer(rows: int, max_model_len: int) -> torch.Tensor:
        return workspace().get_simultaneous(((rows, max_model_len), torch.float32))[0]

    if form == "layout":
        shuffled, rdna = _resolve(target, "indexer_k_cache_is_shuffled"), _resolve(target, "_ON_RDNA", True)
        preshuffle = lambda block_size: bool(shuffled(block_size)) and not rdna  # noqa: E731
    else:
        preshuffle = lambda block_size: block_size > 1  # noqa: E731
    lens = _resolve(target, "_per_sequence_context_lens")

    def serving() -> bool:  # vLLM locks its workspace once warm-up and capture are done
        return bool(getattr(workspace(), "is_locked", lambda: False)())

    def max_batch() -> int:  # as vLLM bounds its decode logits workspace (``_max_decode_logits_rows``)
        return getattr(getattr(vllm_config(), "scheduler_config", None), "max_num_seqs", 0) or 0

    hooks = (gluon_objection, output_buffer, lens, lambda: dcp()[0], preshuffle, tp_group, serving, max_batch)
    return StockHooks(*hooks)


# Every audited call site: ``None`` where FlyDSL may take ``next_n > 1`` from it (with
# ``compress_ratio == 1`` and DCP 1), else why its bounds are not vLLM's native table.
MULTI_ROW: dict[str, str | None] = {
    TARGET_MODULE: None,
    "vllm.models.deepseek_v41.amd.ops.sparse_indexer": None,
    "vllm.models.glm5next.amd.sparse_indexer": "pool-granular (it does NOT pass compress_ratio although its "
    "bounds are compressed)",
}


# What the ``None`` call sites of MULTI_ROW are trusted for is their own code: each one's function that calls
# the target, and its fingerprint (:func:`fingerprint`) per audited release. tests/test_drift.py recomputes
# each from its release; deepseek_v41's module is new in 0.33.0 and unchanged in 0.34.0.
CALLER_CODE: dict[str, tuple[str, dict[str, str]]] = {
    TARGET_MODULE: ("rocm_aiter_sparse_attn_indexer", {
        "3c38d086bac65cfeafbc58cf683e1a0b1c1af87e803a2c6536cd4c891f3ec776": "0.32.0",
        "b1f1d00f03bf5a94344ee04a33db46721107e4500726e258168de1289bc4b88c": "0.33.0",
        "6b3d485946759b135c9237d7072a3d0358d58ff0d19138b2ddecdadcdc38adb2": "0.34.0",
    }),
    "vllm.models.deepseek_v41.amd.ops.sparse_indexer": ("_decode_step", {
        "ccfcddb8db5a36b26983c5eaccc62fc5e06007a751ba47fb27eec98bd4d618b2": "0.33.0, 0.34.0",
    }),
}  # fmt: skip


def caller_release(caller: str) -> str | None:
    """The audited releases whose code ``caller``'s function in :data:`CALLER_CODE` is, or ``None`` (not
    importable, its source unreadable, other code). Never raises. Its source is read once per process, at
    install for the target's own module (:func:`_defs`' cache): a route built later only looks it up."""
    try:
        name, releases = CALLER_CODE[caller]
        return releases.get(fingerprint_of(inspect.unwrap(getattr(importlib.import_module(caller), name))))
    except Exception:  # noqa: BLE001 - a caller whose code cannot be read is not audited
        return None


def multi_row_objection(caller: str | None) -> str | None:
    """Why FlyDSL may not take a ``next_n > 1`` call from ``caller``, or ``None``."""
    if caller not in MULTI_ROW:
        unaudited = f"a caller this package has not audited ({caller or 'unknown'})"
        return f"next_n > 1 from {unaudited}: only next_n == 1 is always safe"
    why = MULTI_ROW[caller]
    if why is None and caller_release(caller) is None:
        why = f"unaudited: its {CALLER_CODE[caller][0]} is none of the audited releases' code"
    return None if why is None else f"next_n > 1 from {caller}: its bounds are {why}"
