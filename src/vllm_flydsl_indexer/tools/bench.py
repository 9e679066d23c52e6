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
from dataclasses import asdict, dataclass, field

import torch

from vllm_flydsl_indexer.agreement import REAL_KERNEL_TOLERANCE, compare_in_windows, read_window_ends
from vllm_flydsl_indexer.tools import cases, cli_args
from vllm_flydsl_indexer.tools.arms import GLUON_KNOBS, Arms, detect_arms, raw_launch
from vllm_flydsl_indexer.tools.cases import INDEXER
from vllm_flydsl_indexer.tools.check import quiet_logger
from vllm_flydsl_indexer.tools.paths import Paths, build_paths
from vllm_flydsl_indexer.tools.progress import Progress
from vllm_flydsl_indexer.tools.reference import (
    PagedProblem,
    make_paged_problem,
    per_sequence_lens,
)
from vllm_flydsl_indexer.tools.table import format_table

POOL_LIMIT_BYTES = cli_args.I32_LIMIT  # FlyDSL's i32 offsets
CPU_NOTE = (
    "note: CPU timings show the harness working, not kernel speed "
    "(the reference arms vary severalfold between identical runs)"
)
GPU_GRID = cli_args.BENCH_GPU_GRID
CPU_GRID = cli_args.BENCH_CPU_GRID


class Shape(cases.Shape):
    """A point of bench's grid, with its label and sizes."""

    @property
    def label(self) -> str:
        kind = "shuf" if self.block_size > 1 else "plain"
        return (
            f"H{self.heads} D{self.head_dim} KVB{self.block_size}{kind} n{self.next_n} "
            f"B{self.batch} ctx{self.context_len // 1024}k"
        )

    def pool_bytes(self) -> int:
        return cli_args.kv_pool_bytes(self.batch, self.context_len, self.block_size, self.head_dim)

    def logits_bytes(self) -> int:
        return self.batch * self.next_n * self.context_len * cli_args.LOGIT_BYTES

    def skipped(self, pool_blocks: int | None) -> str | None:
        """Why this shape is not run, or ``None``."""
        if self.pool_bytes() >= POOL_LIMIT_BYTES and not pool_blocks:
            return "skipped: KV pool >= 2 GiB (FlyDSL i32 offsets)"
        if self.logits_bytes() >= cli_args.I32_LIMIT:
            return "skipped: logits buffer >= 2 GiB"
        return None


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


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time_us(self, fn: Callable[[int], object], warmup: int, repeats: int) -> list[float]:
        for i in range(warmup):
            fn(i)
        samples = []
        for i in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(i)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn(i)
                samples.append((time.perf_counter() - t0) * 1e6)
        return samples


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
    problem = make_paged_problem(
        lens,
        next_n=shape.next_n,
        heads=shape.heads,
        head_dim=shape.head_dim,
        block_size=shape.block_size,
        preshuffle=shape.block_size > 1,
        max_model_len=shape.context_len,
        spare_blocks=0,
        generator=gen,
        device=device,
    )
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
    result = compare_in_windows(baseline, out, ends, topk=2048)
    return None if result.ok(REAL_KERNEL_TOLERANCE if real else 1e-5) else result.describe()


def shapes_from(args, device: torch.device) -> list[Shape]:
    grid = GPU_GRID if device.type == "cuda" else CPU_GRID
    pick = {k: getattr(args, k) or v for k, v in grid.items()}
    return [
        Shape(h, args.head_dim, bs, n, b, c)
        for h, bs, n, b, c in itertools.product(
            pick["heads"], pick["block_size"], pick["next_n"], pick["batch"], pick["context_len"]
        )
    ]


def run(args) -> tuple[list[ArmResult], dict]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    arms = detect_arms(device, force_reference=args.reference)
    default_repeats, default_sets = cli_args.BENCH_TIMING["cuda" if device.type == "cuda" else "cpu"]
    repeats = args.repeats or default_repeats
    n_sets = args.input_sets or default_sets
    copy_bw = copy_bandwidth_gbps(device)
    timer = Timer(device)
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
    with paths.session(), Progress(len(shapes), "bench") as progress:
        for idx, shape in enumerate(shapes):
            progress.step(shape.label)
            skipped = shape.skipped(args.pool_blocks)
            if skipped:
                results.append(ArmResult(asdict(shape), "*", False, skipped))
                continue
            gen = torch.Generator().manual_seed(args.seed + idx)
            problems = [build_problem(shape, args, gen, device) for _ in range(n_sets)]
            p0 = problems[0]
            out = paths.output_buffer(p0.batch * p0.next_n, p0.max_model_len)
            out.fill_(float("nan"))
            baseline = p0.reference_logits(out, "gluon").clone()
            nbytes, flops = traffic(p0)
            kv_mb = min(p0.kv_bytes, p0.kv_cache.numel()) / 1e6
            for name, (real, fn) in arm_callables(arms, paths).items():
                if wanted and name not in wanted:
                    continue
                r = ArmResult(
                    asdict(shape), name, real, "timed", kv_mb=kv_mb, gbytes=nbytes / 1e9, gflops=flops / 1e9
                )
                problem_ = gate(fn, baseline, p0, paths, real)
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
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "arms": arms.label,
        "stock": paths.label,
        "arms_why": arms.why,
        "repeats": repeats,
        "input_sets": n_sets,
        "copy_bw_gbps": copy_bw,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": "vllm-flydsl-indexer " + " ".join(_portable(a) for a in sys.argv[1:]),
    }
    return results, meta


def _portable(arg: str) -> str:
    """Output paths as their file names, so recorded results name no machine paths."""
    return os.path.basename(arg) if os.sep in arg else arg


def _speedups(rows: list[ArmResult]) -> None:
    timed = {r.arm: r for r in rows if r.median_us}
    base = timed.get("gluon") or timed.get("reference")
    if base is None:
        return
    for r in timed.values():
        r.speedup_vs_baseline = base.median_us / r.median_us


def render(results: list[ArmResult], meta: dict) -> str:
    header = (
        "shape",
        "arm",
        "kv_mb",
        "median us",
        "min us",
        "max us",
        "GB/s",
        "% copy bw",
        "x base",
        "status",
    )
    rows = []
    for r in results:
        s = Shape(**r.shape)
        rows.append(
            (
                s.label,
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
        )
    copy = f"{meta['copy_bw_gbps']:.0f} GB/s" if meta["copy_bw_gbps"] else "n/a (CPU)"
    head = [
        f"device: {meta['device']}  arms: {meta['arms']}"
        + (f" [{meta['arms_why']}]" if meta["arms_why"] else ""),
        f"stock: {meta['stock']}",
        f"repeats: {meta['repeats']}  input sets rotated: {meta['input_sets']}  measured copy bw: {copy}",
        "x base = median speedup over gluon where present, else over the reference",
    ]
    if meta["device"] == "cpu":
        head.append(CPU_NOTE)
    head.append("")
    return "\n".join(head + format_table([header, *rows]))


def write_outputs(results: list[ArmResult], meta: dict, args) -> tuple[list[str], list[str]]:
    """Write the requested files: one line per file written, and one per file that failed.

    Each file was opened for writing before the run (``cli_args.output_problem``).
    Should a write still fail, the JSON or CSV goes to stdout instead, so that what
    was measured is never lost (the table above has every timing a plot would show).
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
        writer = csv.DictWriter(out, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
        texts["CSV", args.csv_path] = out.getvalue()
    for (kind, path), text in texts.items():
        try:
            with open(path, "w", newline="") as f:
                f.write(text)
        except OSError as e:
            print(f"--- the {kind} that could not be written to {path} ---\n{text.rstrip()}\n--- end ---")
            failed.append(f"bench: could not write {kind} to {path} ({e.strerror or e}); printed it above")
            continue
        written.append(f"bench: wrote {kind} to {os.path.abspath(path)}")
    if args.plot_path:
        try:
            plot(results, meta, args.plot_path)
        except OSError as e:
            failed.append(f"bench: could not write the plot to {args.plot_path} ({e.strerror or e})")
        else:
            written.append(f"bench: wrote the plot to {os.path.abspath(args.plot_path)}")
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
    fig.savefig(path, dpi=120)


def main(args) -> int:
    """``bench`` without ``--tune`` (the CLI sends ``--tune`` to ``tune.main``)."""
    results, meta = run(args)
    print(render(results, meta))
    written, unwritten = write_outputs(results, meta, args)
    for line in written:
        print(line)
    for line in unwritten:
        print(line, file=sys.stderr)
    failed = [r for r in results if r.status.startswith("FAILED")]
    if failed:
        print(f"bench: {len(failed)} arm(s) failed the correctness gate and were not timed", file=sys.stderr)
    return 1 if failed or unwritten else 0
