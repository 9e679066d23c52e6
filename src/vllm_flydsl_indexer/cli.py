# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer``: doctor, check and bench."""

from __future__ import annotations

import argparse
import sys


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-flydsl-indexer",
        description="vLLM gfx950 indexer decode logits on aiter's FlyDSL kernel: diagnose, verify, measure.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="which arm vLLM would run here, gate by gate, and why")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--strict", action="store_true", help="exit 1 unless the FlyDSL arm would be active")

    from vllm_flydsl_indexer.check import MODELS

    check = sub.add_parser("check", help="prove the stock and FlyDSL arms agree on this machine")
    check.add_argument(
        "--model", choices=[*MODELS, "all"], default="all", help="indexer shape (default: all)"
    )
    check.add_argument("--batch", type=int, help="sequences per case (default: 32 on GPU, 4 on CPU)")
    check.add_argument("--next-n", type=_int_list, help="comma list, e.g. 1,2 (default)")
    check.add_argument("--context-len", type=int, help="max context length (default: 32768 GPU, 2048 CPU)")
    check.add_argument("--block-size", type=_int_list, help="comma list of KVBlockSize (default 64,1)")
    check.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    check.add_argument("--reference", action="store_true", help="compare reference contracts even on gfx950")
    check.add_argument("--topk", type=int, default=2048, help="top-k compared per row (default 2048)")
    check.add_argument("--seed", type=int, default=0)

    from vllm_flydsl_indexer.bench import add_arguments as add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="A/B benchmark of the decode logits"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from vllm_flydsl_indexer import doctor

        return doctor.main(as_json=args.json, strict=args.strict)
    if args.command == "check":
        from vllm_flydsl_indexer import check

        return check.main(args)
    from vllm_flydsl_indexer import bench

    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
