# SPDX-License-Identifier: Apache-2.0
"""Replay the router over every row of a tuned table and model each policy from the table's own times.

Under the test suite's gfx950 simulation (amdsmi and aiter doubles from ``tests/doubles``, aiter's
gfx950 FlyDSL kernel found), the plugin registers through ``register()`` (the real table loading)
and each row's shape and batch is called through vLLM's real ``rocm_fp8_paged_mqa_logits`` from its
defining module, on a GPU of the rows' CU count (stubbed: it is a host-side property). The arm the
router takes is read from the doubles' call record. Nothing is timed: each arm's time is the row's
own ``gluon_us`` (stock) or ``flydsl_us`` (FlyDSL), so the ratios are the table's measurements
routed by this code, not a measurement of ours (the self-test is off: it does not change the arm). Three
policies side by side:

* ``stock``: every call on vLLM's Gluon call (1.0 by definition);
* ``flydsl-everywhere``: the router with ``VLLM_FLYDSL_INDEXER_TUNED_CSV=none``;
* ``router+table``: the router with the table (default: the built-in one).

    python benchmarks/table_routing.py [--tuned-csv T.csv] [--json out.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOUBLES = ROOT / "tests" / "doubles"
POLICIES = ("stock", "flydsl-everywhere", "router+table")


def setup_simulation() -> None:
    os.environ["VLLM_ROCM_USE_AITER"] = "1"
    os.environ["VLLM_ROCM_USE_AITER_FLYDSL_PAGED_MQA_LOGITS"] = "1"
    os.environ["AITER_DOUBLE_FLYDSL"] = "gfx950"
    # Each configuration's first-call self-test launches both arms on a small problem first; the
    # replay asks only which arm the route takes.
    os.environ["VLLM_FLYDSL_INDEXER_SELFTEST"] = "0"
    for sub in ("aiter_flydsl", "amdsmi_gfx950"):
        sys.path.insert(0, str(DOUBLES / sub))


def table_rows(path: str) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(line for line in f if not line.lstrip().startswith("#")))


def register(tuned_csv: str) -> object:
    """A fresh ``register()`` with ``VLLM_FLYDSL_INDEXER_TUNED_CSV=tuned_csv`` ('' unsets it)."""
    import vllm_flydsl_indexer
    from vllm_flydsl_indexer import envs, patch

    patch.uninstall()
    vllm_flydsl_indexer._registered = False
    if tuned_csv:
        os.environ[envs.TUNED_CSV] = tuned_csv
    else:
        os.environ.pop(envs.TUNED_CSV, None)
    vllm_flydsl_indexer.register()
    installed = patch.installed()
    assert installed is not None, "the plugin did not activate under the simulation"
    assert installed.router.variant.name == "gfx950", installed.router.variant
    return installed


def routed_arm(row: dict[str, str]) -> str:
    """The arm the installed router takes for this row's shape and batch: 'flydsl' or 'stock'."""
    import aiter
    import torch
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as target

    from vllm_flydsl_indexer.tools.paths import call_site_in
    from vllm_flydsl_indexer.tools.reference import make_paged_problem

    batch, next_n = int(row["batch_size"]), int(row["next_n"])
    p = make_paged_problem(
        torch.randint(next_n, next_n + 80, (batch,), generator=torch.Generator().manual_seed(batch)).tolist(),
        next_n=next_n,
        heads=int(row["heads"]),
        head_dim=int(row["head_dim"]),
        block_size=int(row["kv_block_size"]),
        preshuffle=row["preshuffle"].strip().lower() in ("1", "true"),
        per_row_bounds=next_n > 1,
        generator=torch.Generator().manual_seed(batch * 10 + next_n),
    )
    aiter.CALLS.clear()
    call_site_in(target)(target.rocm_fp8_paged_mqa_logits, p.call_args(), {})
    arms = [arm for arm, _ in aiter.CALLS]
    assert arms in (["gluon"], ["flydsl-gfx950"]), arms
    return "flydsl" if arms == ["flydsl-gfx950"] else "stock"


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def replay(tuned_csv: str | None) -> dict:
    """Every row's arm under each policy and the modelled ratio against Gluon, with the summary."""
    setup_simulation()
    import torch
    from vllm.v1.worker.workspace import init_workspace_manager

    from vllm_flydsl_indexer import kernels, tuning

    path = tuned_csv or tuning.BUILTIN_PATH
    rows = table_rows(path)
    (cus,) = {int(r["cu_num"]) for r in rows}
    kernels._cu_count = lambda device_type, index: cus  # the rows' GPU (cu_count reads it)
    if not torch.accelerator.is_available():
        # vLLM 0.32's workspace resize empties the accelerator cache, which a CPU-only torch refuses.
        torch.accelerator.empty_cache = lambda: None
    init_workspace_manager(torch.device("cpu"))
    arms: dict[str, list[str]] = {"stock": ["stock"] * len(rows)}
    for policy, variable in (("flydsl-everywhere", tuning.OFF_VALUES[0]), ("router+table", tuned_csv or "")):
        installed = register(variable)
        table = installed.router.table
        assert (table is None) == (policy == "flydsl-everywhere"), (policy, table)
        arms[policy] = [routed_arm(r) for r in rows]
    shapes = []
    for i, r in enumerate(rows):
        gluon, flydsl = float(r["gluon_us"]), float(r["flydsl_us"])
        shapes.append(
            {
                "batch": int(r["batch_size"]),
                "next_n": int(r["next_n"]),
                "backend": r["backend"],
                "gluon_us": gluon,
                "flydsl_us": flydsl,
                **{
                    policy: {
                        "arm": arms[policy][i],
                        "ratio": gluon / (flydsl if arms[policy][i] == "flydsl" else gluon),
                    }
                    for policy in POLICIES
                },
            }
        )
    summary = {}
    for policy in POLICIES:
        ratios = [s[policy]["ratio"] for s in shapes]
        worst = min(shapes, key=lambda s: s[policy]["ratio"])
        summary[policy] = {
            "geomean": round(geomean(ratios), 4),
            "worst": round(worst[policy]["ratio"], 4),
            "worst_shape": f"batch {worst['batch']}, next_n {worst['next_n']}",
            "flydsl_shapes": sum(s[policy]["arm"] == "flydsl" for s in shapes),
        }
    return {
        "table": tuning.BUILTIN_LABEL if tuned_csv is None else tuned_csv,
        "gfx": rows[0]["gfx"],
        "cu_num": cus,
        "rows": len(rows),
        "what": (
            "the table's own times (AMD's measurements for the built-in table) routed by this code's router; "
            "ratio = gluon_us / time of the arm taken; not a measurement of ours"
        ),
        "summary": summary,
        "shapes": shapes,
    }


def render(result: dict) -> str:
    out = [
        f"table: {result['table']} ({result['rows']} rows, {result['gfx']}, {result['cu_num']} CUs)",
        f"what:  {result['what']}",
        "",
        f"{'batch':>5} {'next_n':>6}  {'gluon us':>8} {'flydsl us':>9}  "
        + "  ".join(f"{p:>22}" for p in POLICIES),
    ]
    for s in result["shapes"]:
        cells = "  ".join(f"{s[p]['arm']:>14} {s[p]['ratio']:>6.3f}x" for p in POLICIES)
        out.append(f"{s['batch']:>5} {s['next_n']:>6}  {s['gluon_us']:>8.2f} {s['flydsl_us']:>9.2f}  {cells}")
    out.append("")
    for policy, line in result["summary"].items():
        out.append(
            f"{policy:<18} geomean {line['geomean']:.3f}x of Gluon, worst {line['worst']:.3f}x "
            f"({line['worst_shape']}), FlyDSL at {line['flydsl_shapes']}/{result['rows']} shapes"
        )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuned-csv", help="replay this aiter-format table (default: the built-in one)")
    parser.add_argument("--json", dest="json_path", help="also write the result as JSON here")
    args = parser.parse_args()
    result = replay(args.tuned_csv)
    print(render(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
