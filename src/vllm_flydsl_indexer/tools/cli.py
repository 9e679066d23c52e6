# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer``: doctor, check and bench.

The parser is built without importing torch (``--help`` is instant); each
command imports what it needs after its arguments have been validated.
"""

from __future__ import annotations

import argparse
import sys

from vllm_flydsl_indexer.tools import cli_args


def build_parser() -> argparse.ArgumentParser:
    parser = cli_args.OneLineParser(
        prog=cli_args.PROG,
        description="vLLM gfx950 indexer decode logits on aiter's FlyDSL kernel: diagnose, verify, measure.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{doctor,check,bench}", required=True)

    doctor = sub.add_parser("doctor", help="which arm vLLM would run here, gate by gate, and why")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--strict", action="store_true", help="exit 1 unless the FlyDSL arm would be active")

    cli_args.add_check_arguments(
        sub.add_parser("check", help="prove the stock and FlyDSL arms agree on this machine")
    )
    cli_args.add_bench_arguments(sub.add_parser("bench", help="A/B benchmark of the decode logits"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from vllm_flydsl_indexer.tools import doctor

        return doctor.main(as_json=args.json, strict=args.strict)
    problem = cli_args.validate(args)
    if problem is not None:
        cli_args.fail(f"{cli_args.PROG} {args.command}", problem)
    if args.command == "check":
        from vllm_flydsl_indexer.tools import check as command
    elif args.tune_path:
        from vllm_flydsl_indexer.tools import tune as command
    else:
        from vllm_flydsl_indexer.tools import bench as command
    try:
        return command.main(args)
    except (MemoryError, RuntimeError) as e:
        # The sizes were checked against what the tool can run; this machine's memory may be less.
        text = " ".join(str(e).split()) or type(e).__name__
        if not isinstance(e, MemoryError) and "out of memory" not in text and "can't allocate" not in text:
            raise
        print(
            f"{cli_args.PROG} {args.command}: error: out of memory ({text[:200]}); "
            "try a smaller --batch, --context-len or --next-n",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
