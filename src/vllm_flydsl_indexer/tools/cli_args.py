# SPDX-License-Identifier: Apache-2.0
"""The arguments of ``check``, ``bench`` and ``tune``, and their validation.

Building the parser imports no torch, so ``--help`` is instant. Every value
is checked before any case runs: each argument's ``type`` rejects what it
can see alone (sizes, lists, the device string, output directories) and
:func:`validate` what needs other arguments or the machine: limits that
depend on two options (checked with the default of the one not given), the
sizes the tool can run (:data:`I32_LIMIT`), the device present, matplotlib,
and every output file, opened for writing before the run. A bad value is one
line on stderr naming the argument and the accepted values, exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import itertools
import os
import re
from typing import TYPE_CHECKING, NoReturn

from vllm_flydsl_indexer.tools import files, outputs, settings
from vllm_flydsl_indexer.tools.models import BY_NAME, HEAD_DIM, MODEL_SHAPES
from vllm_flydsl_indexer.tools.settings import (
    BENCH_ARMS,
    BENCH_CPU_GRID,
    BENCH_GPU_GRID,
    BENCH_TIMING,
    BLOCK_ALIGN,
    CHECK_BLOCKS,
    CHECK_BOUNDS_BLOCK,
    CHECK_NEXT_NS,
    CHECK_SIZES,
    CHECK_SPARE_BLOCKS,
    DEFAULT_TOPK,
    DEVICES,
    I32_LIMIT,
    LIMITS,
    LOGIT_BYTES,
    MAX_INPUT_SETS,
    MAX_REPEATS,
    MAX_WARMUP,
    NOT_WITH_TUNE,
    PLOT_HINT,
    PROG,
    SEED_LIMIT,
    TUNE_GPU_GRID,
    TUNE_MAX_MODEL_LEN,
    TUNE_MODEL_MAX_NEXT_N,
    TUNE_REFERENCE_GRID,
    VLLM_CAPTURE_SIZES,
    fail,
    kv_pool_bytes,
    shape_fits,
)
from vllm_flydsl_indexer.tools.streams import shown

if TYPE_CHECKING:
    from vllm_flydsl_indexer.tools.tuned import TunedRow

__all__ = [
    "OUTPUTS",
    "OUT_ONLY",
    "SWEEP_DEFAULTS",
    "OneLineParser",
    "Sized",
    "add_bench_arguments",
    "add_check_arguments",
    "add_tune_arguments",
    "arm_list",
    "block_size_list",
    "check_model",
    "default_device_type",
    "device",
    "device_problem",
    "head_dim",
    "out_flag",
    "output_path",
    "output_problem",
    "places_problem",
    "plot_format_problem",
    "positive_int",
    "positive_int_list",
    "seed",
    "tune_file",
    "tune_model_problem",
    "tune_problem",
    "validate",
]


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def _per_device(gpu: object, cpu: object) -> str:
    return f"{gpu} on GPU; {cpu} on CPU"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


# ------------------------------------------------------------------ types


def _int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def _int_type(ok, must: str, echo=repr):
    """An argument type: an integer for which ``ok`` holds; the error says what it ``must`` be."""

    def parse(text: str) -> int:
        value = _int(text)
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {echo(text)}")
        return value

    return parse


positive_int = _int_type(lambda v: v >= 1, "a positive integer")
seed = _int_type(lambda v: 0 <= v < SEED_LIMIT, "an integer in [0, 2**32)")
head_dim = _int_type(
    lambda v: v >= 1 and not v % BLOCK_ALIGN, f"a positive multiple of {BLOCK_ALIGN} (e.g. 128)"
)


def bounded_int(low: int, high: int, why: str):
    """An argument type: an integer in ``[low, high]``; the error names both bounds and ``why``."""
    return _int_type(lambda v: low <= v <= high, f"an integer from {low} to {high} ({why})", shown)


def _items(text: str) -> list[str] | None:
    """The items of a comma list (one trailing comma allowed), or ``None`` if one is empty."""
    items = [x.strip() for x in text.split(",")]
    if len(items) > 1 and not items[-1]:
        items.pop()
    return None if any(not x for x in items) else items


def _once(values: tuple, text: str) -> tuple:
    """``values``, refused when one repeats (a tuned table would get two rows of one key)."""
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"must list each value once, got {text!r} ({', '.join(repeated)} twice)"
        )
    return values


def _int_list_type(ok, must: str):
    """An argument type: a comma list of integers, each once, for each of which ``ok`` holds."""

    def parse(text: str) -> tuple[int, ...]:
        values = tuple(_int(x) for x in _items(text) or ())
        if not values or any(v is None or not ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"must be a comma list of {must}, got {text!r}")
        return _once(values, text)

    return parse


positive_int_list = _int_list_type(lambda v: v >= 1, "positive integers (e.g. 1,2)")
block_size_list = _int_list_type(
    lambda v: v == 1 or (v > 1 and not v % BLOCK_ALIGN),
    f"KVBlockSize values, each 1 or a multiple of {BLOCK_ALIGN} (e.g. 64,1)",
)


def device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text.strip()):
        raise argparse.ArgumentTypeError(f"must be {DEVICES}, got {text!r}")
    return text.strip()


def arm_list(text: str) -> str:
    names = tuple(_items(text) or ())
    unknown = [n for n in names if n not in BENCH_ARMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"must be a comma list of {', '.join(BENCH_ARMS)}, got {text!r}")
    return ",".join(_once(names, text))  # bench splits it


def check_model(text: str) -> str:
    """check's shape name for ``--model``: a shape name, ``all``, or anything ``doctor --model`` takes."""
    if text == "all" or text in BY_NAME:
        return text
    from vllm_flydsl_indexer.tools import reach

    try:
        model_type, config = reach.resolve(text)
    except reach.ModelError as e:
        why = str(e).removeprefix(f"--model {text}: ")
        raise argparse.ArgumentTypeError(f"{why} (or all)" if "expected" in why else why) from None
    heads, head_dim, _ = reach.shape_of(config, reach.MODELS[model_type])
    name = next((m.name for m in MODEL_SHAPES if (m.heads, m.head_dim) == (heads, head_dim)), None)
    if name is None:
        shapes = ", ".join(f"{m.name} {m.heads}x{m.head_dim}" for m in MODEL_SHAPES)
        raise argparse.ArgumentTypeError(
            f"{text}'s indexer is heads={heads} head_dim={head_dim}, none of check's shapes ({shapes})"
        )
    return name


def output_path(text: str) -> str:
    """A file path whose directory exists and is writable (checked before any work)."""
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be a file path in a writable directory, got {text!r}")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory} does not exist (file {text!r})")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {directory} is not writable (file {text!r})")
    problem = outputs.kind_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"file {text!r} exists and is not writable")
    return text


# ------------------------------------------------------------------ arguments


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=check_model,
        default="all",
        help=f"indexer shape: all (the default), {', '.join(BY_NAME)}, or what doctor --model takes "
        "(a model directory or a model_type), run as its shape",
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        help=f"sequences per case (default: {_per_device(CHECK_SIZES['cuda'][0], CHECK_SIZES['cpu'][0])})",
    )
    p.add_argument(
        "--next-n",
        type=positive_int_list,
        help=f"comma list (default {_csv(CHECK_NEXT_NS)}); "
        "the bounds cases that need MTP run at the largest value > 1",
    )
    p.add_argument(
        "--context-len",
        type=positive_int,
        help=f"max context length (default: {_per_device(CHECK_SIZES['cuda'][1], CHECK_SIZES['cpu'][1])})",
    )
    p.add_argument(
        "--block-size",
        type=block_size_list,
        help=f"comma list of KVBlockSize, each 1 or a multiple of 16 (default {_csv(CHECK_BLOCKS)})",
    )
    p.add_argument(
        "--topk",
        type=positive_int,
        help=f"top-k compared per row, at most --context-len (default {DEFAULT_TOPK}, vLLM's index_topk; "
        "a row shorter than that is compared whole)",
    )
    _add_run_arguments(p, "compare reference contracts even on gfx950", "case")


def _add_run_arguments(p: argparse.ArgumentParser, reference: str, unit: str) -> None:
    """--device, --reference and --seed, which check, bench and tune share (``unit``: what seed+i seeds)."""
    p.add_argument("--device", type=device, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    p.add_argument("--reference", action="store_true", help=reference)
    p.add_argument(
        "--seed", type=seed, default=0, help=f"seed of the random inputs; {unit} i uses seed+i (default 0)"
    )


# The sweep's defaults that tune's parser leaves unset (None: not given), so that tune --model refuses every
# option of --out's it is given (OUT_ONLY); validate() sets them for tune --out.
SWEEP_DEFAULTS = {"head_dim": HEAD_DIM, "warmup": 3, "seed": 0, "reference": False}
OUT_ONLY = ("heads", "head_dim", "block_size", "batch", "context_len", "input_sets", "warmup", "repeats")
OUT_ONLY += ("device", "reference", "seed", "json_path")


def _sweep_arguments(p, tune: bool) -> None:
    """The grid, timing, device and --json of bench, and of tune --out (with its grids' defaults). --next-n
    is each command's own."""
    gpu, other = (TUNE_GPU_GRID, TUNE_REFERENCE_GRID) if tune else (BENCH_GPU_GRID, BENCH_CPU_GRID)
    labels = ("", " with --reference") if tune else (" on GPU", " on CPU")

    def default(key: str) -> str:
        if gpu[key] == other[key]:
            return f"default {_csv(gpu[key])}"
        return f"default {_csv(gpu[key])}{labels[0]}; {_csv(other[key])}{labels[1]}"

    p.add_argument("--heads", type=positive_int_list, help=f"comma list ({default('heads')})")
    dim = f"a multiple of 16 (default {HEAD_DIM})"
    p.add_argument("--head-dim", type=head_dim, default=SWEEP_DEFAULTS["head_dim"], help=dim)
    p.add_argument(
        "--block-size",
        type=block_size_list,
        help=f"comma list, each 1 or a multiple of 16; >1 means preshuffle ({default('block_size')})",
    )
    p.add_argument("--batch", type=positive_int_list, help=f"comma list ({default('batch')})")
    p.add_argument("--context-len", type=positive_int_list, help=f"comma list ({default('context_len')})")
    p.add_argument(
        "--input-sets",
        type=bounded_int(1, MAX_INPUT_SETS, "each set is a whole input, all held at once"),
        help="input sets rotated between iterations "
        f"(default {_per_device(BENCH_TIMING['cuda'][1], BENCH_TIMING['cpu'][1])}; at most {MAX_INPUT_SETS})",
    )
    p.add_argument(
        "--warmup",
        type=bounded_int(0, MAX_WARMUP, "untimed calls per arm"),
        default=SWEEP_DEFAULTS["warmup"],
        help=f"untimed calls per arm before timing (default 3, at most {MAX_WARMUP})",
    )
    p.add_argument(
        "--repeats",
        type=bounded_int(1, MAX_REPEATS, "timed calls per arm"),
        help=f"timed iterations (default {_per_device(BENCH_TIMING['cuda'][0], BENCH_TIMING['cpu'][0])}; "
        f"at most {MAX_REPEATS})",
    )
    reference = "a dry run on the reference contracts, anywhere (rows marked gfx=reference)"
    _add_run_arguments(p, reference if tune else "run the calls over the reference contracts", "shape")
    what = "the tuned rows" if tune else "results"
    p.add_argument("--json", dest="json_path", type=output_path, help=f"write {what} as JSON")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    _sweep_arguments(p, tune=False)
    p.add_argument(
        "--next-n",
        type=positive_int_list,
        help=f"comma list, each <= --context-len (default {_csv(BENCH_GPU_GRID['next_n'])})",
    )
    p.add_argument(
        "--vary-lengths", action="store_true", help="random lengths in [ctx/2, ctx] (default: exact)"
    )
    p.add_argument(
        "--pool-blocks",
        type=positive_int,
        help="opt-in cache study: share a pool of this many physical blocks (kv_mb shrinks)",
    )
    p.add_argument(
        "--arms",
        type=arm_list,
        help=f"comma list to run a subset of the available arms ({', '.join(BENCH_ARMS)})",
    )
    p.add_argument("--csv", dest="csv_path", type=output_path, help="write results as CSV")
    p.add_argument(
        "--plot",
        dest="plot_path",
        type=output_path,
        help="PNG: speedup of each arm over gluon/reference (needs matplotlib)",
    )
    p.add_argument(
        "--tune",
        dest="tune_path",
        type=output_path,
        metavar="OUT.csv",
        help=f"the old spelling of `{PROG} tune --out OUT.csv`, which it runs (saying so in one line); "
        "takes the same options",
    )


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    """``tune --model M`` (the node cache) or ``tune --out FILE`` (a table), and what each takes."""
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--model",
        metavar="M",
        help="measure this model's buckets into the node cache: what doctor --model takes (a model "
        "directory, a Hugging Face model id in the local cache, or deepseek-ai/DeepSeek-V3.2), or a "
        "model_type",
    )
    which.add_argument(
        "--out",
        dest="tune_path",
        type=output_path,
        metavar="FILE",
        help="sweep the grid below into an aiter-format tuned CSV (new, empty, or one written before; "
        "the rows of the keys measured are replaced, the rest kept) that VLLM_FLYDSL_INDEXER_TUNED_CSV "
        "names; needs a gfx950 GPU with aiter's Gluon and FlyDSL kernels, or --reference",
    )
    p.add_argument(
        "--next-n",
        type=positive_int_list,
        help="comma list of decode rows per sequence; with --model: 1, and 1 + the model's MTP layers where "
        f"its config.json has num_nextn_predict_layers (at most {TUNE_MODEL_MAX_NEXT_N}); with --out: each "
        f"<= --context-len (default {_csv(TUNE_GPU_GRID['next_n'])})",
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        metavar="B",
        help=f"with --model: measure batch buckets up to B only (default: every power of two vLLM's default "
        f"CUDA-graph capture sizes reach, 1 to {max(VLLM_CAPTURE_SIZES)})",
    )
    _sweep_arguments(p.add_argument_group("with --out FILE only"), tune=True)
    p.set_defaults(**dict.fromkeys(SWEEP_DEFAULTS))


def tune_model_problem(args: argparse.Namespace) -> str | None:
    """What ``tune --model`` cannot take, before any work: an option of ``--out``'s, a model it cannot
    resolve, one whose calls never reach FlyDSL, a --next-n too large."""
    from vllm_flydsl_indexer.tools import reach

    given = next((name for name in OUT_ONLY if getattr(args, name) is not None), None)
    if given is not None:
        flag = "--" + given.removesuffix("_path").replace("_", "-")
        return (
            f"argument {flag}: only with --out FILE (a swept table); --model measures the model's own "
            "buckets as the plugin does (--next-n and --max-batch pick them)"
        )
    try:
        model_type, _ = reach.resolve(args.model)
    except reach.ModelError as e:
        return str(e)
    model = reach.MODELS[model_type]
    if model.layout != reach.LAYER_CONTIGUOUS:
        takes = ", ".join(t for t, m in reach.MODELS.items() if m.layout == reach.LAYER_CONTIGUOUS)
        return (
            f"--model {args.model}: {model.label}'s indexer cache is block-outer ({model.layout}, as "
            f"{reach.PINNED_RELEASES} resolve it), so its calls stay stock and there is nothing to measure; "
            f"accepted: a model on a layer-contiguous cache ({takes})"
        )
    too_big = [n for n in args.next_n or () if n > TUNE_MODEL_MAX_NEXT_N]
    if too_big:
        return (
            f"argument --next-n: each value must be at most {TUNE_MODEL_MAX_NEXT_N} (one sequence's logits "
            f"under 2 GiB at max_model_len {TUNE_MAX_MODEL_LEN}), got {too_big[0]}"
        )
    return None


# ------------------------------------------------------------------ what needs the machine


def device_problem(name: str | None) -> str | None:
    """Why ``--device name`` is not on this machine, or ``None``."""
    if name is None or name == "cpu":
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return f"argument --device: no CUDA or HIP GPU on this machine, got {name!r}; accepted here: cpu"
    index = int(name.partition(":")[2] or 0)
    if index >= count:
        present = ", ".join(["cpu", "cuda", *(f"cuda:{i}" for i in range(count))])
        return f"argument --device: {name} is not present, got {name!r}; accepted here: {present}"
    return None


def default_device_type(args: argparse.Namespace) -> str:
    """``"cuda"`` or ``"cpu"``: the device the command will run on (imports torch only without --device)."""
    if args.device is not None:
        return "cpu" if args.device == "cpu" else "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Sized:
    """One option's value (given, or its default), named as a message names it."""

    def __init__(self, flag: str, given, default, where: str = ""):
        self.flag = flag
        self.given = given is not None
        self.value = given if given is not None else default
        self.where = where

    def __str__(self) -> str:
        value = ",".join(map(str, self.value)) if isinstance(self.value, tuple) else str(self.value)
        return f"{self.flag} {value}" + ("" if self.given else f" (the default{self.where})")


def _check_sizes_problem(args: argparse.Namespace) -> str | None:
    """check's limits over --batch, --context-len, --next-n and --topk, each with the others' defaults."""
    kind = default_device_type(args) if args.batch is None or args.context_len is None else "cpu"
    where = f" on {'GPU' if kind == 'cuda' else 'CPU'}"
    batch = Sized("--batch", args.batch, CHECK_SIZES[kind][0], where)
    context = Sized("--context-len", args.context_len, CHECK_SIZES[kind][1], where)
    next_ns = Sized("--next-n", args.next_n, CHECK_NEXT_NS)
    largest_n = max(next_ns.value)
    if largest_n > context.value:
        if next_ns.given:
            return f"argument --next-n: each value must be <= {context}, got {largest_n}"
        return (
            f"argument --context-len: must be >= {largest_n}, the largest of {next_ns}, got {context.value}"
        )
    blocks = {*(args.block_size or CHECK_BLOCKS), CHECK_BOUNDS_BLOCK}

    def fits(b: int, ctx: int, n: int) -> bool:
        # The largest case has B*n rows; the flattened and MTP bounds cases B*2 at least.
        pool = max(kv_pool_bytes(b, ctx, bs, HEAD_DIM, CHECK_SPARE_BLOCKS) for bs in blocks)
        return pool < I32_LIMIT and b * max(n, 2) * ctx * LOGIT_BYTES < I32_LIMIT

    if not fits(batch.value, context.value, largest_n):
        most = {
            "--next-n": _largest(lambda n: fits(batch.value, context.value, n)),
            "--batch": _largest(lambda b: fits(b, context.value, largest_n)),
            "--context-len": _largest(lambda c: fits(batch.value, c, largest_n)),
        }
        # Name the given option that, alone at a smaller value, would fit: --next-n first
        # (the rare one to set high), then --batch, then --context-len.
        given = [o for o in (next_ns, batch, context) if o.given]
        named = next((o for o in given if most[o.flag] >= 1), given[0] if given else batch)
        got = largest_n if named is next_ns else named.value
        others = " and ".join(str(o) for o in (batch, context, next_ns) if o is not named)
        return f"argument {named.flag}: must be at most {most[named.flag]} at {others}: {LIMITS}, got {got}"
    if args.topk is not None and args.topk > context.value:
        return f"argument --topk: must be <= {context}, the longest row, got {args.topk}"
    return None


def _largest(ok) -> int:
    """The largest positive integer ``n`` with ``ok(n)`` (``ok`` holds up to a bound, then not); 0 if none."""
    if not ok(1):
        return 0
    low, high = 1, 2
    while ok(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def _bench_fits(grid: dict[str, tuple[int, ...]], dim: int, key: str, value: int) -> bool:
    """Whether some shape of ``grid`` with ``key = value`` fits (:func:`settings.shape_fits`)."""
    others = [k for k in ("batch", "next_n", "context_len") if k != key]
    return any(
        shape_fits(**dict(zip(others, rest, strict=True)), **{key: value}, block_size=bs, head_dim=dim)
        is None
        for rest in itertools.product(*(grid[k] for k in others))
        for bs in grid["block_size"]
    )


def _bench_sizes_problem(args: argparse.Namespace) -> str | None:
    """bench's limits: each --next-n <= every context length; each size value in some shape it can run."""
    # bench's default batch and context lists start at the same values on CPU and GPU
    # (tune's depend on --reference only), so no device is needed to check against them.
    grid = settings.grid(args, "cpu")
    sized = {
        key: Sized(flag, getattr(args, key), grid[key])
        for key, flag in (("batch", "--batch"), ("next_n", "--next-n"), ("context_len", "--context-len"))
    }
    shortest, largest_n = min(grid["context_len"]), max(grid["next_n"])
    if largest_n > shortest:
        context = sized["context_len"]
        if sized["next_n"].given:
            return (
                f"argument --next-n: each value must be <= --context-len ({shortest}"
                f"{'' if context.given else ', the default'}), got {largest_n}"
            )
        return f"argument --context-len: each value must be >= {largest_n}, the largest of {sized['next_n']}"
    # Name a given value that no shape can run, preferring one that a smaller value would fix
    # (--batch 1 at a context of 10**9 is the context's fault).
    failures = []
    for key in ("next_n", "batch", "context_len"):
        for value in grid[key] if sized[key].given else ():
            if not _bench_fits(grid, args.head_dim, key, value):
                most = _largest(lambda v, key=key: _bench_fits(grid, args.head_dim, key, v))
                failures.append((most < 1, key, value, most))
    if not failures:
        return None
    _, key, value, most = min(failures, key=lambda f: f[0])
    # The bound holds at the others' smallest values (a value fits if some shape with it does).
    others = " and ".join(
        f"{o.flag} {min(o.value)}" + ("" if o.given and len(o.value) == 1 else f" (the smallest of {o})")
        for k, o in sized.items()
        if k != key
    )
    return f"argument {sized[key].flag}: must be at most {most} at {others}: {LIMITS}, got {value}"


def out_flag(args: argparse.Namespace) -> str:
    """The option that named the tuned table: ``tune --out``, or ``bench --tune`` (its old spelling)."""
    return "--tune" if args.command == "bench" else "--out"


def tune_problem(args: argparse.Namespace) -> str | None:
    """The options a tune (``tune --out``, ``bench --tune``) does not use. Whether this machine can give
    kernel timings is :func:`tune.main`'s first question (``arms.detect_arms``, before any work)."""
    for attr, (flag, why) in NOT_WITH_TUNE.items():
        if getattr(args, attr, None):
            return f"argument {flag}: not used with {out_flag(args)} ({why})"
    return None


def tune_file(
    path: str, flag: str = "--out"
) -> tuple[tuple[list[str], list[TunedRow], list[tuple[int, str]]] | None, str | None]:
    """The table already in ``tune --out path`` (``None`` for a new or empty file), and why it cannot be
    merged into (it is not aiter's format or has a row ``tuned.check_row`` refuses), or ``None``; the
    reason names ``flag``, the option that named the file.

    Read as the plugin reads a table (``tuned.read_table``): ``#`` lines, a byte-order mark, CRLF."""
    from vllm_flydsl_indexer.tools import tuned

    if not os.path.exists(path):
        return None, None  # a new table (or a symlink to one: written through, as every output)
    try:
        text = files.read_text(path)
        found = _header(text)
        if found is None:  # blank and ``#`` lines only: a new table under them
            return tuned.read_table([*text.splitlines(keepends=True), ",".join(tuned.COLUMNS)], path), None
        # Refused in the reader's order: a header missing a column (not a table), a row check_row refuses
        # (not merged into), then a header of another order or with more columns (not a table either).
        number, header = found
        missing = [c for c in tuned.COLUMNS if c not in header]
        if missing:
            why = f"{path}: line {number}: missing column(s) {', '.join(missing)}"
            return None, _not_a_table(path, why, flag)
        table = tuned.read_table(io.StringIO(text, newline=""), path)
        if tuple(table[0]) != tuned.COLUMNS:
            return None, _not_a_table(path, f"{path}: header {','.join(table[0])}", flag)
        return table, None
    except tuned.TableError as e:
        why = f"argument {flag}: {e}; not merging into it (fix or remove that row, or give another file)"
        return None, why
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        return None, f"argument {flag}: {path}: line {line}: not UTF-8 ({e.reason}); not overwriting it"
    except (OSError, csv.Error, ValueError) as e:
        return None, f"argument {flag}: cannot read {path} ({e}); not overwriting it"


def _header(text: str) -> tuple[int, list[str]] | None:
    """The line number and cells of ``text``'s header (its first line neither blank nor ``#``; the reader
    already dropped a byte-order mark), or ``None``."""
    from vllm_flydsl_indexer.tools import tuned

    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith(tuned.COMMENT):
            return number, next(csv.reader([line]))
    return None


def _not_a_table(path: str, why: str, flag: str) -> str:
    from vllm_flydsl_indexer.tools import tuned

    return (
        f"argument {flag}: {path} is not an aiter-format tuned CSV ({why}; expected the header "
        f"{','.join(tuned.COLUMNS)}); not overwriting it: give a new, empty or earlier {flag} file"
    )


OUTPUTS = (("json_path", "--json"), ("csv_path", "--csv"), ("plot_path", "--plot"), ("tune_path", None))


def _outputs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """``(attr, flag, path)`` of each output given; the tuned table's flag as the command spells it."""
    return [(a, f or out_flag(args), getattr(args, a)) for a, f in OUTPUTS if getattr(args, a, None)]


def places_problem(args: argparse.Namespace) -> str | None:
    """The first output whose place is refused (:func:`outputs.place_problem`), before anything reads it."""
    for attr, flag, path in _outputs(args):
        problem = outputs.place_problem(path, merge_into_table=attr == "tune_path")
        if problem is not None:
            return f"argument {flag}: {problem}"
    return None


def output_problem(args: argparse.Namespace) -> str | None:
    """Every output file, checked for writing now, before the run (:func:`outputs.outputs_problem`)."""
    return outputs.outputs_problem((flag, path) for _, flag, path in _outputs(args))


def plot_format_problem(path: str, formats: dict[str, str]) -> str | None:
    """Why matplotlib (writing ``formats``) cannot write ``path`` (no extension: PNG), or ``None``."""
    extension = os.path.splitext(path)[1][1:].lower()
    if not extension or extension in formats:
        return None
    accepted = ", ".join(sorted(formats))
    return f"argument --plot: matplotlib cannot write .{extension} files; accepted: {accepted}"


def validate(args: argparse.Namespace) -> str | None:
    """The first problem with parsed ``check``/``bench``/``tune --out`` arguments that needs the machine, or
    ``None``. tune's options left unset take bench's defaults here."""
    for name, value in SWEEP_DEFAULTS.items() if args.command == "tune" else ():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    problem = device_problem(args.device) or (places_problem(args) if args.command != "check" else None)
    if problem is not None:
        return problem
    if args.command == "check":
        return _check_sizes_problem(args)
    tuning = bool(getattr(args, "tune_path", None))
    if tuning:
        problem = tune_problem(args) or tune_file(args.tune_path, out_flag(args))[1]
    problem = problem or _bench_sizes_problem(args)
    if problem is None and getattr(args, "plot_path", None) and not tuning:
        try:
            canvas = importlib.import_module("matplotlib.backend_bases").FigureCanvasBase
        except ImportError:
            problem = f"argument --plot: needs matplotlib, which is not importable here ({PLOT_HINT})"
        else:
            problem = plot_format_problem(args.plot_path, canvas.get_supported_filetypes())
    return problem or output_problem(args)
