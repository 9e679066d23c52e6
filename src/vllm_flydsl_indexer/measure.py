# SPDX-License-Identifier: Apache-2.0
"""Never FlyDSL blind: a bucket no table covers is timed on this GPU, as serving runs it, and cached.

* **When:** at a bucket's first eager call before vLLM serves (a tuned-CSV row's key, the batch's power-of-two
  floor). A bucket first seen in graph capture stays stock, unmemoised; one first seen once vLLM serves
  (its workspace locked after capture) stays stock with one INFO line naming ``tune --model``.
* **What is timed** (:func:`figures`): stock and each FlyDSL route (self-tested first) on one problem,
  ``bucket`` sequences at AMD's tuner contexts clamped to ``max_model_len`` over the live cache's pages, q
  and weights from a private generator, logits in vLLM's workspace. On a GPU each candidate, after its
  untimed first call (the compile), is captured as a graph of :data:`GRAPH_CALLS` calls and its replays are
  timed with device events: no launcher cost, as vLLM replays decode. A candidate that will not capture
  is queued behind a device-side delay, so its launches wait for the device, not the host. The CPU
  simulation has neither and times the wall clock. :data:`ROUNDS` rounds interleave the candidates; a
  round's figure is each candidate's time over stock's (geomean over the contexts), and the verdict is on
  the median round, which with an odd count holds the margin only where most rounds do.
* **One unit:** what a rank brings to the TP group's agreement (the router's ``_agree``: one MAX, every
  rank, once per call signature) is each candidate's time over stock's, ``inf`` for none; a cached row
  brings its recorded ratio, a table's FlyDSL pick ``1 / MARGIN``. The slowest rank counts, so a cache
  never outvotes a measurement; FlyDSL must beat stock by :data:`MARGIN`.
* **Cached per node** (:func:`cache_key`): the device name, gfx, CUs, aiter, flydsl, vLLM, torch and
  Triton versions and :data:`CACHE_FORMAT`; a row applies only at the contexts it was timed at. A build
  whose version cannot be read is measured, never cached. Only what this rank measured is written (every
  rank that measured; a busy lock skips the write), atomically, never through a link; a row whose figures
  are not positive and finite, contradict its backend or repeat a key with another verdict is corrupt:
  one WARNING, and the bucket is measured again. A failed or untimed candidate leaves no row.
"""

from __future__ import annotations

import csv
import fcntl
import functools
import hashlib
import io
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
CACHE_DIR = "flydsl_indexer"
CACHE_FORMAT = 2
KEY_PREFIX = f"{tuning.COMMENT} vllm-flydsl-indexer node cache keyed on: "  # a cache file's first line
BACKENDS = ("flydsl", tuning.ENTRY)  # the candidates, in the order of a rank's ratios
NONE = [math.inf, math.inf]  # no candidate: stock
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
    return {
        "aiter": installed_version(AITER_DISTRIBUTIONS),
        "flydsl": installed_version(("flydsl",)),
        "vllm": installed_version(("vllm",)),
        "torch": torch.__version__,
        "triton": installed_version(("triton", "pytorch-triton-rocm")),
    }


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


def _row_verdict(row: dict, gfx: str, cus: int) -> tuple[tuple, tuple[str, float]] | str:
    """A cached row's ``((shape key, bucket, contexts), (backend, ratio, source))``, or why it is corrupt."""
    found = tuning.usable_row(row)
    if found is None or found[0] != gfx or found[1][0] != cus:
        return "a row the lookup cannot use, or for another GPU"
    _, key, bucket, backend, _ = found
    try:
        us, gluon_us, flydsl_us = (float(row[c]) for c in ("us", "gluon_us", "flydsl_us"))
    except (KeyError, TypeError, ValueError):
        return "a row without its figures"
    if not all(math.isfinite(f) and f > 0 for f in (us, gluon_us, flydsl_us)):
        return f"figures that are not positive finite times ({us}, {gluon_us}, {flydsl_us})"
    taken = flydsl_us * MARGIN <= gluon_us * (1 + TOLERANCE)
    if taken != (backend != "gluon") or not math.isclose(
        us, flydsl_us if taken else gluon_us, rel_tol=TOLERANCE
    ):
        return f"a {backend} row whose figures say otherwise (us {us}, gluon {gluon_us}, flydsl {flydsl_us})"
    return (key, bucket, row.get("context_len", "")), (backend, flydsl_us / gluon_us, "this node's cache")


def _is_private(directory: Path) -> str | None:
    """Why ``directory`` may not hold the cache (not ours, or writable by others), else ``None``."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        return f"{directory} is not a directory of this user's that only it can write"
    return None


def load_cache(path: Path, key: str, gfx: str, cus: int) -> tuple[dict, list[str]]:
    """The node cache's verdicts ``{(shape key, bucket, contexts): (backend, ratio, source)}`` and what is wrong
    with it (each a WARNING); a missing file is empty. Never raises."""
    try:
        if not path.parent.exists() and not os.path.lexists(path):
            return {}, []
        if why := _is_private(path.parent):
            return {}, [why]
        if not os.path.lexists(path):
            return {}, []
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return {}, [f"{path} is a symbolic link"]
        text = tuning.read_capped(str(path))
    except Exception as e:  # noqa: BLE001 - an unreadable cache is no cache
        return {}, [f"{path}: {type(e).__name__}: {e}"]
    head, _, body = text.partition("\n")
    if head != key:
        return {}, [f"{path} is keyed on another stack ({head[:200]!r})"]
    found, corrupt, problems = {}, set(), []
    for number, row in enumerate(csv.DictReader(io.StringIO(body)), 3):
        verdict = _row_verdict(row, gfx, cus)
        if isinstance(verdict, str):
            problems.append(f"{path} line {number}: {verdict}")
        elif found.get(verdict[0], verdict[1])[0] != verdict[1][0]:
            corrupt.add(verdict[0])
            problems.append(f"{path} line {number}: a second row of its key with another verdict")
        else:
            found[verdict[0]] = verdict[1]
    return {k: v for k, v in found.items() if k not in corrupt}, problems


def write_cache(path: Path, key: str, rows: list[dict]) -> str | None:
    """Merge ``rows`` into ``path`` (a row of the same key and contexts replaced, corrupt rows dropped)
    under a lock, through a private temporary file and an atomic rename; why it was not written, or
    ``None``. A lock that is busy skips the write: the verdict stands, the next process measures again."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if why := _is_private(path.parent):
            return why
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(path.with_suffix(".lock"), flags, 0o600), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "another process holds its lock"
            gfx, cus = rows[0]["gfx"], int(rows[0]["cu_num"])
            old, _ = load_cache(path, key, gfx, cus)
            kept = {}
            if old and not stat.S_ISLNK(os.lstat(path).st_mode):
                for row in csv.DictReader(io.StringIO(tuning.read_capped(str(path)).partition("\n")[2])):
                    verdict = _row_verdict(row, gfx, cus)
                    if not isinstance(verdict, str) and verdict[0] in old:
                        kept[verdict[0]] = row
            kept.update({_row_verdict(r, gfx, cus)[0]: r for r in rows})
            out = io.StringIO()
            out.write(key + "\n")
            writer = csv.DictWriter(out, tuning.COLUMNS, extrasaction="ignore", lineterminator="\n")
            writer.writeheader()
            writer.writerows(kept.values())
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
            try:
                with os.fdopen(handle, "w") as f:
                    f.write(out.getvalue())
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
    if device.type != "cuda":  # the CPU simulation: no device, no graph, the wall clock of one call

        def wall() -> float:
            began = time.perf_counter()
            fn()
            return time.perf_counter() - began

        return wall
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for _ in range(GRAPH_CALLS):
                    fn()
            finally:
                graph.capture_end()
    except Exception:  # noqa: BLE001 - a candidate that will not capture is timed queued behind a delay
        graph = None
    torch.cuda.current_stream(device).wait_stream(side)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))

    def replay() -> float:
        if graph is None:
            torch.cuda._sleep(DELAY_CYCLES)  # the launches below queue behind it: device time, not host
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(GRAPH_CALLS):
                fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / GRAPH_CALLS

    return replay


def summarise(samples: list[list[list[float]]]) -> tuple[float, list[float]]:
    """``samples[round][context]``: each arm's seconds, stock first. Stock's median time (geomean over the
    contexts) and each candidate's median round of its time over stock's."""

    def geomean(values) -> float:
        return math.exp(statistics.fmean(map(math.log, values)))

    stock = statistics.median(geomean(c[0] for c in r) for r in samples)
    arms = len(samples[0][0])
    return stock, [
        statistics.median(geomean(c[i] / c[0] for c in r) for r in samples) for i in range(1, arms)
    ]


def figures(router, args: tuple, compress_ratio: int, bucket: int, routes: list) -> tuple[float, list[float]]:
    """Stock's seconds per call and each route's time over stock's (``inf`` where ``None``) on one problem."""
    q, kv, _, lens, _, _, max_model_len = args
    _, next_n, heads, head_dim = q.shape
    block_size, device, rows = kv.shape[1], q.device, bucket * next_n
    contexts = [int(c) for c in contexts_of(max_model_len).split(";")]
    most = -(-contexts[-1] // block_size)
    if rows * heads * (head_dim + 4) + bucket * most * 4 > MAX_EXTRA_BYTES:
        raise MemoryError(f"the timing problem needs more than {MAX_EXTRA_BYTES >> 20} MiB")
    rng = torch.Generator(device=device).manual_seed(bucket)  # never the global or device default
    qb = torch.randint(
        1, 64, (bucket, next_n, heads, head_dim), dtype=torch.uint8, device=device, generator=rng
    )
    wb = torch.rand(rows, heads, device=device, generator=rng)
    timed = [i for i, r in enumerate(routes) if r is not None]
    samplers = []
    for context in contexts:
        pages = -(-context // block_size)
        tables = torch.arange(bucket * pages, device=device, dtype=torch.int32).remainder_(kv.shape[0])
        ends = torch.arange(1 - next_n, 1, dtype=torch.int32, device=device).add_(context).repeat(bucket, 1)
        bounds = ends if lens.dim() == 2 else ends[:, -1].contiguous()
        problem = (qb.view(q.dtype), kv, wb, bounds, tables.view(bucket, pages), None, max_model_len)
        out = router.hooks.output_buffer(rows, max_model_len)
        arms = [functools.partial(router.original, *problem, compress_ratio=compress_ratio)]
        for i in timed:
            route = routes[i]
            arms.append(
                functools.partial(router._flydsl, route.fn or router.variant.fn, route.kwargs, problem, out)
            )
        samplers.append([_sampler(arm, device) for arm in arms])
    samples = []
    for r in range(ROUNDS):  # interleaved, each round in another order
        samples.append([[0.0] * len(arms) for _ in contexts])
        for c, per_context in enumerate(samplers):
            for i in (*range(r % len(arms), len(arms)), *range(r % len(arms))):
                samples[-1][c][i] = per_context[i]()
    stock, ratios = summarise(samples)
    out = list(NONE)
    for i, ratio in zip(timed, ratios, strict=True):
        out[i] = ratio
    return stock, out


def settle(ratios: list[float]) -> str | None:
    """The candidate the (agreed) ratios take, or ``None`` for stock: the faster one, beating stock by
    :data:`MARGIN`."""
    best = min(range(len(BACKENDS)), key=lambda i: ratios[i])
    return BACKENDS[best] if ratios[best] * MARGIN <= 1 + 1e-9 else None


def local(router, args: tuple, compress_ratio: int, routes: list) -> tuple[tuple | str, list[float]]:
    """This rank's verdict on a bucket no table covers, from this node's cache or a measurement, and the
    ratios it brings to the agreement. Never raises and never a collective. ``routes``: the general FlyDSL
    launch and the ``_gfx950`` entry's (``None`` where it does not apply)."""
    q, kv, max_model_len = args[0], args[1], args[6]
    batch, next_n, heads, head_dim = q.shape
    bucket, shape, cus = bucket_of(batch), (heads, head_dim, kv.shape[1], next_n), cu_count(q.device)
    key = (cus, next_n, heads, head_dim, kv.shape[1])
    rank0, name = router.hooks.tp_group()[1] == 0, f"{describe(shape)} batch {bucket}"
    try:
        if router.node is None:
            stack = cache_key(q.device, router.gfx, cus)
            path = cache_path(router.gfx, cus, stack) if stack else None
            router.node = (path, stack, *(load_cache(path, stack, router.gfx, cus) if path else ({}, [])))
            if router.node[3] and rank0:
                lines = "; ".join(router.node[3][:3]) + ("; ..." if len(router.node[3]) > 3 else "")
                router.logger.warning("%s node cache: %s; those buckets are measured again", envs.HEAD, lines)
        if router.failed.get(shape):
            return router.failed[shape], list(NONE)
        cached = router.node[2].get((key, bucket, contexts_of(max_model_len)))
        if cached is not None:  # read from the file, or measured by this process
            backend, ratio, source = cached
            return (backend, bucket, 0, None, source), [ratio if b == backend else math.inf for b in BACKENDS]
        if not router.tune:
            return f"{NOT_MEASURED} ({envs.TUNE}=0)", list(NONE)
        if router.hooks.serving():
            return SERVING, list(NONE)
        if router.spent >= PROCESS_BUDGET_S:
            return (
                f"{NOT_MEASURED} (the process's {PROCESS_BUDGET_S:.0f} s measurement budget is spent)",
                list(NONE),
            )
        began = time.perf_counter()
        tested = [r if r and router._tested(r, args, compress_ratio) is None else None for r in routes]
        stock, ratios = figures(router, args, compress_ratio, bucket, tested)
        router.spent += time.perf_counter() - began
    except Exception as e:  # noqa: BLE001 - a failed measurement leaves the bucket stock
        router.logger.warning(
            "%s measuring %s raised %s: %s; it stays stock", envs.HEAD, name, type(e).__name__, e
        )
        return f"{NOT_MEASURED} (the measurement raised {type(e).__name__})", list(NONE)
    pick = settle(ratios)
    if rank0:
        us = ", ".join(
            f"{b} {stock * r * 1e6:.2f} us" for b, r in zip(BACKENDS, ratios, strict=True) if r < math.inf
        )
        line = (
            f"measured {name} on this GPU (gluon {stock * 1e6:.2f} us, {us}; median of {ROUNDS} graph rounds)"
        )
        router.logger.info("%s %s: %s on this rank", envs.HEAD, line, pick or "gluon")
    complete = all((r is None) == (f == math.inf) for r, f in zip(routes, ratios, strict=True))
    source = "this node's measurement"
    if complete and min(ratios) < math.inf:  # every candidate timed: the bucket's other batches reuse it
        router.node[2][key, bucket, contexts_of(max_model_len)] = (pick or "gluon", min(ratios), source)
    if router.node[0] is not None and complete and min(ratios) < math.inf:
        us, ratio = stock * 1e6, min(ratios)
        row = dict(zip(tuning.COLUMNS, (
            router.gfx, cus, bucket, *key[1:], key[4] > 1, contexts_of(max_model_len), pick or "gluon",
            0, 0, 0, round(us * ratio if pick else us, 4), round(us, 4), round(us * ratio, 4),
        ), strict=True))  # fmt: skip
        why = write_cache(router.node[0], router.node[1], [row])
        if why and rank0 and why not in router.node[3]:  # said once: a refused directory was at the read
            router.logger.warning("%s node cache %s not written: %s", envs.HEAD, router.node[0], why)
    return (pick or "gluon", bucket, 0, None, source), ratios
