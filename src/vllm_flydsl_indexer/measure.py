# SPDX-License-Identifier: Apache-2.0
"""Never FlyDSL blind: a bucket no table covers is timed on this GPU once, agreed by the TP group, cached.

* **When:** at a bucket's first eager call (a tuned-CSV row's key, the batch's power-of-two floor), as the
  router's last rule (:func:`verdict`); a bucket first seen in graph capture stays stock, unmemoised.
* **What:** stock, the router's FlyDSL launch and aiter's ``_gfx950`` entry where it fits (each self-tested
  first), on one problem: ``bucket`` sequences at AMD's tuner contexts (clamped to ``max_model_len``: how the
  CPU simulation shrinks it) over the live cache's pages, fresh q and weights, logits in vLLM's workspace.
  Device events (wall clock on CPU), one untimed call then repeats within a share of :data:`BUCKET_BUDGET_S`.
* **One verdict per TP group:** every rank enters one all-reduce (MAX, vLLM's TP CPU group) per bucket,
  whatever it holds (cached or measured figures, or +inf): the slowest rank counts, a missing stock figure
  keeps stock, FlyDSL must win by :data:`MARGIN`.
* **Cached** as tuned-CSV rows under vLLM's cache root, one file per gfx, CUs, aiter and flydsl, written by
  rank 0 under a lock and atomically; a corrupt or foreign file gets one WARNING and is rewritten.
"""

from __future__ import annotations

import csv
import fcntl
import functools
import io
import math
import os
import re
import time
from pathlib import Path

import torch

from vllm_flydsl_indexer import envs, tuning
from vllm_flydsl_indexer.kernels import AITER_DISTRIBUTIONS, cu_count, describe, installed_version

CONTEXTS = (8192, 32768)
MARGIN = 1.03
BUCKET_BUDGET_S = 0.05
PROCESS_BUDGET_S = 30.0
MAX_EXTRA_BYTES = 64 * 2**20
CACHE_DIR = "flydsl_indexer"
BACKENDS = ("gluon", "flydsl", tuning.ENTRY)
# Why a bucket stays stock; IN_CAPTURE is not memoised (an eager call decides the bucket later).
NOT_MEASURED = "not yet measured on this GPU: stock"
IN_CAPTURE = f"{NOT_MEASURED} (first seen in graph capture)"


def bucket_of(batch: int) -> int:
    """The batch's power-of-two floor: the ``batch_size`` of its tuned-CSV row."""
    return 1 << (max(batch, 1).bit_length() - 1)


def cache_path(gfx: str, cus: int) -> Path:
    """This node's cache file for ``gfx`` with ``cus`` CUs and the installed aiter and flydsl."""
    versions = f"aiter-{installed_version(AITER_DISTRIBUTIONS)}_flydsl-{installed_version(('flydsl',))}"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", f"paged_mqa_logits_{gfx}_{cus}cu_{versions}.csv")
    return envs.cache_root() / CACHE_DIR / name


def load_cache(path: Path, gfx: str, cus: int, logger) -> tuning.TunedTable:
    """The node cache's rows; a missing file is empty, a corrupt or foreign one empty with one WARNING."""
    table = tuning.read(str(path), gfx, "node") if path.exists() else None
    if isinstance(table, tuning.TunedTable) and not table.skipped and table.cu_counts() == {cus}:
        return table
    if table is not None:
        why = table if isinstance(table, str) else f"{path}: rows the lookup cannot use, or other CU counts"
        logger.warning("%s node cache ignored (%s); the next measurement rewrites it", envs.HEAD, why)
    return tuning.TunedTable(str(path), gfx, "node")


def write_cache(path: Path, rows: list[dict]) -> None:
    """Merge ``rows`` into ``path`` (a row of the same key replaced; a corrupt or foreign file replaced
    whole) under an exclusive lock, through a temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept, old = {}, tuning.read(str(path), rows[0]["gfx"], "node") if path.exists() else None
        if isinstance(old, tuning.TunedTable) and not old.skipped and old.cu_counts() == {rows[0]["cu_num"]}:
            rows_in = csv.DictReader(io.StringIO(tuning.read_capped(str(path))))  # a cache has no comments
            kept = {tuple(r.get(c) for c in tuning.KEY_COLUMNS): r for r in rows_in}
        kept.update({tuple(str(r[c]) for c in tuning.KEY_COLUMNS): r for r in rows})
        out = io.StringIO()
        writer = csv.DictWriter(out, tuning.COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(kept.values())
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(out.getvalue())
        os.replace(temporary, path)


def _time(fn, device: torch.device, share: float) -> float:
    """Seconds per call of ``fn`` after one untimed call, repeated within ``share`` seconds."""
    fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None

    def run(n: int) -> float:
        began = time.perf_counter()
        if events:
            events[0].record()
        for _ in range(n):
            fn()
        if events:
            events[1].record()
            events[1].synchronize()
            return events[0].elapsed_time(events[1]) / 1e3 / n
        return (time.perf_counter() - began) / n

    once = run(1)
    repeats = int((share - once) // max(once, 1e-9))
    return run(repeats) if repeats > 0 else once


def measure(router, args: tuple, compress_ratio: int, bucket: int, routes: list) -> list[float]:
    """Seconds per call of stock and of each FlyDSL route (``None``: no figure, ``inf``) on one problem."""
    q, kv, _, lens, _, _, max_model_len = args
    _, next_n, heads, head_dim = q.shape
    block_size, device, rows = kv.shape[1], q.device, bucket * next_n
    most = -(-min(max(CONTEXTS), max_model_len) // block_size)
    if rows * heads * (head_dim + 4) + bucket * most * 4 > MAX_EXTRA_BYTES:
        raise MemoryError(f"the timing problem needs more than {MAX_EXTRA_BYTES >> 20} MiB")
    qb = torch.randint(1, 64, (bucket, next_n, heads, head_dim), dtype=torch.uint8, device=device)
    wb = torch.rand(rows, heads, device=device)
    share = BUCKET_BUDGET_S / (1 + sum(r is not None for r in routes)) / len(CONTEXTS)
    figures: list[list[float]] = [[] for _ in range(len(routes) + 1)]
    for context in sorted({min(c, max_model_len) for c in CONTEXTS}):
        pages = -(-context // block_size)
        tables = torch.arange(bucket * pages, device=device, dtype=torch.int32).remainder_(kv.shape[0])
        ends = torch.arange(1 - next_n, 1, dtype=torch.int32, device=device).add_(context).repeat(bucket, 1)
        bounds = ends if lens.dim() == 2 else ends[:, -1].contiguous()
        problem = (qb.view(q.dtype), kv, wb, bounds, tables.view(bucket, pages), None, max_model_len)
        stock = functools.partial(router.original, *problem, compress_ratio=compress_ratio)
        figures[0].append(_time(stock, device, share))
        out = router.hooks.output_buffer(rows, max_model_len)
        for i, route in enumerate(routes, 1):
            if route is not None:
                launch = functools.partial(
                    router._flydsl, route.fn or router.variant.fn, route.kwargs, problem, out
                )
                figures[i].append(_time(launch, device, share))
    return [math.exp(sum(map(math.log, f)) / len(f)) if f else math.inf for f in figures]


def _failed(router, what: str, error: Exception) -> list[float]:
    router.logger.warning("%s %s raised %s: %s; it stays stock", envs.HEAD, what, type(error).__name__, error)
    return [math.inf] * 3


def verdict(router, args: tuple, compress_ratio: int, routes: list) -> tuple | str:
    """The bucket's ``(backend, bucket, wg_per_cu, conflict, source)``, or why it stays stock. ``routes``:
    the general FlyDSL launch and the ``_gfx950`` entry's (``None`` where it does not apply)."""
    q, kv = args[0], args[1]
    batch, next_n, heads, head_dim = q.shape
    cus, bucket, shape = cu_count(q.device), bucket_of(batch), (heads, head_dim, kv.shape[1], next_n)
    key = (cus, next_n, heads, head_dim, kv.shape[1])
    if (key, bucket) in router.verdicts:
        return router.verdicts[key, bucket]
    if router.is_capturing():
        return IN_CAPTURE
    if router.node is None:
        router.node = load_cache(cache_path(router.gfx, cus), router.gfx, cus, router.logger)
    cached = router.node.shapes.get(key, {}).get(bucket)
    if cached is None and not router.tune:
        return f"{NOT_MEASURED} ({envs.TUNE}=0)"
    figures, (group, rank) = [math.inf] * 3, router.hooks.tp_group()
    try:
        if cached is not None:  # the cached winner wins again, by the margin
            figures = [1.0, *(1 / MARGIN if (b, 0) in cached else math.inf for b in BACKENDS[1:])]
        elif shape not in router.failed and router.spent < PROCESS_BUDGET_S:
            began = time.perf_counter()
            routes = [r if r and router._tested(r, args, compress_ratio) is None else None for r in routes]
            figures = measure(router, args, compress_ratio, bucket, routes)
            router.spent += time.perf_counter() - began
    except Exception as e:  # noqa: BLE001 - a failed measurement leaves the bucket stock
        figures = _failed(router, f"measuring {describe(shape)} batch {bucket}", e)
    if group is not None:  # every rank gets here once per bucket, whatever it holds
        try:
            reduced = torch.tensor(figures, dtype=torch.float64)
            torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX, group=group)
            figures = reduced.tolist()
        except Exception as e:  # noqa: BLE001
            figures = _failed(router, f"agreeing on {describe(shape)} batch {bucket} across the TP group", e)
    best = min((1, 2), key=lambda i: figures[i])
    taken = figures[0] < math.inf and figures[best] * MARGIN <= figures[0]
    source = "this node's measurement" if cached is None else "this node's cache"
    pick = (BACKENDS[best] if taken else "gluon", bucket, 0, None, source)
    router.verdicts[key, bucket] = pick if figures[0] < math.inf else f"{NOT_MEASURED} (no figures)"
    if cached is None and figures[0] < math.inf:
        us = [round(f * 1e6, 2) for f in figures]
        contexts = ";".join(map(str, sorted({min(c, args[6]) for c in CONTEXTS})))  # as timed (clamped)
        row = dict(zip(tuning.COLUMNS, (
            router.gfx, cus, bucket, *key[1:], key[4] > 1, contexts, pick[0], 0, 0, 0,
            us[best] if taken else us[0], us[0], min(us[1:]),
        ), strict=True))  # fmt: skip
        router.node.shapes.setdefault(key, {})[bucket] = [(pick[0], 0)]
        router.node._picks.clear()
        timings = ", ".join(f"{b} {u} us" for b, u in zip(BACKENDS, us, strict=True) if u < math.inf)
        line = f"measured {describe(shape)} batch {bucket} on this GPU ({timings}; slowest rank): {pick[0]}"
        router.logger.info("%s %s", envs.HEAD, line)
        try:
            if rank == 0:
                write_cache(Path(router.node.name), [row])
        except Exception as e:  # noqa: BLE001 - the verdict stands; the next process measures again
            line = f"node cache {router.node.name} not written: {type(e).__name__}: {e}"
            router.logger.warning("%s %s", envs.HEAD, line)
    return router.verdicts[key, bucket]
