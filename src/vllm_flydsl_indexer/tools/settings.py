# SPDX-License-Identifier: Apache-2.0
"""The tools' settings, written once: grids, defaults, limits, and the CLI's name and error line.

Every tool (doctor, check, bench, tune) and the argument parser read these;
none of them takes a default from another tool. Imports no torch, so the
parser that shows them in ``--help`` stays instant.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from vllm_flydsl_indexer.target import I32_OFFSET_LIMIT as I32_LIMIT
from vllm_flydsl_indexer.target import INDEX_TOPK, SCALE_BYTES
from vllm_flydsl_indexer.tools.models import HEADS

__all__ = [
    "BENCH_ARMS",
    "STOP_BENCH",
    "STOP_CHECK",
    "STOP_TUNE",
    "BENCH_CPU_GRID",
    "BENCH_GPU_GRID",
    "BENCH_TIMING",
    "CHECK_BLOCKS",
    "CHECK_BOUNDS_BLOCK",
    "CHECK_NEXT_NS",
    "CHECK_SIZES",
    "CHECK_SPARE_BLOCKS",
    "DEFAULT_TOPK",
    "I32_LIMIT",
    "LIMITS",
    "LOGIT_BYTES",
    "MAX_INPUT_SETS",
    "MAX_REPEATS",
    "MAX_WARMUP",
    "PROG",
    "REAL_CHECK",
    "TUNE_ALIAS",
    "TUNE_GPU_GRID",
    "TUNE_MODEL_BLOCK_SIZE",
    "TUNE_MODEL_CPU_MAX_MODEL_LEN",
    "TUNE_MODEL_MAX_NEXT_N",
    "VLLM_CAPTURE_SIZES",
    "TUNE_MAX_MODEL_LEN",
    "TUNE_REFERENCE_GRID",
    "fail",
    "grid",
    "kv_pool_bytes",
    "shape_fits",
]

PROG = "vllm-flydsl-indexer"
# KVBlockSize > 1 means the preshuffled layout, which tiles the block by 16.
BLOCK_ALIGN = 16
# The names bench's --arms can pick (suffix [ref]: the calls over the reference contracts).
BENCH_ARMS = (
    "gluon",
    "flydsl",
    "stock-call",
    "patched-call",
    "stock-call[ref]",
    "patched-call[ref]",
    "reference",
)
DEVICES = "cpu, cuda or cuda:N"
SEED_LIMIT = 2**32  # each case adds its index; torch takes seeds below 2**64
# The one command that runs check on the real kernels (README's second first command).
REAL_CHECK = f"VLLM_ROCM_USE_AITER=1 {PROG} check"
PLOT_HINT = "pip install matplotlib, or pip install -e '.[plot]' in the clone"

# What the tools can run: FlyDSL addresses the KV pool with i32 offsets (a case
# over it would be refused by the plugin), and the logits buffer (B*next_n rows
# of context-length float32) is held to the same 2 GiB, so that the pure-torch
# reference, which holds a few buffers of that size, stays allocatable.
LOGIT_BYTES = 4
LIMITS = "each case's KV pool and logits buffer must stay under 2 GiB (FlyDSL's i32 offsets)"

# check's defaults: (batch, context length) per device type.
CHECK_SIZES = {"cuda": (32, 32768), "cpu": (4, 2048)}
CHECK_NEXT_NS = (1, 2)
CHECK_BLOCKS = (64, 1)  # vLLM's production layout (preshuffled), and the plain one
CHECK_BOUNDS_BLOCK = 64  # the bounds cases' KVBlockSize
CHECK_SPARE_BLOCKS = 2  # reference.make_paged_problem's spare blocks
DEFAULT_TOPK = INDEX_TOPK  # vLLM's index_topk: the columns the top-k compares per row

# bench's grids, and tune --out's.
BENCH_GPU_GRID = dict(
    heads=HEADS, block_size=(1, 64), next_n=(1, 2), batch=(1, 8, 32, 128), context_len=(4096, 32768, 131072)
)
BENCH_CPU_GRID = dict(heads=HEADS, block_size=(1, 64), next_n=(1, 2), batch=(1, 4), context_len=(4096,))
TUNE_GPU_GRID = dict(
    heads=HEADS,
    block_size=(64, 1),
    next_n=(1, 2),
    batch=(1, 4, 16, 32, 64, 128, 256),
    context_len=(8192, 32768),
)
TUNE_REFERENCE_GRID = dict(heads=HEADS, block_size=(64, 1), next_n=(1, 2), batch=(1, 4), context_len=(1024,))
# The logits row width every tune --out candidate is launched with (aiter's tuner's
# DEFAULT_MAX_MODEL_LEN): the FlyDSL SplitKV rule caps SplitKV at the pages of max_model_len.
TUNE_MAX_MODEL_LEN = 131072
# tune --model: vLLM's default CUDA-graph capture sizes, in tokens per decode step (vLLM 0.33.0
# vllm/config/vllm.py, VllmConfig._set_cudagraph_sizes, off Blackwell: 1, 2, 4, multiples of 8 below 256,
# multiples of 16 from 256 to its ceiling min(2 * max_num_seqs * decode_query_len, 512)). A step of next_n
# rows per sequence holds size // next_n sequences; their power-of-two floors are the batch buckets.
VLLM_CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
# The indexer cache's KVBlockSize on ROCm (preshuffled): the production layout check and AMD's table use.
TUNE_MODEL_BLOCK_SIZE = 64
# tune --model's logits row width without a GPU (the simulation): measure.py clamps its contexts to it.
TUNE_MODEL_CPU_MAX_MODEL_LEN = 1024
# One sequence's logits at TUNE_MAX_MODEL_LEN stay under 2 GiB.
TUNE_MODEL_MAX_NEXT_N = (I32_LIMIT - 1) // (TUNE_MAX_MODEL_LEN * 4)
# bench's timing defaults per device type: (timed iterations, input sets rotated); tune's too.
BENCH_TIMING = {"cuda": (20, 4), "cpu": (3, 2)}

# The upper bounds of bench's counts: --input-sets holds that many whole inputs of a shape at once (and
# builds each before the first timed call); --repeats and --warmup are calls, each a whole kernel call.
MAX_INPUT_SETS = 64
MAX_REPEATS = 100_000
MAX_WARMUP = 10_000

# bench's options that a tune (tune --out, bench --tune) does not use, and tune --model's: refused together
# with it, never silently ignored.
NOT_WITH_TUNE = {
    "csv_path": ("--csv", "the tuned table is the CSV; --json writes the tuned rows as JSON"),
    "plot_path": ("--plot", "a tune draws no plot"),
    "arms": ("--arms", "a tune times Gluon and FlyDSL"),
    "vary_lengths": ("--vary-lengths", "a tune times exact lengths, as aiter's table keys them"),
    "pool_blocks": ("--pool-blocks", "a tune times an honest footprint"),
    "max_batch": ("--max-batch", "it bounds the node cache's buckets (--model); a table's are --batch"),
}
TUNE_NEEDS = "needs a gfx950 GPU with aiter's Gluon and FlyDSL kernels"
# What bench --tune, tune --out's old spelling, says before it runs the same sweep through the same code.
TUNE_ALIAS = f"the tuning command is `{PROG} tune --out FILE` now; this old spelling runs it"
TUNE_DRY_RUN = "add --reference for a dry run on the reference contracts (rows marked gfx=reference)"


def fail(prog: str, message: str) -> NoReturn:
    """Print ``prog: error: message`` as exactly one line on stderr and exit 2."""
    from vllm_flydsl_indexer.tools.streams import safe_line  # an echoed value: escaped, shortened

    print(safe_line(f"{prog}: error: {' '.join(message.split())}"), file=sys.stderr)
    raise SystemExit(2)


def grid(args: Any, kind: str) -> dict[str, tuple[int, ...]]:
    """The values bench (or tune --out) runs on a ``kind`` device: each option given, else its default."""
    if getattr(args, "tune_path", None):
        defaults = TUNE_REFERENCE_GRID if args.reference else TUNE_GPU_GRID
    else:
        defaults = BENCH_GPU_GRID if kind == "cuda" else BENCH_CPU_GRID
    return {k: getattr(args, k, None) or v for k, v in defaults.items()}


def kv_pool_bytes(batch: int, context_len: int, block_size: int, head_dim: int, spare_blocks: int = 0) -> int:
    """The bytes of a paged KV pool, one distinct block per needed block (as make_paged_problem builds)."""
    blocks = batch * max(1, -(-context_len // block_size)) + spare_blocks
    return blocks * block_size * (head_dim + SCALE_BYTES)


def shape_fits(
    batch: int,
    next_n: int,
    context_len: int,
    block_size: int,
    head_dim: int,
    row_width: int = 0,
    pool: bool = True,
) -> str | None:
    """Why a shape cannot run (its KV pool or logits buffer at 2 GiB or more), or ``None``.

    ``row_width``: the logits' ``max_model_len`` when wider than ``context_len`` (``tune --out``).
    ``pool=False``: the pool is sized otherwise (bench's ``--pool-blocks``), only the logits count.
    """
    if pool and kv_pool_bytes(batch, context_len, block_size, head_dim) >= I32_LIMIT:
        return "KV pool >= 2 GiB (FlyDSL i32 offsets)"
    if batch * next_n * max(context_len, row_width) * LOGIT_BYTES >= I32_LIMIT:
        return "logits buffer >= 2 GiB"
    return None


# What a SIGINT, SIGTERM or SIGHUP does, as --help says it (tools/interrupt.py).
STOP_CHECK = (
    "A SIGINT, SIGTERM or SIGHUP stops after the current case (a few calls) and reports the cases that ran; "
    "a second stops at once; exit 130 either way."
)
STOP_BENCH = (
    "A SIGINT, SIGTERM or SIGHUP stops at the next timed call (within one call, whatever --repeats), "
    "drops the shape under way and writes what finished; a second stops at once; exit 130 either way."
)
STOP_TUNE = (
    "A SIGINT, SIGTERM or SIGHUP stops --model after the bucket under way (each is written to the cache as "
    "it finishes) and prints the buckets that finished, and --out as bench (at the next timed call, merging "
    "what finished); a second stops at once; exit 130 either way."
)
