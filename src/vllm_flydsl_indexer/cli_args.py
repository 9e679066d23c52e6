# SPDX-License-Identifier: Apache-2.0
"""The arguments of ``check`` and ``bench``, and their validation.

Building the parser imports no torch, so ``--help`` is instant. Every value
is checked before any case runs: each argument's ``type`` rejects what it
can see alone (sizes, lists, the device string, output directories) and
:func:`validate` what needs the machine (the device present, matplotlib).
A bad value is one line on stderr naming the argument and the accepted
values, exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import NoReturn

PROG = "vllm-flydsl-indexer"
# check's indexer shapes, by name; check.MODELS maps them to (heads, head_dim).
CHECK_MODELS = ("deepseek-v3.2", "glm-5")
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
PLOT_HINT = "pip install matplotlib, or pip install -e '.[plot]' in the clone"


def fail(prog: str, message: str) -> NoReturn:
    """Print ``prog: error: message`` as exactly one line on stderr and exit 2."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(2)


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


def positive_int(text: str) -> int:
    value = _int(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def seed(text: str) -> int:
    value = _int(text)
    if value is None or not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}")
    return value


def positive_int_list(text: str) -> tuple[int, ...]:
    items = [x for x in text.split(",") if x.strip()]
    values = tuple(_int(x) for x in items)
    if not values or any(v is None or v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"must be a comma list of positive integers (e.g. 1,2), got {text!r}"
        )
    return values  # type: ignore[return-value]


def block_size_list(text: str) -> tuple[int, ...]:
    values = [_int(x) for x in text.split(",") if x.strip()]
    if not values or any(v is None or v < 1 or (v > 1 and v % BLOCK_ALIGN) for v in values):
        raise argparse.ArgumentTypeError(
            f"must be a comma list of KVBlockSize values, each 1 or a multiple of {BLOCK_ALIGN} "
            f"(e.g. 64,1), got {text!r}"
        )
    return tuple(values)  # type: ignore[arg-type]


def head_dim(text: str) -> int:
    value = _int(text)
    if value is None or value < 1 or value % BLOCK_ALIGN:
        raise argparse.ArgumentTypeError(
            f"must be a positive multiple of {BLOCK_ALIGN} (e.g. 128), got {text!r}"
        )
    return value


def device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text.strip()):
        raise argparse.ArgumentTypeError(f"must be {DEVICES}, got {text!r}")
    return text.strip()


def arm_list(text: str) -> str:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in BENCH_ARMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"must be a comma list of {', '.join(BENCH_ARMS)}, got {text!r}")
    return ",".join(names)  # bench splits it


def output_path(text: str) -> str:
    """A file path whose directory exists and is writable (checked before any work)."""
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be a file path in a writable directory, got {text!r}")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory} does not exist (file {text!r})")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {directory} is not writable (file {text!r})")
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"file {text!r} exists and is not writable")
    return text


# ------------------------------------------------------------------ arguments


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", choices=[*CHECK_MODELS, "all"], default="all", help="indexer shape (default: all)"
    )
    p.add_argument("--batch", type=positive_int, help="sequences per case (default: 32 on GPU, 4 on CPU)")
    p.add_argument("--next-n", type=positive_int_list, help="comma list, e.g. 1,2 (default)")
    p.add_argument(
        "--context-len", type=positive_int, help="max context length (default: 32768 GPU, 2048 CPU)"
    )
    p.add_argument(
        "--block-size",
        type=block_size_list,
        help="comma list of KVBlockSize, each 1 or a multiple of 16 (default 64,1)",
    )
    p.add_argument("--device", type=device, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    p.add_argument("--reference", action="store_true", help="compare reference contracts even on gfx950")
    p.add_argument("--topk", type=positive_int, default=2048, help="top-k compared per row (default 2048)")
    p.add_argument("--seed", type=seed, default=0)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", type=positive_int_list, help="comma list (default 64,32)")
    p.add_argument("--head-dim", type=head_dim, default=128, help="a multiple of 16 (default 128)")
    p.add_argument(
        "--block-size",
        type=block_size_list,
        help="comma list, each 1 or a multiple of 16; >1 means preshuffle (default 1,64)",
    )
    p.add_argument("--next-n", type=positive_int_list, help="comma list (default 1,2)")
    p.add_argument(
        "--batch", type=positive_int_list, help="comma list (default 1,8,32,128 on GPU; 1,4 on CPU)"
    )
    p.add_argument(
        "--context-len",
        type=positive_int_list,
        help="comma list (default 4096,32768,131072 on GPU; 4096 on CPU)",
    )
    p.add_argument(
        "--vary-lengths", action="store_true", help="random lengths in [ctx/2, ctx] (default: exact)"
    )
    p.add_argument(
        "--input-sets",
        type=positive_int,
        help="input sets rotated between iterations (default 4 GPU, 2 CPU)",
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
    p.add_argument("--warmup", type=non_negative_int, default=3)
    p.add_argument("--repeats", type=positive_int, help="timed iterations (default 20 GPU, 3 CPU)")
    p.add_argument("--device", type=device, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    p.add_argument("--reference", action="store_true", help="run the calls over the reference contracts")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", dest="json_path", type=output_path, help="write results as JSON")
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
        help="time Gluon vs FlyDSL per shape (gfx950) and merge the winners into an aiter-format tuned CSV",
    )


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


def validate(args: argparse.Namespace) -> str | None:
    """The first problem with parsed ``check``/``bench`` arguments that needs the machine, or ``None``."""
    context = args.context_len
    if args.next_n and context:
        shortest = min(context) if isinstance(context, tuple) else context
        if max(args.next_n) > shortest:
            return (
                f"argument --next-n: each value must be <= --context-len ({shortest}), got {max(args.next_n)}"
            )
    if getattr(args, "plot_path", None) and not getattr(args, "tune_path", None):
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            return f"argument --plot: needs matplotlib, which is not importable here ({PLOT_HINT})"
    return device_problem(args.device)
