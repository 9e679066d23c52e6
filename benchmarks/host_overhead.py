# SPDX-License-Identifier: Apache-2.0
"""Host time per decode-logits call: stock vLLM vs the plugin's patched call, each path, defaults on.

Runs the installed vLLM's real ``rocm_fp8_paged_mqa_logits`` on CPU under the test
suite's gfx950 simulation (amdsmi and aiter doubles from ``tests/doubles``), with
every default on (the self-test included) but the route's source (no table: a
measurement on a CPU is a wall-clock race that could keep the taken shape stock).
Each shape is warmed first with the
doubles' kernels, which honour the two contracts, so the self-test passes and
the route is ready; then both kernels are replaced by no-ops, so only Python
host work is timed: the stock function's own checks, workspace lookup and
argument handling, against the plugin's wrapper and router.

Three paths, each against stock's own function on the same call, all six arms
interleaved round by round in one run:

* **taken**: a shape the router sends to FlyDSL (heads 64, head_dim 128);
* **stock-bound**: a shape the router hands to stock (head_dim 96, which no
  FlyDSL API takes): the router's memoised stock verdict (one memo lookup), then stock;
* **stock-bound cache**: a block-outer (strided) cache, DeepSeek-V4.1's layout, which
  no batch can take to FlyDSL: the same memo lookup, then stock.

    python benchmarks/host_overhead.py [--calls 5000] [--rounds 21] [--next-n 2] [--json out.json]

A path's delta is the median over the rounds of (patched - stock) within a round, the two arms run back to
back: a shared host's slow spells, which last longer than an arm, then cancel (each arm's own median is
printed too).

``--standalone`` needs no vLLM: this package's stock copy of vLLM's gfx950 branch
against the router over it, on the GPU if one is present.

With breakable CUDA graphs, or in PIECEWISE mode, the call runs eagerly once per
layer per step (61 layers on DeepSeek-V3.2): the per-call difference times 61 is
the per-step cost.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOUBLES = ROOT / "tests" / "doubles"
LAYERS_DSV32 = 61
TAKEN = dict(heads=64, head_dim=128)
STOCK_BOUND = dict(heads=64, head_dim=96)  # no FlyDSL API takes head_dim 96
STOCK_BOUND_CACHE = dict(heads=64, head_dim=128, block_outer=True)  # a strided cache (V4.1's layout)
# What simulated() sets up (vLLM's workspace on the CPU) stays up for the whole run: held, never closed.
SESSION = contextlib.ExitStack()
PATHS = {"taken": TAKEN, "stock-bound": STOCK_BOUND, "stock-bound cache": STOCK_BOUND_CACHE}


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=positive, default=5000, help="calls per round and arm")
    parser.add_argument(
        "--rounds", type=positive, default=21, help="interleaved rounds; the median is reported"
    )
    parser.add_argument("--next-n", type=positive, default=2, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--json", dest="json_path", help="write the figures and every sample here")
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="no vLLM: this package's stock copy of vLLM's gfx950 branch against the router over it, "
        "on the GPU if one is present (this includes the per-call capture check there)",
    )
    args = parser.parse_args()
    arms, where = (standalone if args.standalone else simulated)(args.next_n)
    per_call = interleaved(arms, args.calls, args.rounds)
    median = {name: statistics.median(samples) for name, samples in per_call.items()}
    result = {
        "where": where,
        "cpu": _cpu_name(),
        "python": sys.version.split()[0],
        "next_n": args.next_n,
        "calls_per_round": args.calls,
        "rounds": args.rounds,
        "median_us": {name: round(v, 3) for name, v in median.items()},
        "samples_us": {name: [round(v, 3) for v in vs] for name, vs in per_call.items()},
    }
    print(f"host time per call, {where} (median of {args.rounds} interleaved rounds x {args.calls} calls)")
    for path in PATHS:
        stock, patched = median[f"stock ({path} shape)"], median[f"patched, {path}"]
        pairs = zip(per_call[f"patched, {path}"], per_call[f"stock ({path} shape)"], strict=True)
        delta = statistics.median(p - s for p, s in pairs)
        result[path] = {
            "stock_us": round(stock, 3),
            "patched_us": round(patched, 3),
            "delta_us": round(delta, 3),
            "ratio": round((stock + delta) / stock, 3),
            "delta_per_step_61_layers_us": round(delta * LAYERS_DSV32, 1),
        }
        print(
            f"  {path:<17} stock {stock:7.2f} us  patched {patched:7.2f} us  delta {delta:+6.2f} us  "
            f"ratio {(stock + delta) / stock:.3f}  "
            f"({delta * LAYERS_DSV32:+.1f} us per step at {LAYERS_DSV32} layers)"
        )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def simulated(next_n: int) -> tuple[dict[str, Callable[[], object]], str]:
    """The four arms through real vLLM on CPU, warmed with the doubles, then timed with no-op kernels."""
    os.environ["VLLM_ROCM_USE_AITER"] = "1"
    os.environ["VLLM_ROCM_USE_AITER_FLYDSL_PAGED_MQA_LOGITS"] = "1"
    os.environ.pop("VLLM_FLYDSL_INDEXER_SELFTEST", None)  # every default on, the self-test included
    # Except what decides the route: with no table, FlyDSL wherever eligible. The default (the built-in
    # table, else this node's measurement: under the CPU simulation, a wall-clock race) could keep the taken
    # arm's shape on stock; a warm route runs the same code whatever decided it.
    os.environ["VLLM_FLYDSL_INDEXER_TUNED_CSV"] = "none"
    for sub in ("aiter_flydsl", "amdsmi_gfx950"):
        sys.path.insert(0, str(DOUBLES / sub))
    import aiter.ops.triton.pa_mqa_logits as gluon
    import torch
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as target

    import vllm_flydsl_indexer
    from vllm_flydsl_indexer import patch
    from vllm_flydsl_indexer.tools.paths import call_site_in, vllm_workspace

    SESSION.enter_context(vllm_workspace(torch.device("cpu")))  # as check sets vLLM's workspace up
    vllm_flydsl_indexer.register()
    installed = patch.installed()
    assert installed is not None, "the plugin did not activate under the simulation"
    router = installed.router
    assert router.self_test, "the self-test is on by default"
    site = call_site_in(target)  # both arms called as the defining module's indexer calls them
    stock, patched = installed.original, target.rocm_fp8_paged_mqa_logits
    problems = {path: _problem(next_n, torch.device("cpu"), **shape) for path, shape in PATHS.items()}
    # Warm-up on the doubles' kernels: the self-test passes, the taken route is ready.
    taken = router.calls_taken
    for args in problems.values():
        site(patched, args, {})
    assert router.calls_taken == taken + 1 and list(router.self_tests.values()) == [None], router.self_tests
    noop = _noop
    gluon.deepgemm_fp8_paged_mqa_logits = noop
    router.variant = dataclasses.replace(router.variant, fn=noop)
    arms = {}
    for path, args in problems.items():
        arms[f"stock ({path} shape)"] = lambda a=args: site(stock, a, {})
        arms[f"patched, {path}"] = lambda a=args: site(patched, a, {})
    version = importlib.metadata.version("vllm")
    return _checked(arms, router), f"vLLM {version} on CPU (gfx950 simulation), torch {torch.__version__}"


def standalone(next_n: int) -> tuple[dict[str, Callable[[], object]], str]:
    """The four arms without vLLM: the stock copy and the router over it (the GPU if present)."""
    import torch

    from vllm_flydsl_indexer.router import FlyDSLRouter
    from vllm_flydsl_indexer.target import TARGET_MODULE
    from vllm_flydsl_indexer.tools.arms import (
        Workspace,
        mirror_hooks,
        reference_arms,
        simulated_callers,
        stock_call,
    )
    from vllm_flydsl_indexer.tools.arms import reference_variant as contract_variant
    from vllm_flydsl_indexer.tools.reference import GENERAL

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problems = {path: _problem(next_n, device, **shape) for path, shape in PATHS.items()}
    kernels = {"gluon": reference_arms().gluon}
    workspace = Workspace(4 * next_n, problems["taken"][6], device)
    stock = stock_call(lambda *a, **k: kernels["gluon"](*a, **k), workspace)
    from vllm_flydsl_indexer.tools.harness import quiet_logger

    # A stdlib logger with the *_once methods the router calls (vLLM's logger has them).
    router = FlyDSLRouter(stock, contract_variant(GENERAL), mirror_hooks(workspace), quiet_logger())
    with simulated_callers():  # the defining module's caller as audited, where no vLLM is there to read
        for args in problems.values():
            router.call_from(TARGET_MODULE, *args)
    assert router.calls_taken == 1 and list(router.self_tests.values()) == [None], router.self_tests
    kernels["gluon"] = _noop
    router.variant = dataclasses.replace(router.variant, fn=_noop)
    arms = {}
    for path, args in problems.items():
        arms[f"stock ({path} shape)"] = lambda a=args: stock(*a)
        arms[f"patched, {path}"] = lambda a=args: router.call_from(TARGET_MODULE, *a)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return _checked(arms, router), f"standalone (no vLLM) on {where} tensors, torch {torch.__version__}"


def _noop(*args, **kwargs) -> None:
    return None


def _problem(next_n: int, device, heads: int, head_dim: int, block_outer: bool = False) -> tuple:
    """The call's arguments; ``block_outer``: the cache a strided view of a wider one (V4.1's layout)."""
    import torch

    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    p = make_paged_problem(
        [4096] * 4,
        next_n=next_n,
        heads=heads,
        head_dim=head_dim,
        block_size=64,
        preshuffle=True,
        spare_blocks=0,
        device=device,
    )
    args = p.call_args()
    if block_outer:
        kv = args[1]
        wide = torch.zeros((*kv.shape[:3], 2 * kv.shape[3]), dtype=kv.dtype, device=device)
        wide[..., : kv.shape[3]] = kv
        args = (args[0], wide[..., : kv.shape[3]], *args[2:])
    return args


def _checked(arms: dict, router) -> dict:
    """``arms``, each called 100 times (warm caches: lru_cache, info_once), the paths checked."""
    taken, delegated = router.calls_taken, router.calls_delegated
    for fn in arms.values():
        for _ in range(100):
            fn()
    assert router.calls_taken == taken + 100, "the taken arm went to stock"
    assert router.calls_delegated == delegated + 200, "a stock-bound arm was taken"
    return arms


def interleaved(arms: dict, calls: int, rounds: int) -> dict[str, list[float]]:
    per_call: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call[name].append((time.perf_counter() - t0) / calls * 1e6)
    return per_call


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
