#!/usr/bin/env python3
"""Compare two sets of ``vllm bench serve --save-result`` files: stock arm versus FlyDSL arm.

Each argument is a result JSON file or a directory of them (``*.json``, not recursive,
skipping ``*.pytorch.json``).
Runs are paired by the ``max_concurrency`` recorded in each file. For every pair it
prints output tokens/s and mean and median TPOT (vLLM 0.33's ``output_throughput``,
``mean_tpot_ms`` and ``median_tpot_ms``) with the relative change, and warns when the
two runs did not do the same work (failed requests, different request or input-token
counts), since then the numbers are not comparable.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# (key in vLLM's result JSON, label, whether higher is better)
METRICS = (
    ("output_throughput", "output tok/s", True),
    ("mean_tpot_ms", "mean TPOT (ms)", False),
    ("median_tpot_ms", "median TPOT (ms)", False),
)
# Keys that must agree between the arms for the comparison to be like for like.
WORKLOAD_KEYS = ("num_prompts", "completed", "total_input_tokens")

Run = dict[str, object]


@dataclass(frozen=True)
class Row:
    concurrency: int | None
    label: str
    stock: float
    flydsl: float
    higher_is_better: bool

    @property
    def change_pct(self) -> float:
        return (self.flydsl - self.stock) / self.stock * 100.0 if self.stock else float("nan")

    @property
    def flydsl_better(self) -> bool:
        return self.flydsl > self.stock if self.higher_is_better else self.flydsl < self.stock


def load_runs(path: Path) -> dict[int | None, Run]:
    """max_concurrency -> result dict, from a file or every ``*.json`` in a directory."""
    if path.is_dir():
        # vLLM also writes <name>.pytorch.json when SAVE_TO_PYTORCH_BENCHMARK_FORMAT is set.
        files = sorted(f for f in path.glob("*.json") if not f.name.endswith(".pytorch.json"))
    else:
        files = [path]
    if not files or not files[0].is_file():
        raise FileNotFoundError(f"no vllm bench result JSON at {path}")
    runs: dict[int | None, Run] = {}
    for file in files:
        data = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or "output_throughput" not in data:
            raise ValueError(f"{file}: not a `vllm bench serve` result (no output_throughput)")
        raw = data.get("max_concurrency")
        conc = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
        if conc in runs:
            raise ValueError(f"{file}: a second run with max_concurrency={conc} in {path}")
        runs[conc] = data
    return runs


def compare(stock: dict[int | None, Run], flydsl: dict[int | None, Run]) -> list[Row]:
    """One row per metric for every concurrency present in both arms."""
    rows = []
    for conc in sorted(stock.keys() & flydsl.keys(), key=lambda c: -1 if c is None else c):
        for key, label, higher in METRICS:
            a, b = stock[conc].get(key), flydsl[conc].get(key)
            if isinstance(a, int | float) and isinstance(b, int | float):
                rows.append(Row(conc, label, float(a), float(b), higher))
    return rows


def problems(stock: dict[int | None, Run], flydsl: dict[int | None, Run]) -> list[str]:
    """Reasons the two arms' runs are not like for like."""
    out = []
    for conc in sorted(stock.keys() ^ flydsl.keys(), key=lambda c: -1 if c is None else c):
        arm = "stock" if conc in stock else "flydsl"
        out.append(f"concurrency {conc}: only the {arm} arm has a run")
    for conc in sorted(stock.keys() & flydsl.keys(), key=lambda c: -1 if c is None else c):
        a, b = stock[conc], flydsl[conc]
        for arm, run in (("stock", a), ("flydsl", b)):
            if run.get("failed"):
                out.append(f"concurrency {conc}: {run['failed']} failed request(s) in the {arm} arm")
        for key in WORKLOAD_KEYS:
            if a.get(key) != b.get(key):
                out.append(f"concurrency {conc}: {key} differs (stock {a.get(key)}, flydsl {b.get(key)})")
    return out


def render(rows: Sequence[Row]) -> str:
    """A markdown table of ``rows``."""
    lines = [
        "| concurrency | metric | stock | flydsl | change | flydsl |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        verdict = "same" if r.flydsl == r.stock else ("better" if r.flydsl_better else "worse")
        cells = (
            str(r.concurrency),
            r.label,
            f"{r.stock:.2f}",
            f"{r.flydsl:.2f}",
            f"{r.change_pct:+.1f}%",
            verdict,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stock", type=Path, help="stock arm: a result JSON or a directory of them")
    p.add_argument("flydsl", type=Path, help="FlyDSL arm: a result JSON or a directory of them")
    p.add_argument("--strict", action="store_true", help="exit 1 if the runs are not like for like")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        stock, flydsl = load_runs(args.stock), load_runs(args.flydsl)
    except (OSError, ValueError) as e:
        print(f"bench_table: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(render(compare(stock, flydsl)))
    issues = problems(stock, flydsl)
    for issue in issues:
        print(f"WARNING: {issue}")
    return 1 if issues and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
