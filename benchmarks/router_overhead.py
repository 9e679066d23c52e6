# SPDX-License-Identifier: Apache-2.0
"""The router's own host time per call, defaults on: no vLLM, no-op kernels, stub hooks.

Times ``FlyDSLRouter.call_from`` on a ready, taken route (the hot path of every
decode step after warm-up) and on a memoised stock-bound route, against a bare
call of the stub that stands for stock, so only the router's Python work is
timed. The self-test is on: each shape is warmed first with the reference
contracts (pure torch, which agree), then both kernels become no-ops.

    python benchmarks/router_overhead.py [--rounds 200] [--calls 500]

host_overhead.py times the whole patched call against stock inside real vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

CALLER = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def ns_per_call(next_n: int, rounds: int, calls: int) -> dict[str, float]:
    import torch

    from vllm_flydsl_indexer.router import FlyDSLRouter
    from vllm_flydsl_indexer.tools.arms import reference_arms, reference_variant, simulated_callers
    from vllm_flydsl_indexer.tools.reference import GENERAL, make_paged_problem

    def problem(head_dim: int):
        return make_paged_problem(
            [130, 5, 64, 77],
            next_n=next_n,
            heads=64,
            head_dim=head_dim,
            block_size=64,
            preshuffle=True,
            generator=torch.Generator().manual_seed(1),
        ).call_args()

    taken, bound = problem(128), problem(96)  # no FlyDSL API takes head_dim 96
    kernels = {"gluon": reference_arms().gluon}
    buffers: dict[tuple[int, int], torch.Tensor] = {}

    def output_buffer(rows: int, max_model_len: int) -> torch.Tensor:
        return buffers.setdefault((rows, max_model_len), torch.empty(rows, max_model_len))

    def per_sequence_lens(lens: torch.Tensor) -> torch.Tensor:
        return lens[:, -1].contiguous() if lens.dim() == 2 and lens.shape[1] > 1 else lens

    def stock(q, kv, weights, lens, tables, meta, max_model_len, *, compress_ratio=1):
        """The stub that stands for vLLM's original: its output buffer and its Gluon launch."""
        out = output_buffer(q.shape[0] * q.shape[1], max_model_len)
        block_size = kv.shape[1]
        lens = per_sequence_lens(lens)
        gluon = kernels["gluon"]
        gluon(
            q,
            kv,
            weights,
            out,
            lens,
            tables,
            max_model_len,
            Preshuffle=block_size > 1,
            KVBlockSize=block_size,
        )
        return out

    from vllm_flydsl_indexer.target import StockHooks
    from vllm_flydsl_indexer.tools.harness import quiet_logger

    hooks = StockHooks(
        preshuffle=lambda bs: bs > 1,
        gluon_objection=lambda ratio, bs: None,
        output_buffer=output_buffer,
        per_sequence_lens=per_sequence_lens,
        dcp_world_size=lambda: 1,
    )
    router = FlyDSLRouter(
        stock,
        reference_variant(GENERAL),
        hooks,
        quiet_logger(),  # a stdlib logger with the *_once methods the router calls
        is_capturing=lambda: False,
    )
    # Warm-up on the reference contracts: the self-test passes and the taken route is ready.
    with simulated_callers():  # next_n 2: the caller as audited, where no vLLM is there to read
        router.call_from(CALLER, *taken, compress_ratio=1)
        router.call_from(CALLER, *bound, compress_ratio=1)
    if router.calls_taken != 1 or list(router.self_tests.values()) != [None]:
        raise SystemExit(f"router_overhead: warm-up did not take the route ({router.self_tests})")

    def noop(*args, **kwargs):
        return None

    kernels["gluon"] = noop
    router.variant = dataclasses.replace(router.variant, fn=noop)
    arms = {
        "stock stub": lambda: stock(*taken, compress_ratio=1),
        "taken": lambda: router.call_from(CALLER, *taken, compress_ratio=1),
        "stock-bound": lambda: router.call_from(CALLER, *bound, compress_ratio=1),
    }
    before = (router.calls_taken, router.calls_delegated)
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter_ns() - start) / calls)
    made = rounds * calls
    if (router.calls_taken - before[0], router.calls_delegated - before[1]) != (made, made):
        raise SystemExit("router_overhead: a timed call took the other path")
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive, default=200, help="timed rounds; the median is reported")
    parser.add_argument("--calls", type=positive, default=500, help="calls per round")
    args = parser.parse_args()
    for next_n in (1, 2):
        ns = ns_per_call(next_n, args.rounds, args.calls)
        stub, taken, bound = ns["stock stub"], ns["taken"], ns["stock-bound"]
        print(
            f"next_n={next_n}: stock stub {stub:.0f} ns; router taken {taken:.0f} ns ({taken - stub:+.0f}); "
            f"stock-bound {bound:.0f} ns ({bound - stub:+.0f})"
        )


if __name__ == "__main__":
    main()
