# SPDX-License-Identifier: Apache-2.0
"""Never FlyDSL blind: a bucket no table covers is timed on this GPU, as serving runs it, and cached.

* **When:** at a bucket's first eager call before vLLM serves (a tuned-CSV row's key, the batch's power-of-two
  floor). A shape's first such call (per context) measures every other bucket up to the largest decode
  batch too (vLLM's ``max_num_seqs``, the bound of its logits workspace), within the budget: vLLM's
  warm-up decode step (Model Runner V2's ``warmup_kernels``, before capture) leaves serving decided. A
  bucket first seen in graph capture stays stock, unmemoised; one first seen once vLLM serves (its
  workspace locked after capture) stays stock with one INFO line naming ``tune --model``.
* **What is timed** (:func:`figures`): stock and the FlyDSL route (self-tested first) on one problem,
  ``bucket`` sequences at AMD's tuner contexts clamped to ``max_model_len`` over the live cache's pages, q
  and weights from a private generator, logits in vLLM's workspace. On a GPU each candidate, after its
  untimed first call (the compile), is captured as a graph of :data:`GRAPH_CALLS` calls and its replays are
  timed with device events: no launcher cost, as vLLM replays decode. An arm that will not capture
  is queued behind a device-side delay, so its launches wait for the device, not the host. The CPU
  simulation has neither and times the wall clock. :data:`ROUNDS` rounds interleave the arms; a
  round's figure is FlyDSL's time over stock's (geomean over the contexts), and the verdict is on
  the median round, which with an odd count holds the margin only where most rounds do. The self-test
  covers the timing contexts before they are timed: its small problem (``selftest.MAX_BYTES``) proves
  SplitKV's extremes and block edges; then the same self-test runs FlyDSL on one synthetic sequence at
  each context (about 132 bytes a token: 4.3 MB at 32k), with the same launches, once per shape and
  context; a disagreement fails the shape as the self-test does, and leaves no row.
* **One unit:** what a rank brings to the TP group's agreement (the router's ``_agree``: one MAX, every
  rank, once per call signature) is FlyDSL's time over stock's, ``inf`` for stock; a cached FlyDSL row
  brings its recorded ratio, a table's FlyDSL pick ``1 / MARGIN``. The slowest rank counts, so a cache
  never outvotes a measurement; FlyDSL must beat stock by :data:`MARGIN`.
* **Cached per node** (:func:`cache_key`): the device name, gfx, CUs, aiter, flydsl, vLLM, torch and
  Triton versions and :data:`CACHE_FORMAT`; a row applies only at the contexts it was timed at. A build
  whose version cannot be read is measured, never cached. Every rank writes what it measured, and only
  that (:func:`write_cache`: atomically, never through a link, in a directory only this user can write). A
  row whose figures are not positive and finite, contradict its backend or repeat a key with another
  verdict is corrupt: one WARNING, and the bucket is measured again. A failed self-test leaves no row, so
  a restart tests it again.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import io
import itertools
import math
import os
import stat
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm_flydsl_indexer import envs, tuning
from vllm_flydsl_indexer.kernels import AITER_DISTRIBUTIONS, cu_count, describe, installed_version

CONTEXTS = (8192, 32768)
MARGIN = 1.03
ROUNDS = 5  # odd: the median round holds the margin only where most rounds do
GRAPH_CALLS = 4  # calls per captured graph (GPU)
DELAY_CYCLES = 2_000_000  # the device-side delay ahead of an uncapturable candidate's launches (~1 ms)
PROCESS_BUDGET_S = 30.0
MAX_EXTRA_BYTES = 64 * 2**20
# A peer that has not reached the agreement by then is given up on (the bucket stays stock on this rank);
# long enough for the slowest rank's first compile, self-test and measurement of the bucket.
AGREE_TIMEOUT_S = 300.0
TRITON = ("triton", "pytorch-triton-rocm")  # Gluon's compiler: Triton's distributions
CACHE_DIR = "flydsl_indexer"
CACHE_FORMAT = 3  # 3: FlyDSL's general launch alone is measured (2 also timed aiter's _gfx950 entry)
KEY_PREFIX = f"{tuning.COMMENT} vllm-flydsl-indexer node cache keyed on: "  # a cache file's first line
TOLERANCE = 1e-3  # a cached figure's rounding
# Why a bucket stays stock; IN_CAPTURE is not memoised (an eager call decides the bucket later).
NOT_MEASURED = "not yet measured on this GPU: stock"
IN_CAPTURE = f"{NOT_MEASURED} (first seen in graph capture)"
SERVING = f"{NOT_MEASURED} (first seen once vLLM serves; `vllm-flydsl-indexer tune --model` measures ahead)"


def bucket_of(batch: int) -> int:
    """The batch's power-of-two floor: the ``batch_size`` of its tuned-CSV row."""
    return 1 << (max(batch, 1).bit_length() - 1)


def contexts_of(max_model_len: int) -> str:
    """The contexts a bucket is timed at (AMD's, clamped to ``max_model_len``), as a row's ``context_len``."""
    return ";".join(map(str, sorted({min(c, max_model_len) for c in CONTEXTS})))


@functools.cache
def stack_versions() -> dict[str, str]:
    """What builds the two arms: aiter, flydsl, vLLM, torch and Triton (``unknown`` where unreadable)."""
    names = {"aiter": AITER_DISTRIBUTIONS, "flydsl": ("flydsl",), "vllm": ("vllm",), "triton": TRITON}
    return {"torch": torch.__version__, **{what: installed_version(n) for what, n in names.items()}}


def cache_key(device: torch.device, gfx: str, cus: int) -> str | None:
    """The node cache's key line for this GPU and stack, or ``None`` where a version cannot be read."""
    versions = stack_versions()
    if "unknown" in versions.values() and device.type != "cpu":  # the CPU simulation runs none of them
        return None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    fields = {"format": CACHE_FORMAT, "device": name, "gfx": gfx, "cus": cus, **versions}
    return KEY_PREFIX + " ".join(f"{k}={v}" for k, v in fields.items())


def cache_path(gfx: str, cus: int, key: str) -> Path:
    """The node cache file holding ``key``'s rows."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return envs.cache_root() / CACHE_DIR / f"paged_mqa_logits_{gfx}_{cus}cu_{digest}.csv"


def _row_key(row: dict, gfx: str, cus: int) -> tuple | str:
    """A cached row's ``(shape key, bucket, contexts)``, or why it is corrupt."""
    found = tuning.usable_row(row)
    try:
        us, gluon, flydsl = (float(row[c]) for c in ("us", "gluon_us", "flydsl_us"))
    except (KeyError, TypeError, ValueError):
        return "a row without its figures"
    if found is None or found[0] != gfx or found[1][0] != cus:
        return "a row the lookup cannot use, or for another GPU"
    if not all(math.isfinite(f) and f > 0 for f in (us, gluon, flydsl)):
        return f"figures that are not positive finite times ({us}, {gluon}, {flydsl})"
    # FlyDSL's verdict holds where the ratio is at most 1; within TOLERANCE of 1 (rounding), either does.
    flydsl_row, ratio = found[3] != "gluon", flydsl * MARGIN / gluon
    wrong_side = ratio > 1 + TOLERANCE if flydsl_row else ratio < 1 - TOLERANCE
    if wrong_side or not math.isclose(us, (gluon, flydsl)[flydsl_row], rel_tol=TOLERANCE):
        return f"a {found[3]} row whose figures say otherwise (us {us}, gluon {gluon}, flydsl {flydsl})"
    return found[1], found[2], row.get("context_len", "")


def private_dir_problem(directory: Path) -> str | None:
    """Why ``directory`` may not hold the cache (not ours, or writable by others), else ``None``."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        return f"{directory} is not a directory of this user's that only it can write"
    return None


def load_cache(path: Path, key: str, gfx: str, cus: int) -> tuple[dict, list[str]]:
    """The node cache's rows ``{(shape key, bucket, contexts): row}`` and what is wrong with it (each a
    WARNING); a missing file is empty. Never raises, never follows a link."""
    try:
        if not os.path.lexists(path):
            return {}, []
        if (why := private_dir_problem(path.parent)) or stat.S_ISLNK(os.lstat(path).st_mode):
            return {}, [why or f"{path} is a symbolic link"]
        head, _, body = tuning.read_capped(str(path)).partition("\n")
    except Exception as e:  # noqa: BLE001 - an unreadable cache is no cache
        return {}, [f"{path}: {type(e).__name__}: {e}"]
    if head != key:
        return {}, [f"{path} is keyed on another stack ({head[:200]!r})"]
    found, corrupt, problems = {}, set(), []
    for number, row in enumerate(csv.DictReader(io.StringIO(body)), 3):
        at = _row_key(row, gfx, cus)
        if isinstance(at, str) or found.setdefault(at, row)["backend"] != row["backend"]:
            corrupt.add(at)
            problems.append(
                f"{path} line {number}: {at if isinstance(at, str) else 'its key twice, two verdicts'}"
            )
    return {k: v for k, v in found.items() if k not in corrupt}, problems


def write_cache(path: Path, key: str, rows: list[dict]) -> str | None:
    """Merge ``rows`` into ``path`` (a row of the same key and contexts replaced, corrupt rows dropped)
    through a private temporary file and an atomic rename; why it was not written, or ``None``. No lock: a
    reader never sees a partial file, and two processes that merge at once can only lose one's rows, which
    the next process measures again (what a busy lock's skipped write would do)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if why := private_dir_problem(path.parent):
            return why
        gfx, cus = str(rows[0]["gfx"]), int(rows[0]["cu_num"])
        new = {_row_key(r, gfx, cus): r for r in ({k: str(v) for k, v in r.items()} for r in rows)}
        if corrupt := [at for at in new if isinstance(at, str)]:
            return f"a row to write is corrupt: {corrupt[0]}"
        kept = load_cache(path, key, gfx, cus)[0] | new
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", newline="") as f:
                f.write(key + "\n")
                writer = csv.DictWriter(f, tuning.COLUMNS, extrasaction="ignore", lineterminator="\n")
                writer.writeheader()
                writer.writerows(kept.values())
            os.replace(temporary, path)  # a link in the way is replaced, never followed
        except BaseException:
            os.unlink(temporary)
            raise
    except Exception as e:  # noqa: BLE001 - the verdict stands; the next process measures again
        return f"{type(e).__name__}: {e}"
    return None


def _sampler(fn, device: torch.device):
    """``fn`` as serving runs it: after one untimed call, a function giving seconds per call."""
    fn()
    graph = torch.cuda.CUDAGraph() if device.type == "cuda" else None
    try:
        with (
            torch.cuda.graph(graph, capture_error_mode="thread_local") if graph else contextlib.nullcontext()
        ):
            for _ in range(GRAPH_CALLS if graph else 0):
                fn()
    except Exception:  # noqa: BLE001 - a candidate that will not capture is timed queued behind a delay
        graph = False
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None

    def sample() -> float:
        if events is None:  # the CPU simulation: no device, no graph, the wall clock of one call
            began = time.perf_counter()
            fn()
            return time.perf_counter() - began
        if graph is False:
            torch.cuda._sleep(DELAY_CYCLES)  # the launches below queue behind it: device time, not host
        events[0].record()
        for _ in range(1 if graph else GRAPH_CALLS):
            graph.replay() if graph else fn()
        events[1].record()
        events[1].synchronize()
        return events[0].elapsed_time(events[1]) / 1e3 / GRAPH_CALLS

    return sample


def summarise(samples: list[list[list[float]]]) -> tuple[float, list[float]]:
    """``samples[round][context]``: each arm's seconds, stock first. Stock's median time (geomean over the
    contexts) and each candidate's median round of its time over stock's."""

    def median_round(of) -> float:  # the median over rounds of the geomean over contexts
        return statistics.median(math.exp(statistics.fmean(math.log(of(c)) for c in r)) for r in samples)

    stock = median_round(lambda c: c[0])
    return stock, [median_round(lambda c, i=i: c[i] / c[0]) for i in range(1, len(samples[0][0]))]


def figures(router, args: tuple, compress_ratio: int, bucket: int, route) -> tuple[float, float]:
    """Stock's seconds per call and FlyDSL's (``route``) time over stock's on one problem; ``(nan, inf)``
    where FlyDSL failed its self-test at a timing context."""
    q, kv, _, lens, _, _, max_model_len = args
    _, next_n, heads, head_dim = q.shape
    block_size, device, rows = kv.shape[1], q.device, bucket * next_n
    contexts = [int(c) for c in contexts_of(max_model_len).split(";")]
    most = -(-contexts[-1] // block_size)
    if rows * heads * (head_dim + 4) + bucket * most * 4 > MAX_EXTRA_BYTES:
        raise MemoryError(f"the timing problem needs more than {MAX_EXTRA_BYTES >> 20} MiB")
    rng = torch.Generator(device=device).manual_seed(bucket)  # never the global or device default
    dims, u8 = (bucket, next_n, heads, head_dim), torch.uint8  # q drawn as bytes: no wider temporary
    qb = torch.randint(1, 64, dims, dtype=u8, device=device, generator=rng)
    wb = torch.rand(rows, heads, device=device, generator=rng)
    samplers = []
    original = functools.partial(router.original, compress_ratio=compress_ratio)
    for context in contexts:
        pages = -(-context // block_size)
        tables = torch.arange(bucket * pages, device=device, dtype=torch.int32).remainder_(kv.shape[0])
        ends = torch.arange(1 - next_n, 1, dtype=torch.int32, device=device).add_(context).repeat(bucket, 1)
        bounds = ends if lens.dim() == 2 else ends[:, -1].contiguous()
        problem = (qb.view(q.dtype), kv, wb, bounds, tables.view(bucket, pages), None, max_model_len)
        if router._tested(route, args, compress_ratio, context):  # before it is timed
            return math.nan, math.inf  # a failed self-test at this context: the shape stays stock
        out = router.hooks.output_buffer(rows, max_model_len)
        flydsl = functools.partial(router._flydsl, router.variant.fn, route.kwargs, problem, out)
        arms = (functools.partial(original, *problem), flydsl)
        samplers.append([_sampler(arm, device) for arm in arms])
    samples = [[[0.0, 0.0] for _ in contexts] for _ in range(ROUNDS)]
    for r, c, k in itertools.product(range(ROUNDS), range(len(contexts)), range(2)):
        i = (r + k) % 2  # interleaved: each round starts from another arm
        samples[r][c][i] = samplers[c][i]()
    stock, ratios = summarise(samples)
    return stock, ratios[0]


def settle(ratio: float) -> bool:
    """Whether FlyDSL's (agreed) time over stock's beats stock by :data:`MARGIN`."""
    return ratio * MARGIN <= 1 + 1e-9


def local(router, args: tuple, compress_ratio: int, route_for) -> tuple[tuple | str, float]:
    """This rank's verdict on a bucket no table covers, from this node's cache or a measurement, and the
    ratio it brings to the agreement. Never raises and never a collective. ``route_for(bucket)``: FlyDSL's
    launch at that batch. A shape's first call here (per context) decides every other bucket up to the
    largest decode batch too (its rows kept for their own first calls), so a warm-up call leaves serving
    decided, within the budget."""
    (batch, next_n, heads, head_dim), kv = args[0].shape, args[1]
    key, contexts = (cu_count(args[0].device), next_n, heads, head_dim, kv.shape[1]), contexts_of(args[6])
    buckets = [bucket_of(batch)]
    if (key, contexts) not in router.swept:  # the first call: every bucket this process can serve
        router.swept.add((key, contexts))
        buckets += [1 << i for i in range(router.hooks.max_batch().bit_length()) if 1 << i != buckets[0]]
    return [_bucket(router, args, compress_ratio, route_for(b), (key, b, contexts)) for b in buckets][0]


def _bucket(router, args: tuple, compress_ratio: int, route, at: tuple) -> tuple:
    """:func:`local` for the bucket ``at``: ``(shape key, bucket, contexts)``."""
    (cus, next_n, heads, head_dim, block), bucket, device = at[0], at[1], args[0].device
    shape = (heads, head_dim, block, next_n)
    rank0, name = router.hooks.tp_group()[1] == 0, f"{describe(shape)} batch {bucket}"
    try:
        if router.node is None:  # (path or None: not cached, key, rows by bucket, what is wrong with it)
            stack = cache_key(device, router.gfx, cus)
            path = cache_path(router.gfx, cus, stack) if stack else None
            router.node = (path, stack, *(load_cache(path, stack, router.gfx, cus) if path else ({}, [])))
            if router.node[3] and rank0:
                lines = "; ".join(router.node[3][:3]) + ("; ..." if len(router.node[3]) > 3 else "")
                router.logger.warning("%s node cache: %s; those buckets are measured again", envs.HEAD, lines)
        row = router.node[2].get(at)
        if row is not None and shape not in router.failed:  # read from the file, or measured by this process
            flydsl = row["backend"] == "flydsl"  # a stock row brings no candidate
            ratio = float(row["flydsl_us"]) / float(row["gluon_us"]) if flydsl else math.inf
            return (row["backend"], bucket, 0, None, row.get("source", "this node's cache")), ratio
        why = (
            router.failed.get(shape)
            or (not router.tune and f"{NOT_MEASURED} ({envs.TUNE}=0)")
            or (router.hooks.serving() and SERVING)
            or (router.spent >= PROCESS_BUDGET_S and f"{NOT_MEASURED} (this process's budget is spent)")
        )
        if why:
            return why, math.inf
        began = time.perf_counter()
        if (problem := router._tested(route, args, compress_ratio)) is None:  # a failed kernel: not timed
            stock, ratio = figures(router, args, compress_ratio, bucket, route)
            router.spent += time.perf_counter() - began
        if problem or shape in router.failed:  # its self-test failed (at a timing context too): no row and
            # no ratio, so the group keeps stock as this rank does
            return router.failed.get(shape, problem), math.inf
        pick, us = "flydsl" if settle(ratio) else "gluon", stock * 1e6
        if rank0:
            timed = f"gluon {us:.2f} us, flydsl {us * ratio:.2f} us; median of {ROUNDS} rounds"
            line = f"measured {name} on this GPU ({timed})"
            router.logger.info("%s %s: %s on this rank", envs.HEAD, line, pick)
        row = dict(zip(tuning.COLUMNS, (
            router.gfx, cus, bucket, *at[0][1:], at[0][4] > 1, at[2], pick, 0, 0, 0,
            round(us * ratio if settle(ratio) else us, 4), round(us, 4), round(us * ratio, 4),
        ), strict=True), source="this node's measurement")  # fmt: skip
        router.node[2][at] = row  # timed: the bucket's other batches reuse it
        why = router.node[0] and write_cache(router.node[0], router.node[1], [row])
        if why and rank0 and why not in router.node[3]:  # said once: a refused directory was at the read
            router.logger.warning_once("%s node cache %s not written: %s", envs.HEAD, router.node[0], why)
        return (pick, bucket, 0, None, row["source"]), ratio
    except Exception as e:  # noqa: BLE001 - a failed measurement leaves the bucket stock; never raises,
        # so every rank reaches the agreement
        line = f"measuring {name} raised {type(e).__name__}: {e}; it stays stock"
        router.logger.warning("%s %s", envs.HEAD, line)
        return f"{NOT_MEASURED} (the measurement raised {type(e).__name__})", math.inf
