# SPDX-License-Identifier: Apache-2.0
"""The earlier revision of aiter's gfx950 kernel: heads 32 and 64, next_n 1..2.

Its double (``fp8_paged_mqa_logits_gfx950_early.py``) has that revision's
module constants, signature and checks (aiter 9661da3a). It was written for
DeepSeek-V3.2's indexer (64 heads) as much as for GLM-5.x's (32), so both
must take FlyDSL at vLLM's block size 64, and nothing else may reach it.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from conftest import call_site_or_skip
from test_agreement import poison_workspace
from test_kernel_variants import SYNC_OPS, SyncAudit
from vllm_flydsl_indexer import envs, kernels, patch, selftest
from vllm_flydsl_indexer import kernels as identification
from vllm_flydsl_indexer.selftest import compare_in_windows, read_window_ends
from vllm_flydsl_indexer.target import TARGET_MODULE
from vllm_flydsl_indexer.tools.models import HEADS, eligible_configs
from vllm_flydsl_indexer.tools.paths import call_site_in
from vllm_flydsl_indexer.tools.reference import make_paged_problem

EARLY_MODULE = "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_early"
LATER_MODULE = "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950"
DEEPSEEK_V41_SITE = "vllm.models.deepseek_v41.amd.ops.sparse_indexer"
GLM5NEXT_KPOOL_SITE = "vllm.models.glm5next.amd.sparse_indexer"


def early_variant() -> kernels.KernelVariant:
    module = importlib.import_module(EARLY_MODULE)
    variant = identification.identify(module.flydsl_fp8_paged_mqa_logits, module)
    assert isinstance(variant, kernels.KernelVariant), variant
    return variant


# ---------------------------------------------------------------- identification


def test_the_earlier_revision_is_identified_with_its_own_limits():
    variant = early_variant()
    assert variant.name == "gfx950-early"
    limits = variant.limits
    assert limits.heads == {32, 64} and limits.head_dims == {128} and limits.block_sizes == {64}
    assert limits.index_dim == 132 and limits.max_next_n == 2
    assert limits.preshuffle_required and limits.q_contiguous
    assert {(m, h, b, n) for m, h, _, b, n in eligible_configs(variant)} == {
        ("DeepSeek-V3.2", 64, 64, 1),
        ("DeepSeek-V3.2", 64, 64, 2),
        ("GLM-5.x/DSV4.1", 32, 64, 1),
        ("GLM-5.x/DSV4.1", 32, 64, 2),
    }
    # Every other shape names its reason.
    assert "KVBlockSize=16 is not one of [64]" in limits.violation(64, 128, 16, 132, 1)
    assert "KVBlockSize=1 is not one of [64]" in limits.violation(64, 128, 1, 132, 1)
    assert "next_n=3 is above this kernel's maximum 2" in limits.violation(64, 128, 64, 132, 3)
    assert "heads=128 is not one of [32, 64]" in limits.violation(128, 128, 64, 132, 1)
    assert "index_dim=136 is not 132" in limits.violation(64, 128, 64, 136, 1)
    # The later revision keeps its own: heads 32 only, next_n up to MAX_NN.
    later = importlib.import_module(LATER_MODULE)
    later_variant = identification.identify(later.flydsl_fp8_paged_mqa_logits, later)
    assert later_variant.name == "gfx950" and later_variant.limits.heads == {32}
    assert later_variant.limits.max_next_n == 8


def test_its_limits_follow_its_module_constants(monkeypatch):
    module = importlib.import_module(EARLY_MODULE)
    monkeypatch.setattr(module, "SUPPORTED_HEADS", (32,))
    assert early_variant().limits.heads == {32}
    monkeypatch.setattr(module, "SUPPORTED_HEADS", "32,64")
    reason = identification.identify(module.flydsl_fp8_paged_mqa_logits, module)
    assert "lacks readable SUPPORTED_HEADS" in reason


def _in_file(source: str):
    """A function defined from ``source`` whose source ``inspect`` can read (a real file)."""
    import tempfile
    import textwrap
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    (folder / "early_wrapper_probe.py").write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location("early_wrapper_probe", folder / "early_wrapper_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.wrapper


@pytest.mark.parametrize(
    "check,expected",
    [
        ("if next_n not in (1, 2):", frozenset({1, 2})),
        ("if next_n not in (1, 2, 3, 4):", frozenset({1, 2, 3, 4})),
        ("if next_n in (1,):", frozenset({1})),
        ("if next_n not in (2, 4):", "not 1..k"),
        ("if next_n not in NEXT_NS:", "against a name"),
        ("if not 1 <= next_n <= 2:", "comparisons of q.shape[1]"),
        ("if next_n > 2:", "compared with Gt"),
        ("if False:", "0 comparisons"),
    ],
)
def test_the_next_n_range_is_read_from_the_wrappers_check(check, expected):
    fn = _in_file(
        f"""
        NEXT_NS = (1, 2)
        def wrapper(q, kv, w, out, ctx, bt, mml, *, Preshuffle=True, KVBlockSize=64, SplitKV=None):
            batch, next_n, heads, head_dim = q.shape
            {check}
                raise ValueError("next_n")
            return out
        """
    )
    found = identification.gfx950_next_n_values(fn)
    if isinstance(expected, frozenset):
        assert found == expected
    else:
        assert isinstance(found, str) and expected in found, found


def test_a_wrapper_whose_next_n_check_cannot_be_read_stays_stock(monkeypatch):
    module = importlib.import_module(EARLY_MODULE)
    monkeypatch.setattr(
        identification, "gfx950_next_n_values", lambda fn: "source unreadable: OSError: no file"
    )
    reason = identification.identify(module.flydsl_fp8_paged_mqa_logits, module)
    assert "next_n range cannot be read from its source (source unreadable" in reason


# ---------------------------------------------------------------- the launch


def test_the_launch_passes_its_own_automatic_split_kv_explicitly_and_reads_nothing_on_the_host(
    aiter_as, aiter_calls
):
    from conftest import Recorder, hooks
    from vllm_flydsl_indexer.router import FlyDSLRouter

    aiter_as(flydsl="gfx950-early")
    variant = early_variant()
    module = importlib.import_module(EARLY_MODULE)
    for batch, max_model_len in ((3, 640), (1, 4096), (40, 640)):
        lens = [max_model_len] + [max(2, max_model_len // (i + 2)) for i in range(batch - 1)]
        shape = dict(next_n=2, heads=64, head_dim=128, block_size=64, preshuffle=True)
        p = make_paged_problem(lens, max_model_len=max_model_len, **shape)
        buffer = torch.full((batch * 2, max_model_len), float("nan"))
        # The launch's knobs alone: the self-test (tests/test_selftest.py) needs a real stock arm.
        router = FlyDSLRouter(
            Recorder(), variant, hooks(buffer=buffer), logging.getLogger("t"), self_test=False
        )
        router.call_from(TARGET_MODULE, *p.call_args())  # first call: compile, announce
        audit = SyncAudit()
        with audit:
            router.call_from(TARGET_MODULE, *p.call_args())
        assert router.calls_taken == 2
        assert not SYNC_OPS & set(audit.ops), audit.ops
        (route,) = [r for r in router._routes.values() if r.config]
        cus = kernels.cu_count(p.q_fp8.device)
        assert route.kwargs == {
            "Preshuffle": True,
            "KVBlockSize": 64,
            "SplitKV": kernels.explicit_split_kv(cus, batch, max_model_len, 64, 8),
        }
        # The value equals what the wrapper's own automatic rule computes for this device.
        aiter_calls.clear()
        module.flydsl_fp8_paged_mqa_logits(
            p.q_fp8,
            p.kv_cache,
            p.weights,
            buffer,
            p.context_lens[:, -1],
            p.block_tables,
            max_model_len,
            TotalCuCount=cus,
        )
        assert aiter_calls[-1][1]["SplitKV"] == route.kwargs["SplitKV"], (batch, max_model_len)


# ---------------------------------------------------------------- through real vLLM


def _problem(batch: int, heads: int, kvb: int, next_n: int, seed: int, per_row_bounds: bool = True):
    lens = torch.randint(next_n, 300, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    return make_paged_problem(
        lens,
        next_n=next_n,
        heads=heads,
        head_dim=128,
        block_size=kvb,
        preshuffle=kvb > 1,
        per_row_bounds=per_row_bounds,
        generator=torch.Generator().manual_seed(1000 + seed),
    )


def _stock_then_patched(installed, site, target, args, rows, max_model_len, calls=None):
    """Stock, then the patched call; with ``calls``, a shape's first-call self-test (stock's Gluon,
    then this API on its synthetic problem at SplitKV 1 and at its pages, the largest SplitKV any live
    launch reaches clamped as FlyDSL clamps it) is checked and dropped from them."""
    poison_workspace(rows, max_model_len)
    stock = installed.original(*args, compress_ratio=1).clone()
    poison_workspace(rows, max_model_len)
    tested = len(installed.router.self_tests)
    out = site(target.rocm_fp8_paged_mqa_logits, args, {"compress_ratio": 1})
    if calls is not None and len(installed.router.self_tests) > tested:
        assert [a for a, _ in calls[1:4]] == ["gluon", *["flydsl-gfx950-early"] * 2], calls
        # The largest: the live max_model_len's pages, clamped to the synthetic problem's.
        pages = min(selftest.width(64, args[0].shape[1])[1], -(-max_model_len // 64))
        assert [k["SplitKV"] for _, k in calls[2:4]] == [1, pages], calls
        del calls[1:4]
    return stock, out


@pytest.fixture
def early_installed(target, workspace, aiter_as, monkeypatch, fresh_register, plugin_log):
    aiter_as(flydsl="gfx950-early")
    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    installed = patch.installed()
    assert installed is not None, [r.getMessage() for r in plugin_log]
    assert installed.router.variant.name == "gfx950-early"
    return installed


@pytest.mark.parametrize("caller", [TARGET_MODULE, DEEPSEEK_V41_SITE])
def test_deepseek_v32_and_glm5_take_flydsl_at_kvb64_and_every_read_column_equals_stock(
    target, early_installed, aiter_calls, plugin_log, caller
):
    site = call_site_in(call_site_or_skip(caller))
    seed = 0
    for heads in HEADS:
        for kvb in (64, 16, 1):
            for next_n in (1, 2):  # plain decode, and native MTP (a (B, 2) table)
                seed += 1
                p = _problem(5, heads, kvb, next_n, seed)
                rows = p.batch * next_n
                aiter_calls.clear()
                stock, out = _stock_then_patched(
                    early_installed, site, target, p.call_args(), rows, p.max_model_len, aiter_calls
                )
                shape = (heads, kvb, next_n)
                arms = [a for a, _ in aiter_calls]
                assert arms == ["gluon", "flydsl-gfx950-early" if kvb == 64 else "gluon"], shape
                result = compare_in_windows(
                    stock, out, read_window_ends(p.context_lens, rows, next_n), topk=64
                )
                assert result.nan_free and result.ok(0), (shape, result.describe())
    taken = [r.getMessage() for r in plugin_log if "FlyDSL taken for" in r.getMessage()]
    assert len(taken) == 4, taken  # heads 64 and 32, next_n 1 and 2, all at KVBlockSize 64
    assert any("heads=64 head_dim=128 KVBlockSize=64 next_n=2" in m for m in taken), taken
    stock_reasons = [r.getMessage() for r in plugin_log if "stock path for this call" in r.getMessage()]
    assert any("KVBlockSize=16 is not one of [64] (gfx950-early FlyDSL kernel)" in m for m in stock_reasons)
    assert any("KVBlockSize=1 is not one of [64] (gfx950-early FlyDSL kernel)" in m for m in stock_reasons)
    assert not [r for r in plugin_log if r.levelno >= logging.ERROR]


def test_outside_its_contract_nothing_reaches_it(target, early_installed, aiter_calls, plugin_log):
    """next_n 3, a strided q, a strided (block-outer) cache, MTP from the kpool caller: stock, no error."""
    defining = call_site_in(importlib.import_module(TARGET_MODULE))
    cases = []
    p = _problem(4, 64, 64, 3, seed=31)  # a native (B, 3) table: above this kernel's next_n 2
    cases.append(("next_n=3", defining, p.call_args(), p))
    p = _problem(4, 64, 64, 1, seed=32)
    padded = torch.empty((4, 1, 64, 256), dtype=p.q_fp8.dtype)
    padded[..., :128] = p.q_fp8
    strided_q = padded[..., :128]
    assert not strided_q.is_contiguous()
    assert torch.equal(strided_q.view(torch.uint8), p.q_fp8.view(torch.uint8))
    cases.append(("strided q", defining, (strided_q, *p.call_args()[1:]), p))
    p = _problem(4, 32, 64, 1, seed=33)
    layers = torch.randint(0, 256, (p.kv_cache.shape[0], 2, *p.kv_cache.shape[1:]), dtype=torch.uint8)
    layers[:, 1] = p.kv_cache
    block_outer = layers[:, 1]
    assert not block_outer.is_contiguous()
    cases.append(("block-outer cache", defining, (p.q_fp8, block_outer, *p.call_args()[2:]), p))
    kpool = import_kpool_site()
    if kpool is not None:
        p = _problem(4, 32, 64, 2, seed=34)
        cases.append(("MTP from the kpool indexer", call_site_in(kpool), p.call_args(), p))
    for label, site, args, p in cases:
        rows = p.batch * p.next_n
        aiter_calls.clear()
        stock, out = _stock_then_patched(early_installed, site, target, args, rows, p.max_model_len)
        assert [a for a, _ in aiter_calls] == ["gluon", "gluon"], label
        result = compare_in_windows(stock, out, read_window_ends(p.context_lens, rows, p.next_n), topk=64)
        assert result.nan_free and result.ok(0), (label, result.describe())
    messages = [r.getMessage() for r in plugin_log]
    assert any(
        "next_n=3 is above this kernel's maximum 2 (gfx950-early FlyDSL kernel)" in m for m in messages
    ), messages
    assert any("q_fp8 is not contiguous (gfx950-early FlyDSL kernel)" in m for m in messages)
    assert any("kv_cache is strided" in m for m in messages)
    assert not [r for r in plugin_log if r.levelno >= logging.ERROR]


def import_kpool_site():
    from conftest import import_call_site

    return import_call_site(GLM5NEXT_KPOOL_SITE)


def test_doctor_shows_flydsl_active_and_the_shapes_this_revision_takes(aiter_as):
    from vllm_flydsl_indexer.tools import doctor

    aiter_as(flydsl="gfx950-early")
    data = doctor.report({envs.SWITCH: "1"})
    assert data["arm"] == "flydsl", data["reason"]
    assert data["kernel"]["variant"] == "gfx950-early"
    taken = {(s["heads"], s["kv_block_size"], s["next_n"]) for s in data["kernel"]["shapes"] if s["flydsl"]}
    assert taken == {(64, 64, 1), (64, 64, 2), (32, 64, 1), (32, 64, 2)}
    text = doctor.render(data)
    assert "kernel:   gfx950-early: gfx950-specialised FlyDSL kernel, earlier revision" in text
    assert "DeepSeek-V3.2 64x128              64   1       FlyDSL" in text
    assert "DeepSeek-V3.2 64x128              64   2       FlyDSL from audited callers" in text
    assert "GLM-5.x/DSV4.1 32x128             64   2       FlyDSL from audited callers" in text
    assert "DeepSeek-V3.2 64x128              1    1       stock (outside this kernel's contract)" in text
    assert "arm:      FlyDSL" in text
