# SPDX-License-Identifier: Apache-2.0
"""Two revisions of aiter's gfx950 kernel that aiter moved past are not supported (issue 43).

The earlier kernel (``SUPPORTED_HEADS``, no ``next_n_lens``; aiter 9661da3a) and the one that takes q
padded to ``MAX_NN`` rows (aiter f5b390371d) keep their doubles only for this: identification refuses
each in one line that names the supported APIs, and ``register()`` then leaves vLLM stock.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from vllm_flydsl_indexer import envs, patch
from vllm_flydsl_indexer.kernels import SUPPORTED, UNSUPPORTED, find_kernel, identify_flydsl
from vllm_flydsl_indexer.target import MARKER, TARGET_MODULE
from vllm_flydsl_indexer.tools.paths import call_site_in
from vllm_flydsl_indexer.tools.reference import make_paged_problem

# $AITER_DOUBLE_FLYDSL -> (the double's module, its key in kernels.UNSUPPORTED)
REVISIONS = {
    "gfx950-early": ("fp8_paged_mqa_logits_gfx950_early", "early"),
    "gfx950-padded-q": ("fp8_paged_mqa_logits_gfx950_padded_q", "padded"),
}


def refusal(revision: str) -> str:
    what = UNSUPPORTED[REVISIONS[revision][1]]
    return f"this aiter revision is not supported: {what} ({SUPPORTED}); the stock path is kept"


@pytest.mark.parametrize("revision", list(REVISIONS))
def test_identification_refuses_the_revision_in_one_line_naming_the_supported_ones(aiter_as, revision):
    aiter_as(flydsl=revision)
    module = importlib.import_module(f"aiter.ops.flydsl.kernels.mqa_logits.{REVISIONS[revision][0]}")
    reason = identify_flydsl(module.flydsl_fp8_paged_mqa_logits, module, "the double")
    assert reason == refusal(revision) and "\n" not in reason
    # The line names the revision, and every API that is supported.
    assert ("SUPPORTED_HEADS" if revision == "gfx950-early" else "padded to MAX_NN") in reason
    for supported in (
        "aiter's tuned dispatcher (PR #6140)",
        "the gfx950 kernel with next_n_lens",
        "PR #4221's general kernel",
    ):
        assert supported in reason
    # find_kernel finds it at aiter.ops.flydsl and at its own module (one function): refused once.
    variant, found = find_kernel()
    assert variant is None and found.count("this aiter revision is not supported") == 1, found
    assert f"aiter.ops.flydsl: {refusal(revision)}" in found


@pytest.mark.parametrize("revision", list(REVISIONS))
def test_register_then_leaves_vllm_stock_with_one_warning(
    target, workspace, aiter_as, monkeypatch, fresh_register, plugin_log, aiter_calls, revision
):
    aiter_as(flydsl=revision)
    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    assert patch.installed() is None
    assert not getattr(target.rocm_fp8_paged_mqa_logits, MARKER, False)
    lines = [r for r in plugin_log if r.levelno >= logging.WARNING]
    assert [r.levelno for r in lines] == [logging.WARNING], [r.getMessage() for r in lines]
    assert refusal(revision) in lines[0].getMessage()
    # A shape both revisions took (GLM-5.x's 32 heads at KVBlockSize 64, native MTP): vLLM's Gluon only.
    p = make_paged_problem(
        [150, 9, 77], next_n=2, heads=32, head_dim=128, block_size=64, preshuffle=True,
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    site = call_site_in(importlib.import_module(TARGET_MODULE))
    site(target.rocm_fp8_paged_mqa_logits, p.call_args(), {"compress_ratio": 1})
    assert [name for name, _ in aiter_calls] == ["gluon"]
