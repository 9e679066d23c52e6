"""``vllm-flydsl-indexer tune --out OUT.csv`` (old spelling ``bench --tune OUT.csv``): Gluon against FlyDSL
per shape, into a table.

For the models' indexer shapes (both head counts, KVBlockSize 64 with
preshuffle and 1 without, ``next_n`` 1 and 2) over batch sizes, both kernels run
side by side in one process on the same inputs, as aiter's own tuner
(``csrc/paged_mqa_logits/paged_mqa_logits_tune.py``) runs them:

* **Candidates:** stock, which this plugin never re-tunes (vLLM's own Gluon
  call, :data:`~vllm_flydsl_indexer.tools.arms.GLUON_KNOBS`), and FlyDSL at
  every ``wg_per_cu`` aiter's tuner sweeps (:data:`kernels.TUNER_WG_PER_CU`)
  where the found kernel's launch takes SplitKV; a kernel that takes none is
  measured at its default launch (``wg_per_cu`` 0). Each FlyDSL candidate is
  launched exactly as the router would launch it
  (:meth:`KernelVariant.launch_kwargs`, with a row width of
  :data:`settings.TUNE_MAX_MODEL_LEN`, aiter's tuner's default); a shape the kernel's
  contract refuses has no FlyDSL candidate.
* **Gate, then time:** each candidate must pass the agreement rule against the
  reference, then is timed (device events, median of repeats, input sets
  rotated) at every context length of the grid.
* **One row per shape and batch,** in aiter's tuned-CSV format
  (:data:`tuned.COLUMNS`): the candidate with the lowest geometric mean over
  the context lengths (written ``8192;32768``), its knob (FlyDSL:
  ``0,0,wg_per_cu``; Gluon: ``ChunkK,WavePerEU,0``), and each backend's best
  time. aiter's dispatcher reads such a row exactly as the plugin does.

Rows are merged into an existing file, which must pass :func:`tuned.check_row`
on every row (a malformed file is refused before any work and left untouched):
a row of the same GPU and lookup key (:data:`tuned.KEY_COLUMNS`) is replaced,
every other row is kept as it was. The merge holds the table's exclusive lock
(:func:`outputs.locked`, the one ``tune --model`` holds on the node cache) and reads the table again under
it, so tunes run at once into one table keep every row. The file is written atomically. A SIGINT or
SIGTERM stops at the next timed call, dropping the shape being measured: the
finished rows are merged and written, the JSON says ``interrupted``, and the
exit status is 130.

Only a gfx950 GPU with both of aiter's kernels gives kernel timings. With
``--reference`` the same mechanics run on the pure-torch reference contracts
anywhere, the FlyDSL reference launched as the gfx950 kernels are (explicit
SplitKV, so the sweep runs too); those rows have ``gfx = reference`` so no GPU
ever matches them, and their times are of the references, not of any kernel.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from vllm_flydsl_indexer.kernels import TUNER_WG_PER_CU, WORKGROUPS_PER_CU, KernelVariant, cu_count
from vllm_flydsl_indexer.selftest import REAL_KERNEL_TOLERANCE, read_window_ends
from vllm_flydsl_indexer.tools import cli_args, outputs, settings, tuned
from vllm_flydsl_indexer.tools.arms import GLUON_KNOBS, Arms, Workspace, detect_arms, raw_launch
from vllm_flydsl_indexer.tools.harness import Timer, compare_in_windows, device_of, write_or_print
from vllm_flydsl_indexer.tools.interrupt import EXIT_INTERRUPTED, Stopped, StopSignal, interrupted_note
from vllm_flydsl_indexer.tools.reference import PagedProblem, make_paged_problem, per_sequence_lens
from vllm_flydsl_indexer.tools.streams import safe_line

__all__ = [
    "REFERENCE_GFX",
    "Sweep",
    "candidates",
    "flydsl_launch",
    "main",
    "merge",
    "table_text",
    "tuned_wg_per_cu",
    "tune_rows",
    "tuned_variant",
]

REFERENCE_GFX = "reference"


@dataclasses.dataclass
class Sweep:
    """How far a run got: shapes planned and finished, and whether it was interrupted."""

    planned: int = 0
    done: int = 0
    interrupted: bool = False


def tuned_variant(arms: Arms) -> KernelVariant:
    """The FlyDSL API the rows are measured on: the found one, or the reference launched as gfx950's."""
    variant = arms.flydsl_variant()
    if arms.real:
        return variant
    return dataclasses.replace(
        variant,
        name="reference",
        description="reference contract, launched as the gfx950 kernels are (explicit SplitKV)",
        split_kv_workgroups_per_cu=WORKGROUPS_PER_CU,
    )


def _time(
    fn, problems, warmup: int, repeats: int, device: torch.device, stop: StopSignal | None = None
) -> float:
    samples = Timer(device, stop).time_us(lambda i: fn(problems[i % len(problems)]), warmup, repeats)
    return statistics.median(samples)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))


def flydsl_launch(
    variant: KernelVariant, output_buffer: Callable[[int, int], torch.Tensor], cus: int, wg_per_cu: int
) -> Callable[[PagedProblem], torch.Tensor]:
    """FlyDSL on a problem with exactly the router's launch for a row of knob ``wg_per_cu``.

    The launch arguments are computed once per shape, as the router memoises them, so the timed
    calls pay no host work the router does not.
    """
    memo: dict[tuple[int, int, int], dict[str, object]] = {}

    def run(p: PagedProblem) -> torch.Tensor:
        out = output_buffer(p.batch * p.next_n, p.max_model_len)
        key = (p.batch, p.block_size, p.max_model_len)
        if key not in memo:
            memo[key] = variant.launch_kwargs(p.batch, p.block_size, p.max_model_len, cus, wg_per_cu)
        kwargs = memo[key]
        lens = per_sequence_lens(p.context_lens, p.batch).contiguous()
        variant.fn(p.q_fp8, p.kv_cache, p.weights, out, lens, p.block_tables, p.max_model_len, **kwargs)
        return out

    return run


def candidates(
    variant: KernelVariant, arms: Arms, workspace: Workspace, cus: int, p: PagedProblem
) -> dict[str, tuple[str, int, Callable]]:
    """``{name: (backend, wg_per_cu, run)}``: stock's one call; FlyDSL's where its contract takes ``p``."""
    out = {"gluon": ("gluon", 0, raw_launch(arms.gluon, workspace.get, **GLUON_KNOBS))}
    if variant.violation(p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables) is None:
        for wg in tuned_wg_per_cu(variant):
            out[f"flydsl wg_per_cu={wg}"] = ("flydsl", wg, flydsl_launch(variant, workspace.get, cus, wg))
    return out


def tune_rows(
    args,
    arms: Arms,
    device: torch.device,
    gfx: str,
    stop: StopSignal | None = None,
    sweep: Sweep | None = None,
) -> list[dict[str, object]]:
    """One measured row per shape and batch; once ``stop`` is requested, stops at the next timed call and
    drops the shape under way."""
    pick = settings.grid(args, device.type)
    cus = cu_count(device)
    variant = tuned_variant(arms)
    default_repeats, default_sets = settings.BENCH_TIMING["cuda" if device.type == "cuda" else "cpu"]
    repeats = args.repeats or default_repeats
    n_sets = args.input_sets or default_sets
    sweep = sweep if sweep is not None else Sweep()
    rows: list[dict[str, object]] = []
    shapes = list(itertools.product(*(pick[k] for k in ("heads", "block_size", "next_n", "batch"))))
    sweep.planned = len(shapes)
    told_stock: set[tuple[int, int, int]] = set()
    for idx, (heads, kvb, next_n, batch) in enumerate(shapes):
        if stop is not None and stop.requested:
            sweep.interrupted = True
            break
        label = f"H{heads} KVB{kvb} n{next_n} B{batch}"
        contexts = []
        for ctx in pick["context_len"]:
            problem = settings.shape_fits(batch, next_n, ctx, kvb, args.head_dim, settings.TUNE_MAX_MODEL_LEN)
            if problem is None:
                contexts.append(ctx)
            else:
                print(f"tune: skipped {label} ctx{ctx}: {problem}", file=sys.stderr)
        if not contexts:
            sweep.done += 1
            continue
        times: dict[str, list[float]] = {}
        knobs: dict[str, tuple[str, int]] = {}
        shape = dict(next_n=next_n, heads=heads, head_dim=args.head_dim, block_size=kvb, preshuffle=kvb > 1)
        shape |= dict(spare_blocks=0, device=device)  # the timed inputs hold the blocks they read, no more
        for c, ctx in enumerate(contexts):
            gen = torch.Generator().manual_seed(args.seed + idx * len(contexts) + c)
            width = max(settings.TUNE_MAX_MODEL_LEN, ctx)
            problems = []
            for _ in range(n_sets):
                if stop is not None and stop.requested:  # heard between builds too, not only between calls
                    sweep.interrupted = True
                    return rows
                problems.append(
                    make_paged_problem([ctx] * batch, max_model_len=width, generator=gen, **shape)
                )
            workspace = Workspace(batch * next_n, width, device)
            p0 = problems[0]
            expected = torch.full((batch * next_n, width), float("nan"), device=device)
            p0.reference_logits(expected, "flydsl")
            ends = read_window_ends(p0.context_lens, batch * next_n, next_n)
            for name, (backend, wg, run) in candidates(variant, arms, workspace, cus, p0).items():
                workspace.buffer.fill_(float("nan"))
                agreement = compare_in_windows(expected, run(p0).clone(), ends, topk=settings.DEFAULT_TOPK)
                if not agreement.ok(REAL_KERNEL_TOLERANCE if arms.real else 0.0):
                    raise SystemExit(
                        f"tune: {name} failed the agreement rule at {label} ctx{ctx}: {agreement.describe()}"
                    )
                knobs[name] = (backend, wg)
                try:
                    times.setdefault(name, []).append(
                        _time(run, problems, args.warmup, repeats, device, stop)
                    )
                except Stopped:  # between two timed calls: this shape is dropped, the sweep ends
                    sweep.interrupted = True
                    return rows
        scores = {name: _geomean(t) for name, t in times.items() if len(t) == len(contexts)}
        best = {}
        for name, us in scores.items():
            backend = knobs[name][0]
            if backend not in best or us < scores[best[backend]]:
                best[backend] = name
        winner = min(best.values(), key=scores.get)
        backend, wg = knobs[winner]
        if "flydsl" not in best and (heads, kvb, next_n) not in told_stock:
            told_stock.add((heads, kvb, next_n))
            print(
                f"tune: {label}: no FlyDSL candidate ({variant.name} kernel's contract refuses the shape); "
                "stock only",
                file=sys.stderr,
            )
        # aiter's columns (tuned.COLUMNS): the key, the contexts, the winner and its knobs, the times.
        key = (gfx, cus, batch, next_n, heads, args.head_dim, kvb, int(kvb > 1))
        knob = (GLUON_KNOBS["ChunkK"], GLUON_KNOBS["WavePerEU"], 0) if backend == "gluon" else (0, 0, wg)
        times_us = [round(scores[best[b]], 3) if b in best else "" for b in ("gluon", "flydsl")]
        context_len = tuned.CONTEXT_LEN_SEPARATOR.join(str(c) for c in sorted(contexts))
        values = (*key, context_len, backend, *knob, round(scores[winner], 3), *times_us)
        row = dict(zip(tuned.COLUMNS, values, strict=True))
        rows.append(row)
        sweep.done += 1
        measured = ", ".join(f"{name} {scores[name]:.1f} us" for name in scores)
        print(
            f"tune: [{sweep.done}/{sweep.planned}] {label} ctx {row['context_len']}: {measured} -> {winner}",
            file=sys.stderr,
        )
    return rows


def tuned_wg_per_cu(variant: KernelVariant) -> tuple[int, ...]:
    """The ``wg_per_cu`` values measured: aiter's tuner's sweep where the API's launch takes SplitKV,
    else only the default launch (``0``)."""
    return TUNER_WG_PER_CU if variant.split_kv_workgroups_per_cu is not None else (0,)


def _row_id(row: dict[str, object]) -> tuple:
    """A measured row's lookup identity, validated: what this tool writes, the plugin reads back."""
    checked = tuned.check_row({k: str(v) for k, v in row.items()})
    return (checked.gfx, checked.key)


def table_text(earlier: tuple | None, rows: list[dict[str, object]]) -> tuple[str, int]:
    """The merged table: ``rows`` replace the rows of ``earlier`` (:func:`cli_args.tune_file`'s table, or
    ``None``) of the same gfx and key; the rest, and every ``#`` line, are kept as read and in place; new rows
    at the end. LF line endings, as aiter's table."""
    import csv

    _, earlier_rows, earlier_comments = earlier or ((), [], [])
    rows = list({_row_id(r): r for r in rows}.values())  # one row per key: the last measured
    new_ids = {_row_id(r) for r in rows}
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(tuned.COLUMNS), lineterminator="\n")
    comments: dict[int, list[str]] = {}
    for place, line in earlier_comments:
        comments.setdefault(place, []).append(line)
    out.writelines(f"{line}\n" for line in comments.get(-1, ()))
    writer.writeheader()
    kept = 0
    for i, r in enumerate(earlier_rows):
        out.writelines(f"{line}\n" for line in comments.get(i, ()))
        if (r.gfx, r.key) not in new_ids:
            writer.writerow(r.text)
            kept += 1
    out.writelines(f"{line}\n" for line in comments.get(len(earlier_rows), ()))
    writer.writerows(rows)
    return out.getvalue(), kept


def merge(path: str, rows: list[dict[str, object]], label: str = "tune --out") -> tuple[int | None, str]:
    """Merge ``rows`` into the table at ``path`` under its exclusive lock (:func:`outputs.locked`),
    reading the table again once the lock is held, so a tune that wrote it meanwhile keeps its rows.

    ``(kept, "kept N earlier rows")``, or ``(None, why)`` when the table cannot be merged into any more
    (it changed into something else during the run) or written; then the merged rows are printed to
    stdout, so that what was measured is never lost. ``label`` is the command as typed.
    """
    with outputs.locked(path):
        earlier, problem = cli_args.tune_file(path, label.rpartition(" ")[2])
        if problem is None:
            text, kept = table_text(earlier, rows)
            ok, line = write_or_print(label, "tuned table", path, text, newline="")
            return (kept, f"kept {kept} earlier rows") if ok else (None, line)
    text, _ = table_text(None, rows)
    print(safe_line(f"--- the tuned rows that could not be merged into {path} ---"))
    print(f"{text.rstrip()}\n--- end ---")
    why = problem.partition(": ")[2]
    return None, safe_line(f"{label}: {why}; the measured rows are printed above")


def main(args) -> int:
    flag = cli_args.out_flag(args)
    label = f"{args.command} {flag}"  # as typed: tune --out, or bench --tune (its old spelling)
    device = device_of(args)
    arms = detect_arms(device, force_reference=args.reference)
    # Before any work: no kernel timings here, or a table that cannot be merged into (the parser checked
    # both without probing aiter; the file may have changed since).
    earlier, problem = cli_args.tune_file(args.tune_path, flag)
    if not (arms.real or args.reference):
        problem = f"argument {flag}: {settings.TUNE_NEEDS} ({arms.why}); {settings.TUNE_DRY_RUN}"
    if problem is not None:
        settings.fail(f"{settings.PROG} {args.command}", problem)
    if args.command == "bench":
        print(f"{settings.PROG} {label}: {settings.TUNE_ALIAS}", file=sys.stderr)
    gfx = tuned.arch_of(torch.cuda.get_device_properties(device).gcnArchName) if arms.real else REFERENCE_GFX
    sweep = Sweep()
    with StopSignal(per_call=True) as stop:
        rows = tune_rows(args, arms, device, gfx, stop, sweep)
    what = "kernel timings" if arms.real else "REFERENCE timings, not kernel timings (gfx=reference)"
    # Every file first, then the report: a stdout that fails (closed, full, a reader gone) loses
    # nothing (tools/streams.py).
    report, failed = [], []
    if not rows and sweep.interrupted:
        report.append(safe_line(f"{label}: no shape finished; {args.tune_path} left as it was"))
        kept = len(earlier[1]) if earlier else 0
    else:
        kept, line = merge(args.tune_path, rows, label)
        if kept is not None:
            report.append(safe_line(f"{label}: wrote {len(rows)} rows ({what}) to {args.tune_path}, {line}"))
        else:
            failed.append(line)
    if args.json_path:
        data = {
            "meta": {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "gfx": gfx,
                "arms": arms.label,
                "arms_why": arms.why,
                "flydsl_variant": tuned_variant(arms).name,
                "wg_per_cu_swept": list(tuned_wg_per_cu(tuned_variant(arms))),
                "max_model_len": settings.TUNE_MAX_MODEL_LEN,
                "timings": what,
                "tuned_csv": os.path.basename(args.tune_path),
                "kept_earlier_rows": kept,
                "interrupted": sweep.interrupted,
                "completed": sweep.done,
                "planned": sweep.planned,
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
            },
            "rows": rows,
        }
        ok, line = write_or_print(label, "JSON", args.json_path, json.dumps(data, indent=1))
        (report if ok else failed).append(line)
    for line in report:
        print(line)
    for line in failed:
        print(line, file=sys.stderr)
    if sweep.interrupted:
        print(interrupted_note(sweep.done, sweep.planned), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 1 if failed else 0
