#!/usr/bin/env python3
"""Side-by-side table of two lm-eval runs: stock arm versus FlyDSL arm.

Each argument is an lm-eval ``results_*.json`` file or a directory; every
``results_*.json`` under a directory is read, and a task found in several files
takes its numbers from the newest (by file name, which ends in lm-eval's timestamp).

For every task and metric it prints stock, flydsl, the difference (flydsl - stock)
and the standard error of that difference, sqrt(se_stock^2 + se_flydsl^2), from
lm-eval's own ``<metric>_stderr,<filter>`` entries. A difference larger than
``--sigma`` (default 2) standard errors is flagged. Metrics without a standard error
(RULER reports "N/A") get no flag, and a metric that is -1 in both runs (RULER's
mark for a context length that had no samples) is left out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

STDERR = "_stderr,"


@dataclass(frozen=True)
class Row:
    task: str
    metric: str
    stock: float
    flydsl: float
    se: float | None

    @property
    def diff(self) -> float:
        return self.flydsl - self.stock

    def flagged(self, sigma: float) -> bool | None:
        """Whether |diff| > sigma * SE; None when the SE is unknown."""
        if self.se is None:
            return None
        return abs(self.diff) > sigma * self.se


def results_files(path: Path) -> list[Path]:
    """``path`` itself, or every ``results_*.json`` below it, oldest first."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.rglob("results_*.json"), key=lambda p: p.name)
        if files:
            return files
    raise FileNotFoundError(f"no lm-eval results_*.json at {path}")


def load_results(path: Path) -> dict[str, dict[str, object]]:
    """Task name -> lm-eval's metrics dict, merged over the results files of ``path``."""
    merged: dict[str, dict[str, object]] = {}
    for file in results_files(path):
        data = json.loads(file.read_text(encoding="utf-8"))
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, dict):
            raise ValueError(f"{file}: no 'results' object; is this an lm-eval results file?")
        merged.update(results)
    return merged


def number(value: object) -> float | None:
    """``value`` as a float, or None for lm-eval's "N/A" and other non-numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def metric_keys(metrics: dict[str, object]) -> list[str]:
    """The ``<metric>,<filter>`` keys that hold a number (not stderr, not alias/name)."""
    return [k for k, v in metrics.items() if "," in k and STDERR not in k and number(v) is not None]


def stderr_of(metrics: dict[str, object], key: str) -> float | None:
    name, _, filt = key.partition(",")
    return number(metrics.get(f"{name}{STDERR}{filt}"))


def compare(stock: dict[str, dict[str, object]], flydsl: dict[str, dict[str, object]]) -> list[Row]:
    """One row per (task, metric) present in both runs, in task then metric order."""
    rows = []
    for task in sorted(stock.keys() & flydsl.keys()):
        a, b = stock[task], flydsl[task]
        for key in metric_keys(a):
            va, vb = number(a[key]), number(b.get(key))
            if va is None or vb is None or (va == -1 and vb == -1):
                continue
            sa, sb = stderr_of(a, key), stderr_of(b, key)
            se = math.hypot(sa, sb) if sa is not None and sb is not None else None
            rows.append(Row(task, key, va, vb, se))
    return rows


def render(rows: Sequence[Row], sigma: float) -> str:
    """A markdown table of ``rows``."""
    head = f"| task | metric | stock | flydsl | diff | SE(diff) | \\|diff\\| > {sigma:g}·SE |"
    lines = [head, "|---|---|---:|---:|---:|---:|:---:|"]
    for r in rows:
        flag = r.flagged(sigma)
        mark = "n/a" if flag is None else ("**YES**" if flag else "no")
        se = "n/a" if r.se is None else f"{r.se:.4f}"
        lines.append(
            f"| {r.task} | {r.metric} | {r.stock:.4f} | {r.flydsl:.4f} | {r.diff:+.4f} | {se} | {mark} |"
        )
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stock", type=Path, help="stock arm: results_*.json or a directory of them")
    p.add_argument("flydsl", type=Path, help="FlyDSL arm: results_*.json or a directory of them")
    p.add_argument("--sigma", type=float, default=2.0, help="flag |diff| > sigma * SE (default 2)")
    p.add_argument("--fail-on-flag", action="store_true", help="exit 1 if any row is flagged")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.sigma <= 0:
        p.error("--sigma must be positive")
    try:
        stock, flydsl = load_results(args.stock), load_results(args.flydsl)
    except (OSError, ValueError) as e:
        print(f"ab_table: {e}", file=sys.stderr)
        return 1
    rows = compare(stock, flydsl)
    sys.stdout.write(render(rows, args.sigma))
    for name, only in (("stock", stock.keys() - flydsl.keys()), ("flydsl", flydsl.keys() - stock.keys())):
        if only:
            print(f"\nOnly in the {name} run (not compared): {', '.join(sorted(only))}")
    flagged = [r for r in rows if r.flagged(args.sigma)]
    if flagged:
        print(f"\n{len(flagged)} metric(s) differ by more than {args.sigma:g} standard errors.")
    return 1 if flagged and args.fail_on_flag else 0


if __name__ == "__main__":
    sys.exit(main())
