# SPDX-License-Identifier: Apache-2.0
"""The router's own host time per taken call: no vLLM, a no-op kernel, stub hooks.

Times ``FlyDSLRouter.call_from`` on a memoised, taken route (the hot path of
every decode step after warm-up), with the kernel a no-op and vLLM's hooks
stubbed, so only the router's Python work is timed. It imports whichever
vllm_flydsl_indexer is installed; to compare two revisions, install each into
its own venv and alternate the runs (host_overhead.py times the whole patched
call against stock inside real vLLM instead).

    python benchmarks/router_overhead.py [--rounds 200] [--calls 500]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

CALLER = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def ns_per_call(next_n: int, rounds: int, calls: int) -> float:
    import torch

    from vllm_flydsl_indexer import kernels
    from vllm_flydsl_indexer.router import FlyDSLRouter
    from vllm_flydsl_indexer.stock import StockHooks
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    p = make_paged_problem(
        [130, 5, 64, 77],
        next_n=next_n,
        heads=64,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    out = torch.empty(p.batch * next_n, p.max_model_len)
    variant = kernels.KernelVariant(
        "general", lambda *a, **k: None, "no-op", kernels.Limits(), "a no-op launch"
    )
    hooks = StockHooks(
        preshuffle=lambda bs: bs > 1,
        gluon_objection=lambda ratio, bs: None,
        output_buffer=lambda rows, mml: out,
        per_sequence_lens=lambda t: t,
        dcp_world_size=lambda: 1,
    )
    router = FlyDSLRouter(
        lambda *a, **k: out, variant, hooks, logging.getLogger("router_overhead"), is_capturing=lambda: False
    )
    args = p.call_args()
    for _ in range(100):
        router.call_from(CALLER, *args, compress_ratio=1)
    if router.calls_taken != 100:
        raise SystemExit(f"router_overhead: the route was not taken ({router.calls_delegated} delegated)")
    per_round = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            router.call_from(CALLER, *args, compress_ratio=1)
        per_round.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(per_round)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive, default=200, help="timed rounds; the median is reported")
    parser.add_argument("--calls", type=positive, default=500, help="calls per round")
    args = parser.parse_args()
    print(" ".join(f"next_n={n}: {ns_per_call(n, args.rounds, args.calls):.0f} ns" for n in (1, 2)))


if __name__ == "__main__":
    main()
