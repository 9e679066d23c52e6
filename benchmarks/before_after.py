# SPDX-License-Identifier: Apache-2.0
"""The plugin's host overhead per call at two source trees, side by side in one run.

Runs each tree's own ``benchmarks/host_overhead.py`` (its plugin first on ``PYTHONPATH``, the same
vLLM, torch and interpreter), alternating A B A B ... so a drift of the machine's speed hits both
alike, and prints each path's added host time (patched minus stock, measured within each process)
as the median over the runs, for A and for B, with B - A.

    python benchmarks/before_after.py BEFORE_TREE AFTER_TREE [--runs 3] [--next-n 2] [--json out.json]

A tree is a checkout of this repository (``git worktree add --detach /tmp/before <rev>``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PATHS = ("taken", "stock-bound")


def tree(text: str) -> Path:
    path = Path(text).resolve()
    if not (path / "benchmarks" / "host_overhead.py").is_file() or not (path / "src").is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a checkout of this repository")
    return path


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def revision(root: Path) -> str:
    """The tree's commit, and whether it has uncommitted changes (never its path)."""
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    status = ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"]
    dirty = subprocess.run(status, capture_output=True, text=True)
    return head.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")


def run(root: Path, next_n: int, calls: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        env = dict(os.environ, PYTHONPATH=str(root / "src"))
        command = [sys.executable, str(root / "benchmarks" / "host_overhead.py"), "--json", str(out)]
        command += ["--next-n", str(next_n), "--calls", str(calls), "--rounds", str(rounds)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=root)
        if done.returncode != 0:
            sys.exit(f"{root}: host_overhead.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=tree, help="tree A (the baseline)")
    parser.add_argument("after", type=tree, help="tree B")
    parser.add_argument("--runs", type=positive, default=3, help="processes per tree, alternated")
    parser.add_argument("--next-n", type=positive, default=2, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--calls", type=positive, default=20000, help="calls per round and arm")
    parser.add_argument("--rounds", type=positive, default=7, help="interleaved rounds per process")
    parser.add_argument("--json", dest="json_path", help="write every run's figures here")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.runs):
        for name in ("before", "after"):
            results[name].append(run(getattr(args, name), args.next_n, args.calls, args.rounds))
    where = results["after"][0]["where"]
    print(
        f"host overhead per call (patched - stock), {where}, next_n {args.next_n}: median of {args.runs} runs"
    )
    print(f"  {'path':<12} {'before':>10} {'after':>10} {'after - before':>15}")
    summary = {}
    for path in PATHS:
        before = statistics.median(r[path]["delta_us"] for r in results["before"])
        after = statistics.median(r[path]["delta_us"] for r in results["after"])
        summary[path] = {
            "before_delta_us": before,
            "after_delta_us": after,
            "change_us": round(after - before, 3),
        }
        print(f"  {path:<12} {before:+9.2f}us {after:+9.2f}us {after - before:+14.2f}us")
    if args.json_path:
        revisions = {name: revision(getattr(args, name)) for name in ("before", "after")}
        payload = {"summary": summary, "revisions": revisions, "runs": results}
        Path(args.json_path).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
