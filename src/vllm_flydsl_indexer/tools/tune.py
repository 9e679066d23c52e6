# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer bench --tune OUT.csv``: measure Gluon against FlyDSL per shape.

For the models' indexer shapes (both head counts, KVBlockSize 64 with
preshuffle and 1 without, ``next_n`` 1 and 2) over batch sizes and context
lengths, both kernels run side by side in one process on the same inputs.
Each must first pass the agreement rule against the reference; then each is
timed (device events, median of repeats, input sets rotated) and one row per
shape is written in aiter's tuned-CSV format (:data:`tuning.COLUMNS`) with the
winner in ``backend`` and both times. Rows are merged into an existing file:
a row of the same GPU and shape is replaced, every other row is kept.

Only a gfx950 GPU with both of aiter's kernels gives kernel timings. With
``--reference`` the same mechanics run on the pure-torch reference contracts
anywhere; those rows have ``gfx = reference`` so no GPU ever matches them,
and their times are of the references, not of any kernel.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import statistics
import sys
import time

import torch

from vllm_flydsl_indexer import tuning
from vllm_flydsl_indexer.agreement import REAL_KERNEL_TOLERANCE, compare_in_windows, read_window_ends
from vllm_flydsl_indexer.kernels import WORKGROUPS_PER_CU, cu_count
from vllm_flydsl_indexer.tools import cli_args
from vllm_flydsl_indexer.tools.arms import GLUON_KNOBS, Arms, Workspace, detect_arms, raw_launch
from vllm_flydsl_indexer.tools.reference import (
    make_paged_problem,
)

REFERENCE_GFX = "reference"
GPU_GRID = cli_args.TUNE_GPU_GRID
REFERENCE_GRID = cli_args.TUNE_REFERENCE_GRID
# The row key: a later run replaces a row with the same values of these.
KEY_COLUMNS = tuning.COLUMNS[:9]


def refusal(arms: Arms) -> str | None:
    """Why this machine cannot produce kernel timings, or ``None``."""
    if arms.real:
        return None
    return f"argument --tune: {cli_args.TUNE_NEEDS} ({arms.why}); {cli_args.TUNE_DRY_RUN}"


def _time(fn, problems, warmup: int, repeats: int, device: torch.device) -> float:
    from vllm_flydsl_indexer.tools.bench import Timer

    samples = Timer(device).time_us(lambda i: fn(problems[i % len(problems)]), warmup, repeats)
    return statistics.median(samples)


def tune_rows(args, arms: Arms, device: torch.device, gfx: str) -> list[dict[str, object]]:
    grid = REFERENCE_GRID if not arms.real else GPU_GRID
    pick = {k: getattr(args, k, None) or v for k, v in grid.items()}
    cus = cu_count(device)
    repeats = args.repeats or (20 if device.type == "cuda" else 3)
    n_sets = args.input_sets or (4 if device.type == "cuda" else 2)
    rows: list[dict[str, object]] = []
    shapes = list(
        itertools.product(*(pick[k] for k in ("heads", "block_size", "next_n", "batch", "context_len")))
    )
    for idx, (heads, kvb, next_n, batch, ctx) in enumerate(shapes):
        if not cli_args.bench_shape_fits(batch, next_n, ctx, kvb, args.head_dim):
            print(
                f"tune: skipped H{heads} KVB{kvb} n{next_n} B{batch} ctx{ctx}: KV pool or logits >= 2 GiB",
                file=sys.stderr,
            )
            continue
        gen = torch.Generator().manual_seed(args.seed + idx)
        problems = [
            make_paged_problem(
                [ctx] * batch,
                next_n=next_n,
                heads=heads,
                head_dim=args.head_dim,
                block_size=kvb,
                preshuffle=kvb > 1,
                max_model_len=ctx,
                spare_blocks=0,
                generator=gen,
                device=device,
            )
            for _ in range(n_sets)
        ]
        workspace = Workspace(batch * next_n, ctx, device)
        p0 = problems[0]
        expected = torch.full((batch * next_n, ctx), float("nan"), device=device)
        p0.reference_logits(expected, "flydsl")
        ends = read_window_ends(p0.context_lens, batch * next_n, next_n)
        times = {}
        for backend, kernel, knobs in (("gluon", arms.gluon, GLUON_KNOBS), ("flydsl", arms.flydsl, {})):
            run = raw_launch(kernel, workspace.get, **knobs)
            workspace.buffer.fill_(float("nan"))
            agreement = compare_in_windows(expected, run(p0).clone(), ends, topk=2048)
            if not agreement.ok(REAL_KERNEL_TOLERANCE if arms.real else 0.0):
                raise SystemExit(
                    f"tune: {backend} failed the agreement rule at H{heads} KVB{kvb} n{next_n} "
                    f"B{batch} ctx{ctx}: {agreement.describe()}"
                )
            times[backend] = _time(run, problems, args.warmup, repeats, device)
        winner = min(times, key=times.get)
        rows.append(
            dict(
                zip(
                    tuning.COLUMNS,
                    (
                        gfx,
                        cus,
                        batch,
                        next_n,
                        heads,
                        args.head_dim,
                        kvb,
                        int(kvb > 1),
                        ctx,
                        winner,
                        GLUON_KNOBS["ChunkK"],
                        GLUON_KNOBS["WavePerEU"],
                        WORKGROUPS_PER_CU,
                        round(times[winner], 3),
                        round(times["gluon"], 3),
                        round(times["flydsl"], 3),
                    ),
                    strict=True,
                )
            )
        )
        print(
            f"tune: H{heads} KVB{kvb} n{next_n} B{batch} ctx{ctx}: gluon {times['gluon']:.1f} us, "
            f"flydsl {times['flydsl']:.1f} us -> {winner}",
            file=sys.stderr,
        )
    return rows


def existing_rows(path: str) -> list[dict[str, str]]:
    """The rows already in ``path`` (none if absent or empty); refuses a file that is not aiter's format.

    ``cli_args.tune_file_problem`` refused such a file before the run; this is the read itself.
    """
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != tuning.COLUMNS:
            raise SystemExit(f"bench --tune: {path} is not an aiter-format tuned CSV; not overwriting it")
        return list(reader)


def table_text(earlier: list[dict[str, str]], rows: list[dict[str, object]]) -> tuple[str, int]:
    """The merged table: ``rows`` replace earlier rows of the same key, the rest are kept (and counted)."""
    new_keys = {tuple(str(r[c]) for c in KEY_COLUMNS) for r in rows}
    kept = [r for r in earlier if tuple(r[c] for c in KEY_COLUMNS) not in new_keys]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(tuning.COLUMNS))
    writer.writeheader()
    writer.writerows(kept)
    writer.writerows(rows)
    return out.getvalue(), len(kept)


def merge(path: str, earlier: list[dict[str, str]], rows: list[dict[str, object]]) -> int:
    """Write ``rows`` into ``path``, replacing earlier rows of the same key and keeping the rest."""
    text, kept = table_text(earlier, rows)
    with open(path, "w", newline="") as f:
        f.write(text)
    return kept


def main(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    arms = detect_arms(device, force_reference=args.reference)
    problem = refusal(arms) if not args.reference else None
    if problem is not None:
        cli_args.fail(f"{cli_args.PROG} bench", problem)
    earlier = existing_rows(args.tune_path)  # before any work: never time, then refuse to write
    if arms.real:
        gfx = tuning.arch_of(torch.cuda.get_device_properties(device).gcnArchName)
    else:
        gfx = REFERENCE_GFX
    rows = tune_rows(args, arms, device, gfx)
    what = "kernel timings" if arms.real else "REFERENCE timings, not kernel timings (gfx=reference)"
    text, kept = table_text(earlier, rows)
    failed = []
    try:
        with open(args.tune_path, "w", newline="") as f:
            f.write(text)
    except OSError as e:  # opened before the run, so rare: the rows go to stdout, not lost
        print(f"--- the tuned table that could not be written to {args.tune_path} ---")
        print(f"{text.rstrip()}\n--- end ---")
        failed.append(f"bench --tune: could not write {args.tune_path} ({e.strerror or e}); printed it above")
    else:
        print(f"bench --tune: wrote {len(rows)} rows ({what}) to {args.tune_path}, kept {kept} earlier rows")
    if args.json_path:
        data = {
            "meta": {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "gfx": gfx,
                "arms": arms.label,
                "arms_why": arms.why,
                "timings": what,
                "tuned_csv": os.path.basename(args.tune_path),
                "kept_earlier_rows": kept,
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
            },
            "rows": rows,
        }
        text = json.dumps(data, indent=1)
        try:
            with open(args.json_path, "w") as f:
                f.write(text)
        except OSError as e:
            print(f"--- the JSON that could not be written to {args.json_path} ---\n{text}\n--- end ---")
            failed.append(f"bench --tune: could not write JSON to {args.json_path} ({e.strerror or e})")
        else:
            print(f"bench --tune: wrote JSON to {os.path.abspath(args.json_path)}")
    for line in failed:
        print(line, file=sys.stderr)
    return 1 if failed else 0
