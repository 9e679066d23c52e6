# SPDX-License-Identifier: Apache-2.0
"""Host time per decode-logits call: stock vLLM vs the plugin's patched call.

Runs the installed vLLM's real ``rocm_fp8_paged_mqa_logits`` on CPU under the test
suite's gfx950 simulation (amdsmi and aiter doubles from ``tests/doubles``),
with both kernels replaced by no-ops so only Python host work is timed: the
stock function's own checks, workspace lookup and argument handling, against
the plugin's router. Both arms are timed side by side, interleaved, in one run.

    python benchmarks/host_overhead.py [--calls 20000] [--rounds 7] [--json out.json] [--tuned-csv T.csv]

``--tuned-csv`` loads a tuned table (``VLLM_FLYDSL_INDEXER_TUNED_CSV``) that must
send the timed shape to FlyDSL, to show the table costs the hot path nothing.

In PIECEWISE graph mode the call runs once per layer per step (61 layers on
DeepSeek-V3.2), so the per-call difference times 61 is the per-step cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOUBLES = ROOT / "tests" / "doubles"
LAYERS_DSV32 = 61


def setup_simulation() -> None:
    os.environ["VLLM_ROCM_USE_AITER"] = "1"
    os.environ["VLLM_ROCM_USE_AITER_FLYDSL_PAGED_MQA_LOGITS"] = "1"
    for sub in ("aiter_flydsl", "amdsmi_gfx950"):
        sys.path.insert(0, str(DOUBLES / sub))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per round and arm")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    parser.add_argument("--next-n", type=int, default=2)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--tuned-csv", help="register with this tuned table loaded")
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="no vLLM: time vLLM 0.33.0's Gluon branch as mirrored in arms.stock_call against the router, "
        "on the GPU if one is present (this includes the per-call capture check there)",
    )
    args = parser.parse_args()
    if args.standalone:
        return standalone(args)

    setup_simulation()
    if args.tuned_csv:
        os.environ["VLLM_FLYDSL_INDEXER_TUNED_CSV"] = args.tuned_csv
    import aiter.ops.triton.pa_mqa_logits as gluon
    import torch
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as target
    from vllm.v1.worker.workspace import init_workspace_manager

    import vllm_flydsl_indexer
    from vllm_flydsl_indexer import patch
    from vllm_flydsl_indexer.callers import call_site_in
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    def noop(*a, **k):
        return None

    gluon.deepgemm_fp8_paged_mqa_logits = noop
    init_workspace_manager(torch.device("cpu"))
    vllm_flydsl_indexer.register()
    installed = patch.installed()
    assert installed is not None, "plugin did not activate under the simulation"
    installed.router.variant = dataclasses.replace(installed.router.variant, fn=noop)
    assert not args.tuned_csv or installed.router.table is not None, "the tuned table was not loaded"

    p = make_paged_problem(
        [4096] * 4, next_n=args.next_n, heads=64, head_dim=128, block_size=64, preshuffle=True, spare_blocks=0
    )
    call_args = p.call_args()
    # Both arms are called from code living in the defining module, as its indexer calls them,
    # so the patched arm pays the wrapper's caller lookup and the caller rule exactly as in serving.
    site = call_site_in(target)
    arms = {
        "stock": lambda *a: site(installed.original, a, {}),
        "patched": lambda *a: site(target.rocm_fp8_paged_mqa_logits, a, {}),
    }
    for fn in arms.values():  # warm caches (lru_cache, info_once)
        for _ in range(100):
            fn(*call_args)
    taken_before = installed.router.calls_taken

    per_call = interleaved(arms, call_args, args.calls, args.rounds)
    assert installed.router.calls_taken - taken_before == args.rounds * args.calls, "patched arm delegated"

    stock = statistics.median(per_call["stock"])
    patched = statistics.median(per_call["patched"])
    result = {
        "cpu": _cpu_name(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "vllm": importlib.metadata.version("vllm"),
        "next_n": args.next_n,
        "tuned_csv": Path(args.tuned_csv).name if args.tuned_csv else None,
        "calls_per_round": args.calls,
        "rounds": args.rounds,
        "stock_us": round(stock, 3),
        "patched_us": round(patched, 3),
        "delta_us": round(patched - stock, 3),
        "ratio": round(patched / stock, 3),
        "delta_per_step_61_layers_us": round((patched - stock) * LAYERS_DSV32, 1),
        "samples_us": {k: [round(v, 3) for v in vs] for k, vs in per_call.items()},
    }
    setup = f"{args.rounds} interleaved rounds x {args.calls} calls, next_n={args.next_n}"
    print(f"host time per call, vLLM {result['vllm']} (median of {setup})")
    print(f"  stock   {stock:8.2f} us")
    print(f"  patched {patched:8.2f} us")
    print(
        f"  delta   {patched - stock:+8.2f} us  ratio {patched / stock:.3f}  "
        f"({(patched - stock) * LAYERS_DSV32:+.1f} us per step at {LAYERS_DSV32} layers)"
    )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0


def interleaved(arms: dict, call_args: tuple, calls: int, rounds: int) -> dict[str, list[float]]:
    per_call: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(*call_args)
            per_call[name].append((time.perf_counter() - t0) / calls * 1e6)
    return per_call


def standalone(args) -> int:
    import torch

    from vllm_flydsl_indexer.tools.arms import Arms, Workspace, from_defining_module, patched_call, stock_call
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    def noop(*a, **k):
        return None

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    p = make_paged_problem(
        [4096] * 4,
        next_n=args.next_n,
        heads=64,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        spare_blocks=0,
        device=device,
    )
    ws = Workspace(p.batch * p.next_n, p.max_model_len, device)
    router = patched_call(Arms(False, "no-op kernels", "", noop, noop), ws)
    arms = {"stock": stock_call(noop, ws), "patched": from_defining_module(router)}
    call_args = p.call_args()
    for fn in arms.values():
        for _ in range(100):
            fn(*call_args)
    per_call = interleaved(arms, call_args, args.calls, args.rounds)
    assert router.calls_delegated == 0
    stock, patched = statistics.median(per_call["stock"]), statistics.median(per_call["patched"])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"standalone host time per call on {where} tensors, CPU {_cpu_name()}, cuda initialised: "
        f"{torch.cuda.is_initialized()}"
    )
    print(f"  stock (mirrored) {stock:8.2f} us\n  patched          {patched:8.2f} us")
    print(f"  delta {patched - stock:+.2f} us  ratio {patched / stock:.3f}")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "mode": "standalone",
                    "device": where,
                    "cpu": _cpu_name(),
                    "stock_us": stock,
                    "patched_us": patched,
                    "delta_us": patched - stock,
                    "ratio": patched / stock,
                    "samples_us": per_call,
                },
                indent=1,
            )
        )
    return 0


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
