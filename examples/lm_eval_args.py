#!/usr/bin/env python3
"""Print the ``lm_eval`` argument vector for one accuracy task, one argument per line.

accuracy_ab.sh runs ``lm_eval "${argv[@]}"`` with exactly these lines, so both arms
get the same evaluation and tests/test_examples.py can parse the same vector with
lm-eval's own CLI parser. Written against lm-eval 0.4.13.

Tasks:
  gsm8k  5-shot GSM8K (1319 problems; prompts stay under DeepSeek-V3.2's 2048-token
         indexer top-k, so it is a sanity check rather than a test of the indexer).
  gpqa   GPQA Diamond, zero-shot chain of thought (gated data set: needs a Hugging Face
         login that accepted its terms; long generations cross the 2048-token top-k).
  niah   RULER needle-in-a-haystack niah_single_1 at 32k and 64k tokens by default,
         where the sparse indexer really chooses which tokens attention reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

TASKS = ("gsm8k", "gpqa", "niah")
GSM8K_FEWSHOT = 5
GPQA_TASK = "gpqa_diamond_cot_zeroshot"
NIAH_TASK = "niah_single_1"
NIAH_MAX_GEN_TOKS = 128  # niah_single_1's own generation limit
DEFAULT_NIAH_LENGTHS = (32768, 65536)
REQUEST_TIMEOUT_S = 1800
# Characters that lm-eval's ``key=value,...`` splitter treats as structure.
UNSPLITTABLE = ",[](){}\"'"


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def lengths(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated context lengths, each >= 1024."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from e
    if any(v < 1024 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every length must be at least 1024")
    return values


def model_args(
    model: str, tokenizer: str, base_url: str, num_concurrent: int, seed: int, extra: dict[str, object]
) -> str:
    """lm-eval's ``key=value,...`` string for the ``local-completions`` model."""
    fields: dict[str, object] = {
        "model": model,
        "base_url": base_url,
        "num_concurrent": num_concurrent,
        "tokenized_requests": False,
        "tokenizer": tokenizer,
        "seed": seed,
        "timeout": REQUEST_TIMEOUT_S,
        **extra,
    }
    for key, value in fields.items():
        if any(ch in UNSPLITTABLE for ch in str(value)):
            raise ValueError(
                f"{key}={value!r}: lm-eval splits model_args on these characters: {UNSPLITTABLE}"
            )
    return ",".join(f"{key}={value}" for key, value in fields.items())


def build_argv(
    task: str,
    *,
    model: str,
    tokenizer: str,
    base_url: str,
    output_path: str,
    seed: int = 1234,
    num_concurrent: int = 32,
    gpqa_max_gen_toks: int = 4096,
    niah_lengths: Sequence[int] = DEFAULT_NIAH_LENGTHS,
) -> list[str]:
    """The ``lm_eval run ...`` arguments (without the program name) for one task."""
    extra: dict[str, object] = {}
    task_args: list[str]
    if task == "gsm8k":
        task_args = ["--tasks", "gsm8k", "--num_fewshot", str(GSM8K_FEWSHOT)]
    elif task == "gpqa":
        task_args = ["--tasks", GPQA_TASK, "--gen_kwargs", f"max_gen_toks={gpqa_max_gen_toks}"]
    elif task == "niah":
        extra["max_length"] = max(niah_lengths) + NIAH_MAX_GEN_TOKS
        metadata = json.dumps({"max_seq_lengths": list(niah_lengths)}, separators=(",", ":"))
        task_args = ["--tasks", NIAH_TASK, "--metadata", metadata]
    else:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    margs = model_args(model, tokenizer, base_url, num_concurrent, seed, extra)
    return [
        "run",
        "--model",
        "local-completions",
        "--model_args",
        margs,
        *task_args,
        "--seed",
        str(seed),
        "--output_path",
        output_path,
        "--log_samples",
    ]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--model", required=True, help="served model name (as passed to vllm serve)")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer name or path (default: --model)")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1/completions")
    p.add_argument("--output-path", required=True, help="lm-eval --output_path (a directory)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-concurrent", type=positive_int, default=32)
    p.add_argument("--gpqa-max-gen-toks", type=positive_int, default=4096)
    p.add_argument(
        "--niah-lengths",
        type=lengths,
        default=DEFAULT_NIAH_LENGTHS,
        help="comma-separated context lengths for niah (default: 32768,65536)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        out = build_argv(
            args.task,
            model=args.model,
            tokenizer=args.tokenizer or args.model,
            base_url=args.base_url,
            output_path=args.output_path,
            seed=args.seed,
            num_concurrent=args.num_concurrent,
            gpqa_max_gen_toks=args.gpqa_max_gen_toks,
            niah_lengths=args.niah_lengths,
        )
    except ValueError as e:
        p.error(str(e))
    if any("\n" in arg for arg in out):
        p.error("an argument contains a newline")
    sys.stdout.write("".join(f"{arg}\n" for arg in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
