# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer tune --model M``: this node's measurement, made ahead of serving (issue 44);
``tune --out FILE`` is :mod:`.tune`'s table.

The plugin times a bucket no table covers at its first eager call (:func:`measure.local`) and caches the
verdict on the node (:func:`measure.cache_path`). This command makes the same measurement now, for every
bucket the model will use, so serving starts with every verdict cached:

* **Buckets:** the model's indexer heads and head_dim (:func:`reach.resolve`, :func:`reach.shape_of`), its
  next_n (1, and 1 + its MTP layers where config.json has ``num_nextn_predict_layers``; or ``--next-n``),
  KVBlockSize :data:`settings.TUNE_MODEL_BLOCK_SIZE` preshuffled, and the power-of-two floors
  (:func:`measure.bucket_of`) of vLLM's default CUDA-graph capture sizes
  (:data:`settings.VLLM_CAPTURE_SIZES`), capped by ``--max-batch``.
* **How:** the router is built as ``register()`` builds it: the found kernel
  (:func:`kernels.find_kernel`), stock as :func:`paths.build_paths` gives it (vLLM's own function and hooks
  where vLLM would run aiter's Gluon kernel, else this package's stock copy), the table
  :func:`tuning.load` picks, the self-test as ``VLLM_FLYDSL_INDEXER_SELFTEST`` says, ``tune=True`` and the
  device's gfx. Each bucket is one ``router.pick`` on a synthetic problem of that bucket
  (:func:`reference.make_paged_problem`, over a cache pool the size serving's would read); the
  measurement, the cache write and ``router.verdicts`` are the plugin's own.
* **Report:** a progress line per bucket, then a table: heads, next_n, KVBlockSize, batch bucket, winner,
  speedup (stock's time over the winner's, from the row's ``gluon_us`` and ``us``) and where the verdict
  came from (measured now, cached by an earlier run, AMD's built-in table or the user's table), and the
  cache file. A Ctrl-C stops after the bucket under way (each bucket is in the cache once measured),
  prints what finished and exits 130.
* **Honest about the cache:** the cache must be writable before anything is measured (its directory made
  and judged as :func:`measure.write_cache` makes and judges it, a temporary file made and removed there);
  after the run every row measured now is read back from the file, and the rows missing there are written
  once more through :func:`measure.write_cache`, whose reason names why a row is still missing. Such a
  bucket reads ``NOT cached``, the last line says why, and the exit status is 1.
* **One writer, one lock:** every row goes through the plugin's own writer (:func:`measure.write_cache`),
  and the run holds the cache's lock (:func:`outputs.locked`, the one ``tune --out`` merges a table under),
  so a second tune waits, saying so, then finds the first's buckets cached instead of timing a busy GPU.

Without aiter's FlyDSL kernel, a gfx950 device or aiter's Gluon kernel nothing can be measured; with a cache
that cannot be written, nothing would be kept: one line, exit 1. A bucket too large for the measurement's
own limit (:data:`measure.MAX_EXTRA_BYTES`) is refused before any work, exit 2. Tools wing only.
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_flydsl_indexer import envs, measure, tuning
from vllm_flydsl_indexer.kernels import cu_count, find_kernel
from vllm_flydsl_indexer.target import I32_OFFSET_LIMIT, SCALE_BYTES, multi_row_objection
from vllm_flydsl_indexer.tools import outputs, reach, settings
from vllm_flydsl_indexer.tools.arms import kernel_arms
from vllm_flydsl_indexer.tools.doctor import cache_dir, cache_dir_problem
from vllm_flydsl_indexer.tools.harness import with_once
from vllm_flydsl_indexer.tools.interrupt import EXIT_INTERRUPTED, StopSignal, interrupted_note
from vllm_flydsl_indexer.tools.paths import build_paths
from vllm_flydsl_indexer.tools.progress import Progress
from vllm_flydsl_indexer.tools.reference import make_paged_problem
from vllm_flydsl_indexer.tools.streams import safe_line
from vllm_flydsl_indexer.tools.table import format_table

__all__ = [
    "CACHED",
    "MEASURED",
    "NOT_CACHED",
    "Bucket",
    "batch_buckets",
    "device_gfx",
    "main",
    "next_ns_of",
    "render",
    "size_problem",
]

TOOL = f"{settings.PROG} tune"
MEASURED = "measured now on this node"
CACHED = "cached (an earlier run on this node)"
NOT_CACHED = f"{MEASURED}, NOT cached"
WINNERS = {"gluon": "stock (Gluon)", "flydsl": "FlyDSL"}
NOTHING = f"{TOOL}: nothing can be measured here"


@dataclass
class Bucket:
    """One bucket's verdict, as the table prints it."""

    heads: int
    head_dim: int
    next_n: int
    block_size: int
    batch: int
    winner: str = ""
    speedup: float | None = None
    source: str = ""
    measured: bool = True  # False: it should have been measured and was not (the measurement failed)
    at: tuple | None = None  # its node cache row's key (shape key, bucket, contexts), where one was measured


def batch_buckets(next_n: int, max_batch: int | None) -> list[int]:
    """The batch buckets vLLM's default CUDA-graph capture sizes reach at ``next_n`` rows per sequence."""
    sizes = {max(size // next_n, 1) for size in settings.VLLM_CAPTURE_SIZES}
    return sorted({measure.bucket_of(s) for s in sizes if max_batch is None or s <= max_batch})


def next_ns_of(config: dict | None) -> tuple[tuple[int, ...], str]:
    """The model's next_n values and where they come from: 1, and 1 + its MTP layers where config.json
    declares them (vLLM's MTP speculative config takes that many tokens unless told otherwise)."""
    layers = (config or {}).get("num_nextn_predict_layers")
    if type(layers) is int and 0 < layers < settings.TUNE_MODEL_MAX_NEXT_N:
        return (1, 1 + layers), f"{1 + layers} for MTP: num_nextn_predict_layers {layers}"
    return (1,), "no MTP layers in its config; --next-n adds more"


def device_gfx(device: torch.device) -> tuple[str | None, str]:
    """``(gfx, where from)`` of ``device``, or ``(None, why not)``. Without a GPU (the CPU simulation),
    the arch vLLM reports, else the one amdsmi reports."""
    if device.type == "cuda":
        if torch.version.hip is None:
            return None, f"this GPU ({torch.cuda.get_device_name(device)}) is not a ROCm one"
        arch = torch.cuda.get_device_properties(device).gcnArchName
        return tuning.arch_of(arch), torch.cuda.get_device_name(device)
    from vllm_flydsl_indexer import gates

    arch = gates.gcn_arch()
    if arch:
        return tuning.arch_of(arch), "no GPU in torch; the arch vLLM reports"
    try:
        import amdsmi

        amdsmi.amdsmi_init()
        handle = amdsmi.amdsmi_get_processor_handles()[0]
        arch = amdsmi.amdsmi_get_gpu_asic_info(handle)["target_graphics_version"]
    except Exception as e:  # noqa: BLE001 - no amdsmi, no GPU: no arch
        return None, f"torch sees no GPU and amdsmi reports none ({type(e).__name__}: {e})"
    return tuning.arch_of(str(arch)), "no GPU in torch; the arch amdsmi reports"


def _refusal(device: torch.device) -> tuple[tuple | None, str | None]:
    """``(variant, arms, gfx, device label)``, or why nothing can be measured on this machine."""
    variant, reason = find_kernel()
    if variant is None:
        return None, f"aiter has no usable FlyDSL kernel ({reason})"
    if variant.own_table:
        return None, (
            f"aiter's tuned dispatcher ({variant.location}) picks each shape from its own table, and the "
            "plugin then never reads this node's cache"
        )
    gfx, where = device_gfx(device)
    if gfx is None:
        return None, f"no gfx950 GPU: {where}"
    if gfx != "gfx950":
        return None, f"the device is {gfx} ({where}); aiter's FlyDSL kernel is gfx950's"
    arms = kernel_arms(variant)
    if isinstance(arms, str):
        return None, arms
    return (variant, arms, gfx, where), None


def _logger() -> logging.Logger:
    """The router's logger here: its WARNINGs and ERRORs (a self-test that failed, a cache not written) on
    stderr; its INFO lines are the table's rows."""
    logger = logging.getLogger("vllm_flydsl_indexer.tools.tune_model")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)
    return with_once(logger)


def _figures(path: str) -> dict[tuple, tuple[float, float]]:
    """``{(cus, batch, next_n, heads, head_dim, KVBlockSize): (us, gluon_us)}`` of a tuned CSV's rows with
    both times; a row or a file that does not read is left out."""
    try:
        text = "".join(line for line in io.StringIO(tuning.read_capped(path)) if line[:1] != tuning.COMMENT)
    except Exception:  # noqa: BLE001 - no file yet, or one the plugin also ignores: no figures
        return {}
    found = {}
    for row in csv.DictReader(io.StringIO(text)):
        try:
            key = tuple(int(float(row[c])) for c in tuning.SIZE_COLUMNS)
            found[key] = (float(row["us"]), float(row["gluon_us"]))
        except (KeyError, TypeError, ValueError):
            continue
    return found


def size_problem(plan: list[tuple[int, int]], heads: int, head_dim: int, max_model_len: int) -> str | None:
    """Why a bucket of ``plan`` (``(next_n, batch)`` pairs) cannot be measured, before anything is allocated,
    or ``None``: its timing problem (q and weights of every row, a block table per context) over the
    measurement's own limit, :data:`measure.MAX_EXTRA_BYTES`, which the plugin applies at serving too."""
    most = -(-max(map(int, measure.contexts_of(max_model_len).split(";"))) // settings.TUNE_MODEL_BLOCK_SIZE)

    def need(next_n: int, batch: int) -> int:  # measure.figures's own sum
        return batch * next_n * heads * (head_dim + SCALE_BYTES) + batch * most * 4

    over = [(n, b) for n, b in plan if need(n, b) > measure.MAX_EXTRA_BYTES]
    if not over:
        return None
    limit = f"{measure.MAX_EXTRA_BYTES >> 20} MiB"
    n, b = min(over, key=lambda p: p[1])
    what = f"heads={heads} head_dim={head_dim}: batch {b} at next_n {n} needs {need(n, b) / 2**20:.0f} MiB"
    fits = [b for n, b in plan if all(need(m, b) <= measure.MAX_EXTRA_BYTES for m, _ in plan)]
    if not fits:
        return f"--model: {what} to time, over the measurement's {limit} (the plugin keeps it stock too)"
    return (
        f"argument --max-batch: must be at most {max(fits)} for {what} to time, over the measurement's "
        f"{limit} (the plugin keeps such a bucket stock)"
    )


def _unwritten(cache: Path, stack: str, gfx: str, cus: int, router, buckets: list[Bucket]) -> str | None:
    """Each bucket measured now whose row is not in the cache file is marked :data:`NOT_CACHED`; why, or
    ``None`` when every one is there. The missing rows are written once more through the plugin's writer
    (a serving process, which takes no lock, may have merged them away), whose answer is the reason."""
    measured = [b for b in buckets if b.source == MEASURED]
    rows = router.node[2] if router.node else {}

    def missing() -> list[Bucket]:
        on_file = measure.load_cache(cache, stack, gfx, cus)[0]
        return [
            b
            for b in measured
            if b.at not in rows or on_file.get(b.at, {}).get("backend") != rows[b.at]["backend"]
        ]

    lost = missing()
    untimed = [b for b in lost if b.at not in rows]  # not every candidate timed: the plugin keeps no row
    why = (
        measure.write_cache(cache, stack, [rows[b.at] for b in lost if b.at in rows])
        if len(lost) > len(untimed)
        else None
    )
    lost = missing() if why is None else lost
    for b in lost:
        b.source = NOT_CACHED
    if not lost:
        return None
    if why is None and untimed == lost:
        return "not every candidate could be timed, and the plugin caches a bucket only when each was"
    return why or "the rows were written but do not read back"


def _table_source(table: tuning.TunedTable) -> tuple[str, str]:
    """How the report names a table, and its file."""
    if table.origin == "built-in":
        return "AMD's built-in table (MI355X measurements)", tuning.BUILTIN_PATH
    return f"your table {table.name} ({envs.TUNED_CSV})", table.name


def _pool(device: torch.device, largest: int, max_model_len: int, index_dim: int) -> torch.Tensor:
    """An indexer cache pool as large as serving's would be read at the largest bucket (the timing reads
    pages, never values), under FlyDSL's 2 GiB addressing."""
    block = settings.TUNE_MODEL_BLOCK_SIZE
    pages = largest * -(-min(max(measure.CONTEXTS), max_model_len) // block) + 2
    pages = min(pages, (I32_OFFSET_LIMIT - 1) // (block * index_dim))
    return torch.zeros(pages, block, 1, index_dim, dtype=torch.uint8, device=device)


def render(buckets: list[Bucket]) -> list[str]:
    rows = [("heads", "next_n", "KVBlockSize", "batch", "winner", "speedup", "source")]
    for b in buckets:
        speedup = f"{b.speedup:.2f}x" if b.speedup is not None else "-"
        rows.append(
            (str(b.heads), str(b.next_n), str(b.block_size), str(b.batch), b.winner, speedup, b.source)
        )
    return format_table(rows, keep=4)


def main(args: argparse.Namespace) -> int:
    model_type, config = reach.resolve(args.model)  # checked by the parser: cannot fail here
    model = reach.MODELS[model_type]
    heads, head_dim, shape_source = reach.shape_of(config, model)
    next_ns, next_source = (tuple(args.next_n), "--next-n") if args.next_n else next_ns_of(config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    max_model_len = settings.TUNE_MAX_MODEL_LEN if gpu else settings.TUNE_MODEL_CPU_MAX_MODEL_LEN
    plan = [(n, b) for n in next_ns for b in batch_buckets(n, args.max_batch)]
    if problem := size_problem(plan, heads, head_dim, max_model_len):
        settings.fail(TOOL, problem.replace("--model:", f"--model {args.model}:", 1))
    found, why = _refusal(device)
    if found is None:
        print(safe_line(f"{NOTHING}: {why}"), file=sys.stderr)
        return 1
    variant, arms, gfx, where = found
    cus, block = cu_count(device), settings.TUNE_MODEL_BLOCK_SIZE
    # Nothing is measured that could not be kept: the cache is judged as its writer judges it, first.
    stack, (directory, why) = measure.cache_key(device, gfx, cus), cache_dir()
    cache = measure.cache_path(gfx, cus, stack) if stack and directory else None
    if stack is None:
        unread = ", ".join(k for k, v in measure.stack_versions().items() if v == "unknown")
        why = f"the cache is keyed on the stack's versions, and {unread} cannot be read here"
    elif cache is not None:
        why = cache_dir_problem(directory, make=True)
        if why is None and os.path.isdir(cache) and not os.path.islink(cache):
            why = f"{cache} is a directory, which the cache file cannot replace"
    if why is not None or cache is None:
        print(safe_line(f"{TOOL}: nothing measured, since nothing could be cached: {why}"), file=sys.stderr)
        return 1
    logger = _logger()
    paths = build_paths(arms, device, max(b * n for n, b in plan), max_model_len, logger)
    off = (os.environ.get(envs.TUNED_CSV) or "").strip().lower() in tuning.OFF_VALUES
    table, table_label = tuning.load(variant.name, gfx, logger)
    router = paths.make_router(table=table, tune=True, gfx=gfx)
    timing = "device events" if gpu else "the wall clock: a simulation, no GPU"
    units = f"{cus} CU{'s' * (cus != 1)}"
    note = f"note:    {envs.TUNED_CSV} is off: serving takes FlyDSL where eligible and ignores this cache"
    for line in (
        f"model:   {model.label} ({model_type}): heads={heads} head_dim={head_dim} ({shape_source})",
        f"next_n:  {', '.join(map(str, next_ns))} ({next_source}); KVBlockSize {block}, preshuffled",
        f"device:  {gfx}, {units} ({where}); timed with {timing}, contexts clamped to {max_model_len}",
        f"kernel:  {variant.location} ({variant.name})",
        f"stock:   {paths.label}",
        f"tables:  {table_label}",
        *[note] * off,
    ):
        print(safe_line(line))
    buckets: list[Bucket] = []
    contexts = measure.contexts_of(max_model_len)
    with (
        outputs.locked(str(cache), safe_line(f"{TOOL}: waiting for another tune that is filling {cache}")),
        StopSignal("bucket") as stop,
        Progress(len(plan), "tune") as progress,
        paths.session(),
    ):
        pool = _pool(device, max(b for _, b in plan), max_model_len, head_dim + SCALE_BYTES)
        # The node cache as the router will read it: a bucket it covers is cached, not measured.
        node = measure.load_cache(cache, stack, gfx, cus)[0]
        sizes = dict(heads=heads, head_dim=head_dim, block_size=block, preshuffle=True, spare_blocks=0)
        sizes |= dict(max_model_len=max_model_len, device=device)
        for i, (next_n, batch) in enumerate(plan):
            if stop.requested:
                progress.close(interrupted=True)
                break
            progress.step(f"next_n={next_n} batch={batch}")
            row = Bucket(heads, head_dim, next_n, block, batch)
            buckets.append(row)
            gen = torch.Generator().manual_seed(i)
            p = make_paged_problem([max(next_n, block)] * batch, next_n=next_n, generator=gen, **sizes)
            call = (p.q_fp8, pool, p.weights, p.context_lens, p.block_tables, None, max_model_len)
            reason = variant.violation(p.q_fp8, pool, p.weights, p.context_lens, p.block_tables)
            if reason is None and next_n > 1:
                reason = multi_row_objection(model.call_site)
            if reason is not None:  # the router's rules send it to stock before any table or measurement
                row.winner, row.source = "stock", f"the rules: {reason}"
                continue
            row.at = ((cus, next_n, heads, head_dim, block), batch, contexts)
            router.spent = 0.0  # the serving process's budget, not this command's: every bucket is timed
            pick = router.decide(call, 1)
            if isinstance(pick, str) or pick is None:
                row.winner, row.source, row.measured = "stock", pick or "no verdict", False
                continue
            backend, tuned, _, conflict, source = pick
            row.winner = WINNERS.get(backend, backend)
            if source in ("this node's measurement", "this node's cache"):
                row.source = CACHED if row.at in node else MEASURED
                mine = (router.node[2] if router.node else {}).get(row.at)
                us = (float(mine["us"]), float(mine["gluon_us"])) if mine else None
            else:
                row.source, file = _table_source(router.table)
                us = _figures(file).get((cus, tuned, next_n, heads, head_dim, block))
            if conflict:
                row.winner, row.source = "stock", f"{row.source}: {conflict}"
                continue
            row.speedup = us[1] / us[0] if us and us[0] > 0 and math.isfinite(us[1] / us[0]) else None
        unwritten = _unwritten(cache, stack, gfx, cus, router, buckets)
    print()
    for line in render(buckets):
        print(safe_line(line))
    measured = sum(b.source in (MEASURED, NOT_CACHED) for b in buckets)
    lost = sum(b.source == NOT_CACHED for b in buckets)
    if unwritten is None:
        print(safe_line(f"node cache: {cache} ({measured} bucket(s) measured now)"))
    else:
        print(
            safe_line(
                f"node cache: {cache}: NOT written: {unwritten}; {lost} of the {measured} bucket(s) measured "
                "now are not cached, so serving measures them again"
            )
        )
    failed = [b for b in buckets if not b.measured]
    if failed:
        print(f"{TOOL}: {len(failed)} bucket(s) got no figures (see above): stock", file=sys.stderr)
    if len(buckets) < len(plan):
        print(interrupted_note(len(buckets), len(plan)), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 1 if failed or unwritten else 0
