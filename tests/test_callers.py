# SPDX-License-Identifier: Apache-2.0
"""Caller-aware eligibility through real vLLM 0.33.0 on the gfx950 simulation.

Every call is made from code living in the calling module (its globals are the
module's), exactly as that module's own call site makes it, so the patch sees
the real caller. The workspace is NaN-poisoned first: any column a consumer
reads that nobody wrote shows as NaN.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from conftest import call_site_or_skip
from test_agreement import poison_workspace
from vllm_flydsl_indexer.selftest import read_window_ends
from vllm_flydsl_indexer.target import TARGET_MODULE, multi_row_objection
from vllm_flydsl_indexer.tools.audit import CALL_SITES
from vllm_flydsl_indexer.tools.harness import compare_in_windows
from vllm_flydsl_indexer.tools.paths import call_site_in
from vllm_flydsl_indexer.tools.reference import fp8_paged_mqa_logits_reference, make_paged_problem

GLM5NEXT = "vllm.models.glm5next.amd.sparse_indexer"
DSV41 = "vllm.models.deepseek_v41.amd.ops.sparse_indexer"


def arms(calls):
    return [name for name, _ in calls]


def glm5next_kpool_call(module, q_fp8, kv_cache, weights, seq_lens, block_table, max_pool_len):
    """The decode call of ``sparse_attn_indexer_kpool`` as that module makes it: the name is
    imported at call time, ``max_model_len=max_pool_len``, and no ``compress_ratio``."""
    source = (
        "def decode_logits(q, kv, w, seq_lens, bt, max_pool_len):\n"
        "    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import rocm_fp8_paged_mqa_logits\n"
        "    return rocm_fp8_paged_mqa_logits(q, kv, w, seq_lens, bt, None, max_model_len=max_pool_len)\n"
    )
    namespace: dict = {}
    exec(compile(source, module.__file__, "exec"), vars(module), namespace)
    return namespace["decode_logits"](q_fp8, kv_cache, weights, seq_lens, block_table, max_pool_len)


def kpool_problem(seed: int, kpool: int = 4):
    # Token lengths whose pooled MTP bounds collide, e.g. L=10, kpool=4: [(10-1)//4, 10//4] = [2, 2].
    lens = [10, 4 * 37 + 2, 4 * 20 + 1, 4 * 64 + 3, 0]
    return make_paged_problem(
        lens,
        next_n=2,
        heads=32,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        compress_ratio=kpool,  # the indexer builder floor-divides by tokens_per_state = index_kpool
        max_model_len=1024 // kpool,  # max_pool_len = max_model_len // index_kpool
        generator=torch.Generator().manual_seed(seed),
    )


def test_glm5next_kpool_mtp_stays_stock_and_every_read_column_matches(
    target, workspace, installed, aiter_calls
):
    module = call_site_or_skip(GLM5NEXT)
    p = kpool_problem(3)
    bounds = p.context_lens
    assert bool((bounds[:, 0] == bounds[:, 1]).any()), "the case must have equal pooled neighbours"
    rows = p.batch * p.next_n
    ends = read_window_ends(bounds, rows, p.next_n)

    # The hazard is real: FlyDSL's contract on these bounds leaves read columns unwritten.
    fly = torch.full((rows, p.max_model_len), float("nan"))
    fp8_paged_mqa_logits_reference(
        p.q_fp8,
        p.kv_cache,
        p.weights,
        fly,
        bounds,
        p.block_tables,
        p.max_model_len,
        preshuffle=True,
        contract="flydsl",
    )
    assert not compare_in_windows(fly, fly, ends).nan_free

    poison_workspace(rows, p.max_model_len)
    stock = installed.original(
        p.q_fp8, p.kv_cache, p.weights, bounds, p.block_tables, None, max_model_len=p.max_model_len
    ).clone()
    aiter_calls.clear()
    poison_workspace(rows, p.max_model_len)
    out = glm5next_kpool_call(module, p.q_fp8, p.kv_cache, p.weights, bounds, p.block_tables, p.max_model_len)
    assert arms(aiter_calls) == ["gluon"], "GLM-5-next kpool MTP must stay on the stock path"
    result = compare_in_windows(stock, out, ends, topk=64)
    assert result.nan_free and result.ok(0), result.describe()


@pytest.mark.parametrize("caller", [TARGET_MODULE, DSV41])
@pytest.mark.parametrize("heads", [64, 32])
def test_audited_native_mtp_is_taken(target, workspace, installed, aiter_calls, caller, heads):
    """DeepSeek-V3.2 (64 heads) and GLM-5.x/V4.1 (32) native MTP with compress_ratio 1: FlyDSL."""
    p = make_paged_problem(
        [300, 2, 0, 129],
        next_n=2,
        heads=heads,
        head_dim=128,
        block_size=64,
        preshuffle=True,
        generator=torch.Generator().manual_seed(heads),
    )
    args = p.call_args()
    rows = p.batch * 2
    poison_workspace(rows, p.max_model_len)
    stock = installed.original(*args, compress_ratio=1).clone()
    aiter_calls.clear()
    poison_workspace(rows, p.max_model_len)
    out = call_site_in(call_site_or_skip(caller))(
        target.rocm_fp8_paged_mqa_logits, args, {"compress_ratio": 1}
    )
    assert arms(aiter_calls) == ["gluon", "flydsl", "flydsl"]  # the configuration's self-test, then the call
    result = compare_in_windows(stock, out, read_window_ends(p.context_lens, rows, 2), topk=64)
    assert result.nan_free and result.ok(0), result.describe()


@pytest.mark.parametrize("caller", ["vllm.model_executor.layers.some_future_indexer", "__main__"])
def test_unknown_caller_gets_next_n_1_only_and_says_why_once(
    target, workspace, installed, aiter_calls, plugin_log, caller, monkeypatch
):
    import types

    module = types.ModuleType(caller)
    p2 = make_paged_problem([200, 70], next_n=2, heads=32, head_dim=128, block_size=64, preshuffle=True)
    p1 = make_paged_problem(
        [200, 70], next_n=1, heads=32, head_dim=128, block_size=64, preshuffle=True, per_row_bounds=False
    )
    site = call_site_in(module)
    # next_n 1: the configuration's self-test (stock, FlyDSL), then both calls on FlyDSL.
    for p, expected in ((p2, ["gluon", "gluon"]), (p1, ["gluon", "flydsl", "flydsl", "flydsl"])):
        aiter_calls.clear()
        for _ in range(2):
            poison_workspace(p.batch * p.next_n, p.max_model_len)
            args = p.call_args()
            site(target.rocm_fp8_paged_mqa_logits, args, {})
        assert arms(aiter_calls) == expected
    lines = [r.getMessage() for r in plugin_log if "stock path for this call" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"caller this package has not audited ({caller})" in lines[0]
    assert [r.levelno for r in plugin_log if "stock path for this call" in r.getMessage()] == [logging.INFO]


def test_first_taken_line_names_configuration_and_caller(
    target, workspace, installed, aiter_calls, plugin_log
):
    p = make_paged_problem([90, 33], next_n=2, heads=64, head_dim=128, block_size=64, preshuffle=True)
    args = p.call_args()
    site = call_site_in(importlib.import_module(TARGET_MODULE))
    for _ in range(3):
        site(target.rocm_fp8_paged_mqa_logits, args, {"compress_ratio": 1})
    taken = [r.getMessage() for r in plugin_log if "FlyDSL taken for" in r.getMessage()]
    assert taken == [
        "vllm-flydsl-indexer: FlyDSL taken for heads=64 head_dim=128 KVBlockSize=64 next_n=2 "
        f"(caller {TARGET_MODULE}; aiter.ops.flydsl.flydsl_fp8_paged_mqa_logits; "
        "no table: FlyDSL wherever eligible; self-test passed)"
    ]


def test_audit_table_names_every_caller_and_refuses_multi_row_from_glm5next():
    assert set(CALL_SITES) == {TARGET_MODULE, DSV41, GLM5NEXT}
    assert multi_row_objection(TARGET_MODULE) is None
    try:
        importlib.import_module(DSV41)
    except ModuleNotFoundError:  # 0.32.0 has no DeepSeek-V4.1 module: a caller that is not there is unaudited
        assert "none of the audited releases' code" in multi_row_objection(DSV41)
    else:
        assert multi_row_objection(DSV41) is None
    assert "pool-granular" in multi_row_objection(GLM5NEXT)
    assert "not audited (unknown)" in multi_row_objection(None)


# Issue 49 item 9: the callers' own code is held to the audit, as the target's is.

CALLER = "rocm_aiter_sparse_attn_indexer"
# The audited call passes vLLM's native table; the plant passes it compressed (as a ratio-4 layer's would be).
NATIVE_BOUNDS = "            decode_metadata.seq_lens,\n            decode_metadata.block_table,\n"
COMPRESSED_BOUNDS = "            decode_metadata.seq_lens // 4,\n            decode_metadata.block_table,\n"
UNAUDITED = (
    f"next_n > 1 from {TARGET_MODULE}: its bounds are unaudited: its {CALLER} is none of the audited "
    "releases' code"
)


def planted_caller(target, tmp_path, how: str):
    """The defining module's indexer op, changed ``how``: compiled, decorator and all, from a copy of the
    module's source over a copy of its globals, so its code says where it came from (or nothing)."""
    import ast
    from pathlib import Path

    source = Path(target.__file__).read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == CALLER)
    lines = source.splitlines(keepends=True)
    start, end = node.decorator_list[0].lineno - 1, node.end_lineno
    body = "".join(lines[start:end])
    assert body.count(NATIVE_BOUNDS) == 1
    if how == "compressed bounds":
        body = body.replace(NATIVE_BOUNDS, COMPRESSED_BOUNDS)
    text = "".join(lines[:start]) + body + "".join(lines[end:])
    path = tmp_path / "rocm_aiter_mla_sparse.py"
    path.write_text(text)
    filename = str(path) if how == "compressed bounds" else "<vllm built elsewhere>"  # no source to read
    namespace = dict(vars(target))
    tree = ast.parse(text)
    (planted,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == CALLER]
    exec(compile(ast.Module([planted], []), filename, "exec"), namespace)  # noqa: S102
    return namespace[CALLER]


def mtp_problem(next_n: int):
    """A fresh random problem, native bounds, 32 heads, KVBlockSize 64."""
    import random

    gen = torch.Generator().manual_seed(random.randrange(2**32))
    lens = torch.randint(next_n, 400, (3,), generator=gen).tolist() + [0]
    return make_paged_problem(
        lens, next_n=next_n, heads=32, head_dim=128, block_size=64, preshuffle=True, generator=gen
    )


def call_from_indexer_module(target, installed, p) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock's answer and the patched call's from code in the defining module, each on a poisoned
    workspace; they agree on every column read."""
    rows, args = p.batch * p.next_n, p.call_args()
    poison_workspace(rows, p.max_model_len)
    stock = installed.original(*args, compress_ratio=1).clone()
    poison_workspace(rows, p.max_model_len)
    site = call_site_in(importlib.import_module(TARGET_MODULE))
    out = site(target.rocm_fp8_paged_mqa_logits, args, {"compress_ratio": 1}).clone()
    ends = read_window_ends(p.context_lens, rows, p.next_n)
    result = compare_in_windows(stock, out, ends, topk=64)
    assert result.nan_free and result.ok(0), result.describe()
    return stock, out


@pytest.mark.parametrize("how", ["compressed bounds", "no readable source"])
def test_a_changed_indexer_keeps_next_n_above_1_stock_from_its_module(
    target, workspace, aiter_calls, plugin_log, monkeypatch, tmp_path, fresh_register, how
):
    """The defining module's indexer op edited to pass compressed (B, next_n) bounds keeps the target's
    fingerprint, so the plugin installs; its own fingerprint is no audited release's (or its source cannot
    be read: never raises), so next_n > 1 from its module stays stock with one reason, which the target gate
    states at install, while next_n == 1 from it is still taken."""
    from vllm_flydsl_indexer import envs, gates, patch
    from vllm_flydsl_indexer.target import caller_release

    monkeypatch.setattr(target, CALLER, planted_caller(target, tmp_path, how))
    assert caller_release(TARGET_MODULE) is None and multi_row_objection(TARGET_MODULE) == UNAUDITED
    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    installed = patch.installed()
    assert installed is not None, [r.getMessage() for r in plugin_log]
    detail = dict((g[0], g[2]) for g in gates.evaluate().gates)["target"]
    assert detail.endswith(f"is vLLM {gates.vllm_version()}'s audited code; {UNAUDITED}"), detail
    for _ in range(2):
        aiter_calls.clear()
        call_from_indexer_module(target, installed, mtp_problem(2))
        assert arms(aiter_calls) == ["gluon", "gluon"]  # stock's answer, and the call's: stock
    reasons = [r.getMessage() for r in plugin_log if "stock path for this call" in r.getMessage()]
    assert len(reasons) == 1 and UNAUDITED in reasons[0], reasons
    aiter_calls.clear()
    call_from_indexer_module(target, installed, mtp_problem(1))
    assert arms(aiter_calls) == ["gluon", "gluon", "flydsl", "flydsl"]  # stock; self-test, then the call


def test_the_audited_indexer_is_still_taken_at_next_n_above_1(
    target, workspace, aiter_calls, plugin_log, installed
):
    """The same call from the unedited module: its code is this release's, FlyDSL takes next_n 2."""
    from vllm_flydsl_indexer import gates
    from vllm_flydsl_indexer.target import CALLER_CODE, caller_release

    assert caller_release(TARGET_MODULE) == gates.vllm_version().split("+")[0]
    assert caller_release(TARGET_MODULE) in CALLER_CODE[TARGET_MODULE][1].values()
    assert multi_row_objection(TARGET_MODULE) is None
    detail = dict((g[0], g[2]) for g in gates.evaluate().gates)["target"]
    assert detail.endswith("audited code"), detail
    for _ in range(2):
        aiter_calls.clear()
        call_from_indexer_module(target, installed, mtp_problem(2))
        assert "flydsl" in arms(aiter_calls) and arms(aiter_calls)[-1] == "flydsl", arms(aiter_calls)
    assert installed.router.calls_taken == 2


@pytest.mark.parametrize("how", ["compressed bounds", "unedited"])
def test_check_requires_what_the_plugin_does_with_vllms_own_indexer(
    target, workspace, monkeypatch, tmp_path, how
):
    """check, on vLLM's own function and call sites: where the indexer op is not an audited release's code,
    its next_n 2 case requires stock (and gets stock's answer), not FlyDSL; next_n 1 still requires FlyDSL.
    The unedited op's next_n 2 case requires FlyDSL. A call site this vLLM lacks is a stand-in of the
    audited one (its code counts as theirs), as every call site of the mirror is."""
    import random

    from vllm_flydsl_indexer.tools import arms, check
    from vllm_flydsl_indexer.tools.cases import Case, build_problem
    from vllm_flydsl_indexer.tools.paths import build_paths

    if how != "unedited":
        monkeypatch.setattr(target, CALLER, planted_caller(target, tmp_path, how))
    cpu = torch.device("cpu")
    found = arms.detect_arms(cpu)
    paths = build_paths(found, cpu, 16, 512)
    assert paths.uses_vllm and not paths.stand_in(TARGET_MODULE) and paths.stand_in("vllm.not_a_call_site")
    gen = torch.Generator().manual_seed(random.randrange(2**32))
    with paths.session():
        for next_n in (2, 1):
            wanted = "stock" if next_n > 1 and how != "unedited" else "FlyDSL"
            case = Case(32, 128, 64, next_n, 3, 512, label=f"next_n={next_n}")
            result = check.run_case(case, build_problem(case, gen, cpu), paths, found, 64, paths.router)
            assert (result.expected, result.arm, result.ok, result.nan_free) == (wanted, wanted, True, True)
