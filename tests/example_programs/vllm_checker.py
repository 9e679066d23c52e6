# SPDX-License-Identifier: Apache-2.0
"""Parses argument vectors (JSON on stdin) with vLLM's own `serve` and `bench serve` parsers.

tests/test_examples.py starts it with the module (``python vllm_checker.py``) so its
~20 s import of vLLM overlaps the other tests, then sends the argvs the scripts ran.
vLLM's CLI swaps in the CPU platform for `vllm bench` on a machine without a GPU; this
does the same so argument defaults can be computed. It prints one ``RESULT <json>`` line.
"""

import json
import sys

from vllm import platforms
from vllm.platforms.cpu import CpuPlatform

platforms.current_platform = CpuPlatform()
from vllm.benchmarks.serve import add_cli_args  # noqa: E402 (after the platform swap)
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def check_serve(argv):
    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub)
    args = parser.parse_args(argv)
    cmd.validate(args)
    return {
        "model": args.model_tag,
        "host": args.host,
        "port": args.port,
        "tensor_parallel_size": args.tensor_parallel_size,
        "seed": args.seed,
    }


def check_bench(argv):
    assert argv[:2] == ["bench", "serve"], argv
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    a = parser.parse_args(argv[2:])
    keys = (
        "dataset_name",
        "random_input_len",
        "random_output_len",
        "max_concurrency",
        "num_prompts",
        "seed",
        "save_result",
        "result_dir",
        "result_filename",
        "ignore_eos",
        "temperature",
        "metadata",
        "base_url",
        "endpoint",
        "model",
    )
    return {k: getattr(a, k) for k in keys}


request = json.loads(sys.stdin.read())
out = {}
for kind, check in (("serve", check_serve), ("bench", check_bench)):
    out[kind] = []
    for argv in request.get(kind, []):
        try:
            out[kind].append({"ok": True, "values": check(argv)})
        except BaseException as e:
            out[kind].append({"ok": False, "error": f"{type(e).__name__}: {e}"})
print("RESULT " + json.dumps(out))
