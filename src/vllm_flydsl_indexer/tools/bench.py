# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer bench``: an honest A/B benchmark of the decode logits.

Arms (every one available here):

* ``gluon`` and ``flydsl``: aiter's kernels, called directly (gfx950 only);
* ``stock-call`` and ``patched-call``: the stock function and the patched
  function exactly as ``check`` runs them (:mod:`vllm_flydsl_indexer.tools.paths`:
  vLLM's own function where vLLM would run aiter's Gluon here, else the
  mirror), end to end, both called from the defining module's call site;
* ``reference``: the pure-torch reference, always. Where the real kernels are
  absent, the two calls run over the reference contracts and say so.

Honest footprint: one distinct physical block per needed block under a
shuffled table, exact context lengths (``--vary-lengths`` to vary them), and
several input sets rotated between iterations so that no case is timed out of
cache. ``kv_mb`` is the distinct KV bytes one input set touches. Every arm
must pass ``check``'s agreement rule before it is timed. Timing uses device
events after warm-up; the median, min and max over repeats are reported.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch

from vllm_flydsl_indexer.selftest import REAL_KERNEL_TOLERANCE, read_window_ends
from vllm_flydsl_indexer.tools import cases, settings
from vllm_flydsl_indexer.tools.arms import GLUON_KNOBS, Arms, detect_arms, raw_launch
from vllm_flydsl_indexer.tools.cases import INDEXER
from vllm_flydsl_indexer.tools.harness import (
    Timer,
    compare_in_windows,
    device_of,
    quiet_logger,
    write_or_print,
)
from vllm_flydsl_indexer.tools.interrupt import (
    EXIT_INTERRUPTED,
    Stopped,
    StopSignal,
    interrupted_note,
    write_atomic_bytes,
)
from vllm_flydsl_indexer.tools.paths import Paths, build_paths
from vllm_flydsl_indexer.tools.progress import Progress
from vllm_flydsl_indexer.tools.reference import PagedProblem, make_paged_problem, per_sequence_lens
from vllm_flydsl_indexer.tools.streams import safe_line
from vllm_flydsl_indexer.tools.table import format_table

__all__ = [
    "ArmResult",
    "CPU_NOTE",
    "Shape",
    "arm_callables",
    "build_problem",
    "copy_bandwidth_gbps",
    "gate",
    "main",
    "plot",
    "render",
    "run",
    "shapes_from",
    "stock_note",
    "stock_reason",
    "traffic",
    "write_outputs",
]

CPU_NOTE = (
    "note: CPU timings show the harness working, not kernel speed "
    "(the reference arms vary severalfold between identical runs)"
)


class Shape(cases.Shape):
    """A point of bench's grid, with its label and sizes."""

    @property
    def label(self) -> str:
        kind = "shuf" if self.block_size > 1 else "plain"
        ctx = self.context_len
        # Whole KiB as "k"; any other length exactly (256 and 512 were both "ctx0k").
        return (
            f"H{self.heads} D{self.head_dim} KVB{self.block_size}{kind} n{self.next_n} "
            f"B{self.batch} ctx{f'{ctx // 1024}k' if ctx % 1024 == 0 else ctx}"
        )

    def skipped(self, pool_blocks: int | None) -> str | None:
        """Why this shape is not run, or ``None`` (with ``--pool-blocks`` only the logits count)."""
        problem = settings.shape_fits(
            self.batch, self.next_n, self.context_len, self.block_size, self.head_dim, pool=not pool_blocks
        )
        return None if problem is None else f"skipped: {problem}"


@dataclass
class ArmResult:
    shape: dict
    arm: str
    real_kernel: bool
    status: str  # "timed", "FAILED-GATE: ...", "skipped: ..."
    kv_mb: float = 0.0
    median_us: float | None = None
    min_us: float | None = None
    max_us: float | None = None
    gbytes: float = 0.0
    gflops: float = 0.0
    achieved_gbps: float | None = None
    copy_bw_fraction: float | None = None
    speedup_vs_baseline: float | None = None
    extra: dict = field(default_factory=dict)


def traffic(problem: PagedProblem) -> tuple[int, int]:
    """Fewest bytes moved and FLOPs for one call: KV, q, weights read once; logits written once."""
    _, next_n, heads, head_dim = problem.q_fp8.shape
    lens = per_sequence_lens(problem.context_lens, problem.batch).tolist()
    kv = sum(lens) * (head_dim + 4)
    cols = sum(max(0, n - next_n + i + 1) for n in lens for i in range(next_n))
    q = problem.q_fp8.numel()
    w = problem.weights.numel() * 4
    flops = cols * heads * (2 * head_dim + 2)
    return kv + q + w + cols * 4, flops


def copy_bandwidth_gbps(device: torch.device) -> float | None:
    """Measured device-to-device copy bandwidth (bytes read + written), GPU only."""
    if device.type != "cuda":
        return None
    src = torch.empty(2 * 1024**3 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = statistics.median(Timer(device).time_us(lambda i: dst.copy_(src), 3, 10))
    return 2 * 2 * 1024**3 / (us * 1e-6) / 1e9


def build_problem(shape: Shape, args, gen: torch.Generator, device: torch.device) -> PagedProblem:
    if args.vary_lengths:
        low = max(shape.next_n, shape.context_len // 2)
        lens = torch.randint(low, shape.context_len + 1, (shape.batch,), generator=gen).tolist()
    else:
        lens = [shape.context_len] * shape.batch
    sizes = dict(heads=shape.heads, head_dim=shape.head_dim, block_size=shape.block_size, spare_blocks=0)
    sizes |= dict(preshuffle=shape.block_size > 1, max_model_len=shape.context_len)
    problem = make_paged_problem(lens, next_n=shape.next_n, generator=gen, device=device, **sizes)
    if args.pool_blocks:
        problem.block_tables = problem.block_tables % args.pool_blocks
        problem.kv_cache = problem.kv_cache[: args.pool_blocks].contiguous()
    return problem


def arm_callables(arms: Arms, paths: Paths) -> dict[str, tuple[bool, Callable]]:
    """name -> (is a real kernel, fn(problem) -> logits), all writing the paths' output buffer."""
    output_buffer = paths.output_buffer

    def call(fn):
        return lambda p: fn(*p.call_args())

    def reference(p: PagedProblem):
        return p.reference_logits(output_buffer(p.batch * p.next_n, p.max_model_len), "flydsl")

    found: dict[str, tuple[bool, Callable]] = {}
    suffix = "" if arms.real else "[ref]"
    if arms.real:
        found["gluon"] = (True, raw_launch(arms.gluon, output_buffer, **GLUON_KNOBS))
        found["flydsl"] = (True, raw_launch(arms.flydsl, output_buffer))
    # Both calls go through the same call site (the defining module's indexer),
    # so they pay the same Python call overhead.
    found["stock-call" + suffix] = (arms.real, call(paths.stock_from(INDEXER)))
    found["patched-call" + suffix] = (arms.real, call(paths.patched_from(INDEXER)))
    found["reference"] = (False, reference)
    return found


def gate(fn: Callable, baseline: torch.Tensor, problem: PagedProblem, paths: Paths, real: bool) -> str | None:
    rows = problem.batch * problem.next_n
    paths.output_buffer(rows, problem.max_model_len).fill_(float("nan"))
    out = fn(problem).clone()
    ends = read_window_ends(problem.context_lens, rows, problem.next_n)
    result = compare_in_windows(baseline, out, ends, topk=settings.DEFAULT_TOPK)
    return None if result.ok(REAL_KERNEL_TOLERANCE if real else 1e-5) else result.describe()


def shapes_from(args, device: torch.device) -> list[Shape]:
    pick = settings.grid(args, device.type)
    return [
        Shape(h, args.head_dim, bs, n, b, c)
        for h, bs, n, b, c in itertools.product(
            pick["heads"], pick["block_size"], pick["next_n"], pick["batch"], pick["context_len"]
        )
    ]


def stock_reason(arms: Arms, problem: PagedProblem) -> str:
    """Why the router sent ``problem``'s call to stock: the variant's own verdict, else its rules'."""
    return arms.flydsl_variant().violation(*problem.call_args()[:5]) or "the router's rules send it to stock"


def run(args, stop: StopSignal | None = None) -> tuple[list[ArmResult], dict]:
    """Every shape in turn; with ``stop``, a requested stop ends the run at the next timed call (the shape
    under way is dropped)."""
    device = device_of(args)
    arms = detect_arms(device, force_reference=args.reference)
    default_repeats, default_sets = settings.BENCH_TIMING["cuda" if device.type == "cuda" else "cpu"]
    repeats = args.repeats or default_repeats
    n_sets = args.input_sets or default_sets
    copy_bw = copy_bandwidth_gbps(device)
    timer = Timer(device, stop)
    results: list[ArmResult] = []
    shapes = shapes_from(args, device)
    wanted = set(args.arms.split(",")) if args.arms else None
    # The output buffer is sized for the largest shape that runs (it grows on demand).
    largest = max(
        (s for s in shapes if not s.skipped(args.pool_blocks)),
        key=lambda s: s.batch * s.next_n * s.context_len,
        default=shapes[0],
    )
    paths = build_paths(arms, device, largest.batch * largest.next_n, largest.context_len, quiet_logger())
    completed = 0
    with paths.session(), Progress(len(shapes), "bench") as progress:
        for idx, shape in enumerate(shapes):
            if stop is not None and stop.requested:
                progress.stopped = True
                break
            progress.step(shape.label)
            before = len(results)
            try:
                completed += 1
                skipped = shape.skipped(args.pool_blocks)
                if skipped:
                    results.append(ArmResult(asdict(shape), "*", False, skipped))
                    continue
                gen = torch.Generator().manual_seed(args.seed + idx)
                problems = []
                for _ in range(n_sets):  # a stop is heard between builds too, not only between calls
                    if stop is not None:
                        stop.check()
                    problems.append(build_problem(shape, args, gen, device))
                p0 = problems[0]
                out = paths.output_buffer(p0.batch * p0.next_n, p0.max_model_len)
                out.fill_(float("nan"))
                baseline = p0.reference_logits(out, "gluon").clone()
                nbytes, flops = traffic(p0)
                kv_mb = min(p0.kv_bytes, p0.kv_cache.numel()) / 1e6
                sizes = dict(kv_mb=kv_mb, gbytes=nbytes / 1e9, gflops=flops / 1e9)
                for name, (real, fn) in arm_callables(arms, paths).items():
                    if wanted and name not in wanted:
                        continue
                    r = ArmResult(asdict(shape), name, real, "timed", **sizes)
                    taken = paths.router.calls_taken
                    problem_ = gate(fn, baseline, p0, paths, real)
                    if name.startswith("patched-call"):
                        # The router's own verdict on this shape: did its one gated call take FlyDSL?
                        took = paths.router.calls_taken > taken
                        r.extra["router"] = "FlyDSL" if took else f"stock: {stock_reason(arms, p0)}"
                    if problem_ is not None:
                        r.status = f"FAILED-GATE: {problem_}"
                        results.append(r)
                        continue
                    samples = timer.time_us(
                        lambda i, fn=fn, ps=problems: fn(ps[i % n_sets]), args.warmup, repeats
                    )
                    r.median_us, r.min_us, r.max_us = statistics.median(samples), min(samples), max(samples)
                    r.achieved_gbps = nbytes / (r.median_us * 1e-6) / 1e9
                    if copy_bw:
                        r.copy_bw_fraction = r.achieved_gbps / copy_bw
                    results.append(r)
                _speedups([r for r in results if r.shape == asdict(shape)])
            except Stopped:  # between two timed calls: this shape is dropped, the run ends
                del results[before:]
                completed -= 1
                progress.drop()
                break

    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "arms": arms.label,
        "stock": paths.label,
        "arms_why": arms.why,
        "repeats": repeats,
        "input_sets": n_sets,
        "pool_blocks": args.pool_blocks,
        "copy_bw_gbps": copy_bw,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": "vllm-flydsl-indexer " + " ".join(_portable(a) for a in sys.argv[1:]),
        "interrupted": completed < len(shapes),
        "completed": completed,
        "planned": len(shapes),
    }
    return results, meta


def _portable(arg: str) -> str:
    """Output paths as their file names, so recorded results name no machine paths."""
    return os.path.basename(arg) if os.sep in arg else arg


def stock_note(results: list[ArmResult]) -> str | None:
    """One line naming the shapes where the patched call ran stock (the router's verdict), or ``None``."""
    by_reason: dict[str, list[str]] = {}
    arm = ""
    for r in results:
        routed = r.extra.get("router", "")
        if routed.startswith("stock: "):
            arm = r.arm
            by_reason.setdefault(routed.removeprefix("stock: "), []).append(Shape(**r.shape).label)
    if not by_reason:
        return None
    shapes = "; ".join(f"{', '.join(labels)} ({reason})" for reason, labels in by_reason.items())
    return f'bench: no FlyDSL variant takes {shapes}; its "{arm}" arm runs stock there'


def _speedups(rows: list[ArmResult]) -> None:
    timed = {r.arm: r for r in rows if r.median_us}
    base = timed.get("gluon") or timed.get("reference")
    if base is None:
        return
    for r in timed.values():
        r.speedup_vs_baseline = base.median_us / r.median_us


def render(results: list[ArmResult], meta: dict) -> str:
    header = ("shape", "arm", "kv_mb", "median us", "min us", "max us")
    header += ("GB/s", "% copy bw", "x base", "status")
    rows = [
        (
            Shape(**r.shape).label,
            r.arm,
            f"{r.kv_mb:.1f}",
            *(
                f"{v:.1f}" if v is not None else "-"
                for v in (r.median_us, r.min_us, r.max_us, r.achieved_gbps)
            ),
            f"{100 * r.copy_bw_fraction:.0f}%" if r.copy_bw_fraction else "-",
            f"{r.speedup_vs_baseline:.2f}" if r.speedup_vs_baseline else "-",
            r.status,
        )
        for r in results
    ]
    copy = f"{meta['copy_bw_gbps']:.0f} GB/s" if meta["copy_bw_gbps"] else "n/a (CPU)"
    head = []
    if meta.get("interrupted"):
        head.append(
            f"INTERRUPTED: {meta['completed']}/{meta['planned']} shapes finished; the rest were not run"
        )
    head += [
        f"device: {meta['device']}  arms: {meta['arms']}"
        + (f" [{meta['arms_why']}]" if meta["arms_why"] else ""),
        f"stock: {meta['stock']}",
        f"repeats: {meta['repeats']}  input sets rotated: {meta['input_sets']}  measured copy bw: {copy}",
    ]
    if meta.get("pool_blocks"):
        head.append(
            f"pool blocks: {meta['pool_blocks']} shared physical blocks (--pool-blocks: a cache study, "
            "not the honest footprint)"
        )
    head.append("x base = median speedup over gluon where present, else over the reference")
    if meta["device"] == "cpu":
        head.append(CPU_NOTE)
    head.append("")
    return "\n".join(head + format_table([header, *rows]))


def write_outputs(results: list[ArmResult], meta: dict, args) -> tuple[list[str], list[str]]:
    """Write the requested files: one line per file written, and one per file that failed.

    Each file was opened for writing before the run (``cli_args.output_problem``);
    each is replaced atomically, so an interrupted write leaves the old file. Should
    a write still fail, the JSON or CSV goes to stdout instead, so that what was
    measured is never lost (the table above has every timing a plot would show).
    """
    written, failed = [], []
    texts = {}
    if args.json_path:
        texts["JSON", args.json_path] = json.dumps(
            {"meta": meta, "results": [asdict(r) for r in results]}, indent=1
        )
    if args.csv_path:
        flat = [
            {**r.shape, **{k: v for k, v in asdict(r).items() if k not in ("shape", "extra")}}
            for r in results
        ]
        out = io.StringIO()
        columns = [f.name for f in fields(Shape)]
        columns += [f.name for f in fields(ArmResult) if f.name not in ("shape", "extra")]
        writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(flat)
        texts["CSV", args.csv_path] = out.getvalue()
    for (kind, path), text in texts.items():
        ok, line = write_or_print("bench", kind, path, text, newline="")
        (written if ok else failed).append(line)
    if args.plot_path:
        try:
            plot(results, meta, args.plot_path)
        except OSError as e:
            failed.append(
                safe_line(f"bench: could not write the plot to {args.plot_path} ({e.strerror or e})")
            )
        else:
            written.append(safe_line(f"bench: wrote the plot to {os.path.abspath(args.plot_path)}"))
    return written, failed


def plot(results: list[ArmResult], meta: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'vllm-flydsl-indexer[plot]'") from e
    labels = sorted({Shape(**r.shape).label for r in results if r.speedup_vs_baseline})
    arms = sorted({r.arm for r in results if r.speedup_vs_baseline})
    fig, ax = plt.subplots(figsize=(9, max(4.0, 0.12 * len(labels) * max(1, len(arms)) + 1.5)))
    height = 0.8 / max(1, len(arms))
    for j, arm in enumerate(arms):
        xs = []
        for lab in labels:
            match = [r for r in results if r.arm == arm and Shape(**r.shape).label == lab]
            xs.append(match[0].speedup_vs_baseline if match and match[0].speedup_vs_baseline else 0)
        ax.barh([i + j * height for i in range(len(labels))], xs, height, label=arm)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(labels))], labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("speedup of the median time over the baseline (gluon, else reference)")
    ax.set_title(f"decode logits A/B on {meta['device']}\n{meta['arms']}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=os.path.splitext(path)[1][1:].lower() or "png", dpi=120)
    plt.close(fig)
    write_atomic_bytes(path, image.getvalue())  # a temporary file beside it, then renamed over it


def main(args) -> int:
    """``bench`` without ``--tune`` (``tune --out``'s old spelling: the CLI sends it to ``tune.main``)."""
    with StopSignal("shape", per_call=True) as stop:
        results, meta = run(args, stop)
        # Every file first, then the report: a stdout that fails (closed, full, a reader gone) loses
        # nothing (tools/streams.py).
        written, unwritten = write_outputs(results, meta, args)
    print(render(results, meta))
    for line in written:
        print(line)
    for line in unwritten:
        print(line, file=sys.stderr)
    note = stock_note(results)
    if note:
        print(note, file=sys.stderr)
    failed = [r for r in results if r.status.startswith("FAILED")]
    if failed:
        print(f"bench: {len(failed)} arm(s) failed the correctness gate and were not timed", file=sys.stderr)
    if meta.get("interrupted"):
        print(interrupted_note(meta["completed"], meta["planned"]), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 1 if failed or unwritten else 0
