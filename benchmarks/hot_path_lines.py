# SPDX-License-Identifier: Apache-2.0
"""What each piece of the router's hot path costs on the host (timeit, best of 7; each figure includes
a lambda call of about 30-40 ns), on the GPU's tensors where there is one: the lines behind
``host_overhead.py``'s deltas.

    python benchmarks/hot_path_lines.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import platform
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def positive(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 10**7:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 10000000, got {text!r}")
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=positive, default=200000, help="calls per timing (1-10000000)")
    calls = parser.parse_args().calls
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from vllm_flydsl_indexer.target import TARGET_MODULE
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problem = make_paged_problem(
        [4096] * 4,
        next_n=2,
        heads=64,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        spare_blocks=0,
        device=device,
    )
    q, kv, w, lens, bt, sched, mml = problem.call_args()
    # The router's memo key (FlyDSLRouter.call_from) and its facts, as it builds them.
    key = (q.shape, kv.shape, kv.is_contiguous(), lens.shape, mml, 1, TARGET_MODULE)
    routes = {key: object()}

    def facts_of() -> tuple:
        return (
            q.dtype, kv.dtype, w.dtype, w.shape, lens.dtype, bt.dtype, bt.shape, q.is_contiguous(),
            w.is_contiguous(), q.device,
        )  # fmt: skip

    facts = facts_of()

    def called(a, b, c, d, e, f, g, h, *, compress_ratio=1) -> None:
        return None

    class Counter:
        calls = 0

    counter = Counter()
    rows = [
        ("q.shape", lambda: q.shape),
        ("kv.is_contiguous()", lambda: kv.is_contiguous()),
        ("memo key: 3 shapes + contiguity + 3 scalars, as a tuple", lambda: (
            q.shape, kv.shape, kv.is_contiguous(), lens.shape, mml, 1, TARGET_MODULE)),
        ("hash(key)", lambda: hash(key)),
        ("memo key built and looked up", lambda: routes.get(
            (q.shape, kv.shape, kv.is_contiguous(), lens.shape, mml, 1, TARGET_MODULE))),
        ("the facts (10 reads, as a tuple; a FlyDSL verdict only)", facts_of),
        ("facts == route.facts", lambda: facts == facts),
        ("q.device", lambda: q.device),
        ("q.dtype", lambda: q.dtype),
        ("counter += 1", lambda: setattr(counter, "calls", counter.calls + 1)),
        ("one extra call level (8 args + kw)", lambda: called(
            None, q, kv, w, lens, bt, sched, mml, compress_ratio=1)),
        ("sys._getframe(1).f_globals.get", lambda: sys._getframe(0).f_globals.get("__name__")),
    ]  # fmt: skip
    cpu = "unknown"
    if Path("/proc/cpuinfo").is_file():
        cpu = Path("/proc/cpuinfo").read_text().split("model name")[-1].split("\n")[0].strip(":\t ")
    print("cpu:", cpu, "| python", platform.python_version(), "| torch", torch.__version__, "|", device)
    for name, fn in rows:
        best = min(timeit.repeat(fn, number=calls, repeat=7)) / calls * 1e9
        print(f"{best:8.1f} ns  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
