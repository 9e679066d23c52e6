# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer``: doctor, check, bench and tune (``bench --tune``: ``tune --out``'s old spelling).

The parser is built without importing torch (``--help`` is instant); each
command imports what it needs after its arguments have been validated.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from vllm_flydsl_indexer.tools import cli_args, outputs, settings, streams, vllm_import
from vllm_flydsl_indexer.tools.interrupt import EXIT_INTERRUPTED, StopNow, terminate_as_interrupt

__all__ = ["EXIT_BROKEN_PIPE", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = cli_args.OneLineParser(
        prog=settings.PROG,
        description="vLLM gfx950 indexer decode logits on aiter's FlyDSL kernel: diagnose, verify, measure.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="which arm vLLM would run here, gate by gate, and why")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--strict", action="store_true", help="exit 1 unless the FlyDSL arm would be active")
    doctor.add_argument(
        "--model",
        metavar="M",
        help="a Hugging Face model directory or a model_type: does its indexer reach FlyDSL here?",
    )

    cli_args.add_check_arguments(
        sub.add_parser(
            "check",
            help="prove the stock and FlyDSL arms agree on this machine",
            description=f"Prove the stock and FlyDSL arms agree on this machine. {settings.STOP_CHECK}",
        )
    )
    cli_args.add_bench_arguments(
        sub.add_parser(
            "bench",
            help="A/B benchmark of the decode logits",
            description=f"A/B benchmark of the decode logits. Outputs: {outputs.OUTPUT_RULE}. "
            f"{settings.STOP_BENCH}",
        )
    )
    cli_args.add_tune_arguments(
        sub.add_parser(
            "tune",
            help="measure on this GPU: a model's buckets into the node cache (--model), or a table (--out)",
            description="The one command that measures on this GPU. --model M: every bucket a model's "
            "indexer will use, measured as the plugin measures a bucket at its first use, into this node's "
            "cache, which the plugin reads by itself. --out FILE: Gluon against FlyDSL per shape of a grid, "
            "into an aiter-format tuned CSV (`bench --tune FILE` is its old spelling). "
            f"Outputs: {outputs.OUTPUT_RULE}. {settings.STOP_TUNE}",
        )
    )
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # the usage line and its errors name every command
    return parser


# 128 + SIGPIPE, as a shell reports a Unix tool whose reader went away.
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status is the work's verdict, whatever happens to its output.

    A report that cannot be printed (stdout closed, full, unable to encode a character) costs one line
    on stderr, never the status; a reader that went away (``| head -1``) exits 141, as Unix tools do.
    Either way every file the command was asked to write is written first.
    """
    streams.occupy_closed_descriptors()
    command = "?"
    with streams.guarded() as (out, _), vllm_import.net():  # whatever vLLM's import raises is reported
        try:
            args, unknown = build_parser().parse_known_args(argv)
            command = args.command
            if unknown:  # named by the command they follow, as its own parser would
                settings.fail(f"{settings.PROG} {command}", f"unrecognized arguments: {' '.join(unknown)}")
            status: int | SystemExit = _interruptible(args)
        except SystemExit as e:  # argparse, --help, settings.fail: their status, after the check below
            status = e
    if out.broken_pipe:
        return EXIT_BROKEN_PIPE
    problem = out.problem()
    if problem is not None:
        with contextlib.suppress(Exception):
            print(f"{settings.PROG} {command}: {problem}", file=sys.stderr, flush=True)
    if isinstance(status, SystemExit):
        raise status
    return status


def _interruptible(args: argparse.Namespace) -> int:
    try:
        with terminate_as_interrupt():  # SIGTERM or SIGHUP outside a tool's own handlers: 130, as SIGINT
            return _run(args)
    except (StopNow, KeyboardInterrupt):
        # A second signal (StopNow), or a Ctrl-C before or after a command's own handlers.
        print(f"{settings.PROG} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        from vllm_flydsl_indexer.tools import reach  # no torch: --model is checked before any work

        try:
            model = reach.resolve(args.model) if args.model is not None else None
        except reach.ModelError as e:
            settings.fail(f"{settings.PROG} doctor", str(e))
        from vllm_flydsl_indexer.tools import doctor

        return doctor.main(as_json=args.json, strict=args.strict, model=model)
    if args.command == "tune" and not args.tune_path:
        problem = cli_args.tune_model_problem(args)  # before torch, aiter or vLLM is imported
        if problem is not None:
            settings.fail(f"{settings.PROG} tune", problem)
        from vllm_flydsl_indexer.tools import tune_model as command

        smaller = "--max-batch or --next-n"
    else:
        problem = cli_args.validate(args)
        if problem is not None:
            settings.fail(f"{settings.PROG} {args.command}", problem)
        if args.command == "check":
            from vllm_flydsl_indexer.tools import check as command
        elif args.tune_path:
            from vllm_flydsl_indexer.tools import tune as command
        else:
            from vllm_flydsl_indexer.tools import bench as command
        smaller = "--batch, --context-len or --next-n"
    try:
        return command.main(args)
    except (MemoryError, RuntimeError) as e:
        # The sizes were checked against what the tool can run; this machine's memory may be less.
        text = " ".join(str(e).split()) or type(e).__name__
        if not isinstance(e, MemoryError) and "out of memory" not in text and "can't allocate" not in text:
            raise
        print(
            f"{settings.PROG} {args.command}: error: out of memory ({text[:200]}); try a smaller {smaller}",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
