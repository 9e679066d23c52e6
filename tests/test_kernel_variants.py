# SPDX-License-Identifier: Apache-2.0
"""Every aiter situation: which API was found, its exact contract, graph safety, no crash.

The doubles model each API's contract as aiter's public source states it
(``tests/doubles/aiter_flydsl``): the general PR #4221 kernel, the
gfx950-specialised kernel (which raises ValueError outside its shapes and
reads ``context_lens.max().item()`` when SplitKV is left automatic), its two
revisions aiter moved past (the earlier one for heads 32/64 and the one that
takes q padded to ``MAX_NN`` rows: refused, ``test_gfx950_early_revision.py``),
the tuned dispatcher, an aiter without any, and one whose import raises.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import logging
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_agreement import poison_workspace
from vllm_flydsl_indexer import envs, kernels, patch
from vllm_flydsl_indexer import kernels as identification
from vllm_flydsl_indexer.router import FlyDSLRouter
from vllm_flydsl_indexer.selftest import read_window_ends
from vllm_flydsl_indexer.target import TARGET_MODULE
from vllm_flydsl_indexer.tools.harness import compare_in_windows
from vllm_flydsl_indexer.tools.models import eligible_configs
from vllm_flydsl_indexer.tools.paths import call_site_in
from vllm_flydsl_indexer.tools.reference import make_paged_problem

ADAPTER_LOG = logging.getLogger("vllm.plugins.flydsl_indexer")
SYNC_OPS = {"aiter::_local_scalar_dense", "aten::_local_scalar_dense", "aten::item", "aten::nonzero"}


KERNEL_MODULE = "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits"


def gfx950_module():
    return importlib.import_module("aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950")


# ---------------------------------------------------------------- identification


def identify(fn, module=None):
    return identification.identify_flydsl(fn, module, "a double")


def test_general_kernel_is_identified():
    module = importlib.import_module("aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits")
    variant = identify(module.flydsl_fp8_paged_mqa_logits, module)
    assert variant.name == "general" and variant.location == "a double"
    # The general rule, no contract of module constants, no SplitKV.
    assert (variant.heads, variant.head_dims, variant.block_sizes, variant.index_dim) == (None,) * 4
    assert variant.max_next_n is None and not variant.gfx950 and variant.split_kv_workgroups_per_cu is None


def test_gfx950_kernel_limits_come_from_its_module_constants(monkeypatch):
    module = gfx950_module()
    variant = identify(module.flydsl_fp8_paged_mqa_logits, module)
    assert variant.name == "gfx950"
    assert variant.heads == {32} and variant.head_dims == {128}
    assert variant.block_sizes == {64} and variant.index_dim == 132
    assert variant.max_next_n == 8 and variant.gfx950 and variant.split_kv_workgroups_per_cu == 3
    # Other constants are read as they are.
    monkeypatch.setattr(module, "NUM_HEADS", (32, 64))
    monkeypatch.setattr(module, "MAX_NN", 2)
    wider = identify(module.flydsl_fp8_paged_mqa_logits, module)
    assert wider.heads == {32, 64} and wider.max_next_n == 2
    assert {(h, b, n) for _, h, _, b, n in eligible_configs(wider)} == {
        (64, 64, 1),
        (64, 64, 2),
        (32, 64, 1),
        (32, 64, 2),
    }
    monkeypatch.delattr(module, "INDEX_DIM")
    assert "lacks a readable INDEX_DIM" in identify(module.flydsl_fp8_paged_mqa_logits, module)


def test_unknown_api_shapes_are_refused():
    def no_knobs(q, kv, w, out, ctx, bt, mml, *, Preshuffle=False, KVBlockSize=1):
        return out

    def positional_knobs(q, kv, w, out, ctx, bt, mml, Preshuffle=False, KVBlockSize=1, ChunkK=128):
        return out

    def gfx950_without_split(
        q, kv, w, out, ctx, bt, mml, *, next_n_lens=None, Preshuffle=True, KVBlockSize=64
    ):
        return out

    # aiter's first gfx950 wrapper (a helper module's era): no Preshuffle keyword.
    def first_gfx950(
        q, kv, w, out, ctx, bt, mml, *, KVBlockSize=64, SplitKV=None, TotalCuCount=None, stream=None
    ):
        return out

    # The earlier heads 32/64, next_n 1..2 signature, but in a module without its constants.
    def heads_32_64_gfx950(
        q,
        kv,
        w,
        out,
        ctx,
        bt,
        mml,
        *,
        Preshuffle=True,
        KVBlockSize=64,
        SplitKV=None,
        TotalCuCount=None,
        stream=None,
    ):
        return out

    assert "unknown shape" in identify(no_knobs)
    assert "lacks keyword-only Preshuffle, KVBlockSize" in identify(positional_knobs)
    assert "unknown shape" in identify(gfx950_without_split)
    assert "lacks keyword-only Preshuffle" in identify(first_gfx950)
    # Without SUPPORTED_HEADS it is not even the earlier revision: an API of an unknown shape.
    assert "unknown shape (no next_n_lens, no ChunkK/WavePerEU/variant)" in identify(heads_32_64_gfx950)

    def early_without_split(q, kv, w, out, ctx, bt, mml, *, Preshuffle=True, KVBlockSize=64):
        return out

    assert "unknown shape" in identify(early_without_split)
    for fn in (no_knobs, positional_knobs, gfx950_without_split, first_gfx950, heads_32_64_gfx950):
        assert "not supported" not in identify(fn)


def padded_q_module():
    return importlib.import_module("aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_padded_q")


GFX950_CONSTANTS = ("NUM_HEADS", "HEAD_DIM", "KV_BLOCK_SIZE", "INDEX_DIM", "MAX_NN")


def test_padded_q_gfx950_revision_is_told_apart_by_its_source_alone():
    import inspect

    nn, padded = gfx950_module(), padded_q_module()
    # What the lookup used to go by is identical in both revisions ...
    assert inspect.signature(nn.flydsl_fp8_paged_mqa_logits) == inspect.signature(
        padded.flydsl_fp8_paged_mqa_logits
    )
    assert [getattr(nn, c) for c in GFX950_CONSTANTS] == [getattr(padded, c) for c in GFX950_CONSTANTS]
    # ... only the wrapper's check of q.shape[1] against MAX_NN differs: a range check, or equality.
    assert identify(nn.flydsl_fp8_paged_mqa_logits, nn).name == "gfx950"
    reason = identify(padded.flydsl_fp8_paged_mqa_logits, padded)
    assert isinstance(reason, str) and identification.UNSUPPORTED["padded"] in reason


def test_gfx950_api_whose_source_cannot_be_read_keeps_stock():
    """Same signature and constants, no source (exec'd): cannot tell the q contract, so stock."""
    constants = types.ModuleType("gfx950_without_source_double")
    for name in GFX950_CONSTANTS:
        setattr(constants, name, getattr(gfx950_module(), name))
    namespace = {"__name__": "gfx950_without_source_double_not_importable"}
    exec(  # noqa: S102 - a function with no retrievable source, on purpose
        "def flydsl_fp8_paged_mqa_logits(q, kv, w, out, ctx, bt, mml, *, next_n_lens=None,\n"
        "        Preshuffle=True, KVBlockSize=64, SplitKV=None, TotalCuCount=None, stream=None):\n"
        "    return out\n",
        namespace,
    )
    fn = namespace["flydsl_fp8_paged_mqa_logits"]
    reason = identify(fn, constants)
    assert "q contract cannot be told (source unreadable" in reason
    assert reason.endswith("the stock path is kept")

    # A wrapper that checks q.shape[1] neither way is not guessed at either.
    def unchecked(
        q, kv, w, out, ctx, bt, mml, *, next_n_lens=None, Preshuffle=True, KVBlockSize=64, SplitKV=None
    ):
        b, n, h, d = q.shape
        return out

    unchecked.__module__ = namespace["__name__"]  # its constants are read where it was found
    reason = identify(unchecked, constants)
    assert "q contract cannot be told (no range check of q's rows against MAX_NN" in reason


def test_an_unrelated_paged_mqa_logits_module_is_not_the_dispatcher():
    import types

    fork = types.ModuleType("aiter.paged_mqa_logits")
    fork.paged_mqa_logits = lambda *a, **k: None  # an OPUS function of another fork: no config lookup
    assert "not aiter's tuned dispatcher" in identification.identify_dispatcher(fork, "fork")


@pytest.mark.parametrize(
    "flydsl,dispatcher,expected",
    [
        ("general", False, "general"),
        ("gfx950", False, "gfx950"),
        ("general", True, "dispatcher"),
        ("gfx950", True, "dispatcher"),
        ("gfx950-early", False, None),
        ("gfx950-early", True, "dispatcher"),
        ("gfx950-padded-q", False, None),
        ("gfx950-padded-q", True, "dispatcher"),
        ("none", False, None),
        ("broken-import", False, None),
    ],
)
def test_find_kernel_in_each_aiter_situation(aiter_as, flydsl, dispatcher, expected):
    aiter_as(flydsl=flydsl, dispatcher=dispatcher)
    variant, reason = identification.find_kernel()
    assert (variant.name if variant else None) == expected, reason
    if expected is not None:
        assert reason == "found"
    if flydsl == "broken-import":
        assert "RuntimeError: double: flydsl version does not match this aiter" in reason
    if flydsl.startswith("gfx950-") and expected is None:
        # The re-export and the module it re-exports are one function: refused once.
        assert reason.count("this aiter revision is not supported") == 1, reason
    if expected is None:
        assert "no tuned paged MQA logits dispatcher" in reason
        assert "aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits:" in reason


def test_explicit_split_kv_follows_aiters_dispatcher_rule():
    # max(1, min(pages, ceil(cu * 3 / batch))), pages = ceil(max_model_len / KVB)
    assert kernels.explicit_split_kv(256, 64, 65536, 64) == 12
    assert kernels.explicit_split_kv(256, 1, 65536, 64) == 768
    assert kernels.explicit_split_kv(256, 1, 1000, 64) == 16  # capped by the pages
    assert kernels.explicit_split_kv(256, 4096, 65536, 64) == 1


def test_split_kv_rounds_up_in_every_launch_that_passes_it(aiter_as):
    """Both ceilings of the rule round up, as aiter's own automatic SplitKV does: the workgroups per
    sequence (``ceil(cu * wg / batch)``) and the pages (``ceil(max_model_len / KVB)``), for the gfx950
    kernel (3 per CU, or a tuned row's), over fresh random shapes."""
    import math
    import random

    gfx950 = identify(gfx950_module().flydsl_fp8_paged_mqa_logits, gfx950_module())
    assert gfx950.name == "gfx950"
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    uneven = 0
    for _ in range(200):
        cus, batch, block = rng.randint(1, 320), rng.randint(1, 600), rng.choice((16, 64, 128))
        max_model_len, wg = rng.randint(1, 200_000), rng.randint(1, 4)
        for variant, per_cu in ((gfx950, wg), (gfx950, 0)):
            workgroups = per_cu or variant.split_kv_workgroups_per_cu
            wanted = max(1, min(math.ceil(max_model_len / block), math.ceil(cus * workgroups / batch)))
            kwargs = variant.launch_kwargs(batch, block, max_model_len, cus, per_cu)
            assert kwargs["SplitKV"] == wanted, (seed, variant.name, cus, batch, block, max_model_len, per_cu)
            assert kernels.explicit_split_kv(cus, batch, max_model_len, block, workgroups) == wanted, seed
            uneven += (cus * workgroups) % batch != 0 or max_model_len % block != 0
    assert uneven > 100, seed  # most draws round
    # Where rounding down would differ, by name: 80 CUs x 3 / 7 sequences is 34.3; 1000 tokens are 15.6
    # pages of 64.
    assert gfx950.launch_kwargs(7, 64, 1 << 20, 80)["SplitKV"] == 35
    assert gfx950.launch_kwargs(1, 64, 1000, 256)["SplitKV"] == 16


def test_aiters_gfx950_entry_beside_the_general_kernel_is_left_alone(aiter_as):
    """Two unreleased aiter revisions export ``flydsl_fp8_paged_mqa_logits_gfx950`` (no Preshuffle keyword)
    beside the general kernel: find_kernel identifies the general kernel and uses nothing else."""
    aiter_as(flydsl="general+entry")
    flydsl = importlib.import_module("aiter.ops.flydsl")
    assert callable(flydsl.flydsl_fp8_paged_mqa_logits_gfx950)
    variant, reason = identification.find_kernel()
    assert variant.name == "general" and variant.fn is flydsl.flydsl_fp8_paged_mqa_logits, reason
    assert variant.fn is not flydsl.flydsl_fp8_paged_mqa_logits_gfx950


# ---------------------------------------------------------------- each variant through real vLLM

SHAPES = [(heads, kvb, next_n) for heads in (64, 32) for kvb in (64, 1) for next_n in (1, 2)]


def expected_arms(variant: str, heads: int, kvb: int, batch: int) -> list[str]:
    """Written out from each API's contract, independently of the plugin's tables."""
    if variant == "general":
        return ["flydsl"]
    if variant == "gfx950":
        return ["flydsl-gfx950"] if (heads, kvb) == (32, 64) else ["gluon"]
    # The dispatcher is handed only the calls its table sends to FlyDSL; where it picks Gluon (with
    # its own ChunkK/WavePerEU), vLLM's original makes its own Gluon call.
    return ["dispatcher", "flydsl"] if (heads, kvb) == (32, 64) and batch >= 64 else ["gluon"]


def self_test_arms(variant: str, heads: int, kvb: int, next_n: int) -> list[str]:
    """A shape's first taken call first runs its self-test: stock's Gluon, then FlyDSL itself on the
    synthetic problem: at SplitKV 1 and at the largest reachable SplitKV where the API takes SplitKV
    (the gfx950 kernels; on a CPU of 1 CU the largest is 4: aiter's tuner's largest wg_per_cu), once
    at its default launch where it does not; aiter's dispatcher forced to FlyDSL through its
    run_paged_mqa_logits (which the double records before the kernel it launches), whatever its
    table says for four sequences."""
    if variant == "dispatcher":
        return ["gluon", "dispatcher", "flydsl"]
    flydsl = expected_arms(variant, heads, kvb, 64)
    return ["gluon", *(flydsl if variant == "general" else flydsl * 2)]


@pytest.mark.parametrize("variant,dispatcher", [("general", False), ("gfx950", False), ("general", True)])
@pytest.mark.slow_except("general-False", "gfx950-False")
def test_each_variant_takes_exactly_its_shapes_and_agrees(
    target, workspace, aiter_as, monkeypatch, fresh_register, plugin_log, aiter_calls, variant, dispatcher
):
    aiter_as(flydsl=variant, dispatcher=dispatcher)
    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    installed = patch.installed()
    assert installed is not None, [r.getMessage() for r in plugin_log]
    name = "dispatcher" if dispatcher else variant
    assert installed.router.variant.name == name
    site = call_site_in(importlib.import_module(TARGET_MODULE))
    batches = (3, 64) if dispatcher else (3,)
    tested = set()
    for batch in batches:
        for i, (heads, kvb, next_n) in enumerate(SHAPES):
            lens = torch.randint(next_n, 200, (batch,), generator=torch.Generator().manual_seed(i)).tolist()
            p = make_paged_problem(
                lens,
                next_n=next_n,
                heads=heads,
                head_dim=128,
                block_size=kvb,
                preshuffle=kvb > 1,
                generator=torch.Generator().manual_seed(100 + i),
            )
            args = p.call_args()
            rows = batch * next_n
            poison_workspace(rows, p.max_model_len)
            stock = installed.original(*args, compress_ratio=1).clone()
            aiter_calls.clear()
            poison_workspace(rows, p.max_model_len)
            out = site(target.rocm_fp8_paged_mqa_logits, args, {"compress_ratio": 1})
            shape = (name, heads, kvb, next_n, batch)
            arms = expected_arms(name, heads, kvb, batch)
            if arms != ["gluon"] and (heads, kvb, next_n) not in tested:
                tested.add((heads, kvb, next_n))
                arms = self_test_arms(name, heads, kvb, next_n) + arms
            assert [a for a, _ in aiter_calls] == arms, shape
            result = compare_in_windows(stock, out, read_window_ends(p.context_lens, rows, next_n), topk=64)
            assert result.nan_free and result.ok(0), (shape, result.describe())
    assert not [r for r in plugin_log if r.levelno >= logging.ERROR]


class SyncAudit(TorchDispatchMode):
    """Every aten op dispatched while active, kernel included."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_gfx950_launch_passes_split_kv_so_nothing_reads_the_device(monkeypatch):
    module = gfx950_module()
    variant = identify(module.flydsl_fp8_paged_mqa_logits, module)
    p = make_paged_problem([500, 64, 3], next_n=2, heads=32, head_dim=128, block_size=64, preshuffle=True)
    args = p.call_args()
    from conftest import Recorder, hooks

    buffer = torch.full((6, p.max_model_len), float("nan"))
    router = FlyDSLRouter(Recorder(), variant, hooks(buffer=buffer), ADAPTER_LOG, self_test=False)
    router.call_from(TARGET_MODULE, *args)  # first call: compile, announce
    audit = SyncAudit()
    with audit:
        router.call_from(TARGET_MODULE, *args)
    assert router.calls_taken == 2
    assert not SYNC_OPS & set(audit.ops), audit.ops
    # The audit sees the host read that an automatic SplitKV would do (the bug the launch avoids).
    automatic = SyncAudit()
    with automatic:
        module.flydsl_fp8_paged_mqa_logits(
            p.q_fp8, p.kv_cache, p.weights, buffer, p.context_lens[:, -1], p.block_tables, p.max_model_len
        )
    assert SYNC_OPS & set(automatic.ops)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("unsupported heads=64"),
        AssertionError("KVBlockSize % 16"),
        TypeError("unexpected keyword ChunkK"),
        NotImplementedError("variant"),
        RuntimeError("JIT compilation failed"),
    ],
)
def test_a_raising_kernel_never_reaches_vllm(
    target, workspace, installed, aiter_calls, plugin_log, error, monkeypatch
):
    raised = []
    flydsl, aiter = "0.5.0", "0.1.9"
    versions = {"flydsl": flydsl, "amd-aiter": aiter}

    def version(dist: str) -> str:
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    # A fresh once-only cache for this test (the real one is restored afterwards).
    from vllm_flydsl_indexer import measure

    monkeypatch.setattr(measure, "stack_versions", functools.cache(measure.stack_versions.__wrapped__))

    def raising(*a, **k):
        raised.append(1)
        raise error

    router = installed.router
    # The live launch's own errors: the self-test (which fails its configuration on any raise, its
    # problem being valid) is tests/test_selftest.py's.
    router.self_test = False
    real_fn = router.variant.fn
    router.variant = dataclasses.replace(router.variant, fn=raising)
    site = call_site_in(importlib.import_module(TARGET_MODULE))
    p = make_paged_problem([150, 9], next_n=2, heads=64, head_dim=128, block_size=64, preshuffle=True)
    args = p.call_args()
    poison_workspace(4, p.max_model_len)
    stock = installed.original(*args).clone()
    for _ in range(2):
        aiter_calls.clear()
        poison_workspace(4, p.max_model_len)
        out = site(target.rocm_fp8_paged_mqa_logits, args, {"compress_ratio": 1})
        assert compare_in_windows(stock, out, read_window_ends(p.context_lens, 4, 2)).ok(0)
        assert [a for a, _ in aiter_calls] == ["gluon"]
    assert raised == [1], "the failed call signature must stay on stock for good"
    errors = [r.getMessage() for r in plugin_log if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "heads=64 head_dim=128 KVBlockSize=64 next_n=2" in errors[0]
    # Any exception, an argument check's too, fails the configuration: every batch of it stays stock.
    assert f"raised {type(error).__name__}: {error} (flydsl {flydsl}, aiter {aiter})." in errors[0]
    other_batch = make_paged_problem(
        [150, 9, 30], next_n=2, heads=64, head_dim=128, block_size=64, preshuffle=True
    )
    poison_workspace(6, other_batch.max_model_len)
    site(target.rocm_fp8_paged_mqa_logits, other_batch.call_args(), {"compress_ratio": 1})
    assert raised == [1]
    versions.clear()
    assert [measure.stack_versions()[k] for k in ("flydsl", "aiter")] == [flydsl, aiter]  # read once
    assert {measure.stack_versions.__wrapped__()[k] for k in ("flydsl", "aiter")} == {"unknown"}
    # Another configuration still runs FlyDSL.
    router.variant = dataclasses.replace(router.variant, fn=real_fn)
    q = make_paged_problem([150, 9], next_n=2, heads=32, head_dim=128, block_size=64, preshuffle=True)
    aiter_calls.clear()
    qargs = (q.q_fp8, q.kv_cache, q.weights, q.context_lens, q.block_tables, None, q.max_model_len)
    site(target.rocm_fp8_paged_mqa_logits, qargs, {"compress_ratio": 1})
    assert [a for a, _ in aiter_calls] == ["flydsl"]


# ---------------------------------------------------------------- gaps a mutation run found


def test_memoised_route_is_keyed_on_compress_ratio():
    from conftest import Recorder, base_problem, hooks, router_for

    p = base_problem()  # next_n 2, per-row bounds
    original = Recorder()
    router = router_for(original, hooks_=hooks())
    args = p.call_args()
    router.call_from(TARGET_MODULE, *args, compress_ratio=1)
    assert router.calls_taken == 1
    assert router.call_from(TARGET_MODULE, *args, compress_ratio=2) is original.marker
    assert router.calls_taken == 1 and len(original.calls) == 1


def test_pool_limit_is_exclusive_at_2_to_the_31_bytes():
    q = torch.empty((2, 1, 32, 64), dtype=torch.float8_e4m3fn)
    w = torch.empty((2, 32), dtype=torch.float32)
    ctx = torch.empty((2, 1), dtype=torch.int32)
    bt = torch.empty((2, 4), dtype=torch.int32)
    per_block = 64 * 128
    at_limit = torch.empty((2**31 // per_block, 64, 1, 128), dtype=torch.uint8, device="meta")
    below = torch.empty((2**31 // per_block - 1, 64, 1, 128), dtype=torch.uint8, device="meta")
    assert at_limit.numel() == 2**31
    general = identify(importlib.import_module(KERNEL_MODULE).flydsl_fp8_paged_mqa_logits)
    assert "2**31 bytes or more" in general.violation(q, at_limit, w, ctx, bt)
    assert general.violation(q, below, w, ctx, bt) is None


@pytest.mark.parametrize(
    "flydsl,dispatcher,name,v32_kvb64",
    [
        ("general", False, "general", "FlyDSL"),
        ("gfx950", False, "gfx950", "stock"),
        ("general", True, "dispatcher", "aiter's dispatcher"),
    ],
)
def test_doctor_names_the_variant_and_the_shapes_it_takes(aiter_as, flydsl, dispatcher, name, v32_kvb64):
    from vllm_flydsl_indexer.tools import doctor

    aiter_as(flydsl=flydsl, dispatcher=dispatcher)
    data = doctor.report({envs.SWITCH: "1"})
    assert data["kernel"]["variant"] == name
    v32 = [s for s in data["kernel"]["shapes"] if s["heads"] == 64 and s["kv_block_size"] == 64]
    assert [s["flydsl"] for s in v32] == [v32_kvb64 != "stock"] * 2
    text = doctor.render(data)
    assert f"kernel:   {name}: " in text
    assert f"DeepSeek-V3.2 64x128              64   1       {v32_kvb64}" in text
