# SPDX-License-Identifier: Apache-2.0
"""``check`` through real vLLM on the gfx950 simulation, and the routing bugs it must catch.

Each mutation plants one routing bug in a rule's source (the bugs an
independent mutation run planted), and ``check`` must exit non-zero.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types
from pathlib import Path

import pytest

import vllm_flydsl_indexer
from vllm_flydsl_indexer import envs, kernels, measure, router, selftest, tuning
from vllm_flydsl_indexer import target as target_module
from vllm_flydsl_indexer.tools import check, settings
from vllm_flydsl_indexer.tools import cli as cli_mod

SMALL = ["check", "--batch", "4", "--context-len", "320", "--device", "cpu"]
# 23 model and bounds cases, 17 router-behaviour cases for each of 2 APIs, 3 agreement self-tests.
ALL_PASS = "60 passed, 0 failed"


def run_check(capsys, argv=SMALL) -> tuple[int, str]:
    rc = cli_mod.main(list(argv))
    return rc, capsys.readouterr().out


def test_check_runs_vllms_own_function_over_every_bounds_shape(target, workspace, monkeypatch, capsys):
    from vllm_flydsl_indexer.tools import behaviour

    calls = []
    lookups = (target.paged_mqa_logits_module, target.rocm_fp8_paged_mqa_logits_triton)
    original = target.current_workspace_manager
    monkeypatch.setattr(target, "current_workspace_manager", lambda: calls.append(1) or original())
    rc, out = run_check(capsys)
    assert rc == 0, out
    assert "stock:   vLLM's own vllm.v1.attention.ops.rocm_aiter_mla_sparse.rocm_fp8_paged_mqa_logits" in out
    assert calls, "vLLM's own function (and its workspace) was not used"
    cases, behaviours = out.split(f"\n{behaviour.HEADER}\n")
    rows = [line for line in cases.splitlines() if line.endswith(("PASS", "FAIL"))]
    assert len(rows) == 23 and all(r.endswith("PASS") for r in rows)
    arms = {r.split("  ")[0]: r for r in rows}
    # Both arms appear, and the rows the rules send to stock say so.
    assert sum(" FlyDSL    FlyDSL " in r for r in rows) == 14
    for label in (
        "DSV4.1 ratio 2 next_n=2 (same shapes)",
        "DSV4.1 C4A ratio 4 (block-flat)",
        "GLM-5-next kpool next_n=2",
        "GLM-5-next kpool next_n=2 (DSV4.1's shapes)",
        "DCP 2 next_n=2 (simulated)",
        "strided cache (block-outer layout)",
        "first call during graph capture",
        "next_n=2 with (B, 1) bounds",
    ):
        assert " stock     stock " in arms[label], arms[label]
    # The router-behaviour cases, each its own router on the reference contracts.
    assert "on its reference contract (pure torch), even where real kernels exist" in behaviour.HEADER
    behaviour_rows = [line for line in behaviours.splitlines() if line.endswith(("PASS", "FAIL"))]
    labels = [b.label for b in behaviour.BEHAVIOURS]
    ran, api = [], None
    for line in behaviours.splitlines():  # a section per API, its heading naming it
        if line.startswith("as the "):
            api = line.removeprefix("as the ").split(" API")[0]
        elif line.startswith("agreement rule self-test"):
            api = None  # the agreement rule's own cases follow the APIs' sections
        elif line.endswith(("PASS", "FAIL")) and api is not None:
            ran.append((api, line.split("  ")[0]))
    apis = ("general", "gfx950")  # the found API (the general double) first; gfx950-early is refused
    assert ran == [(api, label) for api in apis for label in labels]
    assert all(r.endswith("PASS") for r in behaviour_rows) and "FAIL" not in behaviours
    assert ALL_PASS in out
    # Every line fits 120 columns; the last lines say what passed means and what runs the real kernels.
    assert max(map(len, out.splitlines())) <= 120, [line for line in out.splitlines() if len(line) > 120]
    assert out.splitlines()[-4:-1] == check.meaning(False) and settings.REAL_CHECK in out.splitlines()[-2]
    # The session pointed vLLM's kernel lookups at the references, then restored them.
    assert (target.paged_mqa_logits_module, target.rocm_fp8_paged_mqa_logits_triton) == lookups


# bug -> (the rule source it replaces, the planted replacement, the case that must FAIL); the module
# holding the source is found by :func:`plant` among the router and its rule modules.
MUTATIONS = {
    "raw (B, next_n) table to the kernel": (
        "q, kv, w, out, self.hooks.per_sequence_lens(lens), bt, max_model_len, **route.kwargs",
        "q, kv, w, out, lens, bt, max_model_len, **route.kwargs",
        "GLM-5.x/DSV4.1 KVB=64 preshuffle next_n=2",
    ),
    "next_n > 1 taken with (B, 1) bounds": (
        "if lens.dim() != 2 or lens.shape[1] != next_n:",
        "if False:",
        "next_n=2 with (B, 1) bounds",
    ),
    "no contiguity check": ("if not kv.is_contiguous():", "if False:", "strided cache (block-outer layout)"),
    "no compress-ratio rule": (
        "if compress_ratio != 1:",
        "if False:",
        "DSV4.1 ratio 2 next_n=2 (same shapes)",
    ),
    "no DCP rule": (
        "if (dcp := router.hooks.dcp_world_size()) != 1:",
        "if False:",
        "DCP 2 next_n=2 (simulated)",
    ),
    "no capture rule": (
        "if self.is_capturing() and (route.shape not in self.compiled or untested):",
        "if False:",
        "first call during graph capture",
    ),
    "no caller rule": (
        "reason = multi_row_objection(caller)",
        "reason = None",
        "GLM-5-next kpool next_n=2",
    ),
    "C4A taken (stock's Gluon question ignored)": (
        "reason = router.hooks.gluon_objection(compress_ratio, block_size)",
        "reason = None",
        "DSV4.1 C4A ratio 4 (block-flat)",
    ),
    "variant limits ignored": (
        "reason = variant.violation(q, kv, w, lens, bt)",
        "reason = None",
        "heads=24 (no kernel takes it)",
    ),
    "memo key without compress_ratio": (
        "max_model_len, compress_ratio, caller,",
        "max_model_len, caller,",
        "DSV4.1 ratio 2 next_n=2 (same shapes)",
    ),
    "memo key without the caller": (
        "max_model_len, compress_ratio, caller,",
        "max_model_len, compress_ratio,",
        "GLM-5-next kpool next_n=2 (DSV4.1's shapes)",
    ),
    # Trusting the kpool caller takes both of its audits away (issue 49: MULTI_ROW names its bounds, and
    # CALLER_CODE would hold its code): a MULTI_ROW entry alone made None is still kept stock by the second.
    "kpool caller trusted with next_n > 1": (
        "    why = MULTI_ROW[caller]\n    if why is None and caller_release(caller) is None:",
        '    why = None if "glm5next" in caller else MULTI_ROW[caller]\n'
        '    if why is None and caller_release(caller) is None and "glm5next" not in caller:',
        "GLM-5-next kpool next_n=2 (DSV4.1's shapes)",
    ),
    # The router-behaviour cases (tools/behaviour.py): each builds its own router.
    "tuned table ignored": (
        "table.choice(cus, batch, next_n, heads, head_dim, kv.shape[1]) if table is not None else None",
        "None",
        "tuned table",
    ),
    # issue 49: this node's measurement (tools/behaviour.py's "measured" cases).
    "measured verdict inverted": (
        "return ratio * MARGIN <= 1 + 1e-9",
        "return ratio * MARGIN > 1 + 1e-9",
        "measured: FlyDSL faster than stock",
    ),
    "cached row used at another context": (
        "row = router.node[2].get(at)",
        "row = next((r for k, r in router.node[2].items() if k[:2] == at[:2]), None)",
        "measured: cached rows at their own context only",
    ),
    # Both guards go (the timing past a failed self-test, and the failed shape's return after it): the
    # second alone would still time the failed kernel, the first alone would cache nothing.
    "a kernel that failed its self-test timed and cached": (
        "compress_ratio)) is None:  # a failed kernel: not timed\n"
        "            stock, ratio = figures(router, args, compress_ratio, bucket, route)\n"
        "            router.spent += time.perf_counter() - began\n"
        "        if problem or shape in router.failed:",
        "compress_ratio)) is None or True:\n"
        "            stock, ratio = figures(router, args, compress_ratio, bucket, route)\n"
        "            router.spent += time.perf_counter() - began\n"
        "        if False:",
        "measured: a failed self-test is not cached",
    ),
    "VLLM_FLYDSL_INDEXER_TUNE=0 ignored": (
        "or (not router.tune and",
        "or (False and",
        "measured: VLLM_FLYDSL_INDEXER_TUNE=0",
    ),
    # issue 32: the self-test (issue 37: once per shape, FlyDSL itself; issue 43: it replaces the canary).
    "self-test skipped": (
        "if untested and self._tested(",
        "if False and self._tested(",
        "self-test, FlyDSL wrong",
    ),
    "self-test result ignored": (
        "            if problem is not None:\n                at = ",
        "            if False:\n                at = ",
        "self-test, FlyDSL reverses a sequence's rows",
    ),
    "self-test disagreement ignored": (
        "if problem := disagreement(result, REAL_KERNEL_TOLERANCE):",
        "if (problem := disagreement(result, REAL_KERNEL_TOLERANCE)) and False:",
        "self-test, FlyDSL wrong",
    ),
    "self-test without its NaN poison (an unwritten column unseen)": (
        'actual.fill_(float("nan"))',
        "actual.copy_(expected)",
        "self-test, FlyDSL leaves a column unwritten",
    ),
    "failure disables every shape": (
        "or self.failed.get(shape)",
        "or next(iter(self.failed.values()), None)",
        "self-test, FlyDSL reverses a sequence's rows",
    ),
    "raising shape not remembered as failed": (
        'self.failed[shape] = f"FlyDSL for',
        'reason = f"FlyDSL for',
        "FlyDSL kernel raises",
    ),
    "memoised routes kept after a raise": (
        "self.routes.clear()  # every memoised route of this shape now says stock",
        "pass",
        "FlyDSL kernel raises",
    ),
    # issue 26: every API's contract, the memo key, Preshuffle, the table, the agreement rule.
    "Preshuffle equality ignored": (
        "if layout != (block_size > 1):",
        "if False:",
        "Preshuffle differs from stock's",
    ),
    "memo key without the cache's contiguity": (
        "kv_cache_fp8.shape, kv_cache_fp8.is_contiguous(), context_lens.shape,",
        "kv_cache_fp8.shape, context_lens.shape,",
        "memo: strided cache after contiguous, same shapes",
    ),
    "tuned SplitKV knob ignored by the router": (
        "max_model_len, cu_count(q.device), pick[2] if pick else 0",
        "max_model_len, cu_count(q.device), 0",
        "tuned table",
    ),
    "tuned SplitKV knob ignored by the launch": (
        "wg = wg_per_cu or self.split_kv_workgroups_per_cu",
        "wg = self.split_kv_workgroups_per_cu",
        "tuned table",
    ),
    "a tuned row's backend read inverted": (
        'if len(backends) > 1 or "gluon" in backends:',
        'if len(backends) > 1 or "gluon" not in backends:',
        "built-in table (AMD's MI355X rows)",
    ),
    "another gfx's table rows read": ("elif found[0] == gfx:", "elif True:", "tuned table"),
    "agreement: -inf mask comparison always true": (
        "mask_differs |= ((torch.isneginf(e) != torch.isneginf(a)) & inside).any()",
        "mask_differs |= False",
        "agreement self-test, one -inf column inside a read window",
    ),
    "agreement: NaN check always clean": (
        "found_nan |= ((torch.isnan(e) | torch.isnan(a)) & inside).any()",
        "found_nan |= False",
        "agreement self-test, a NaN inside a read window",
    ),
    "gfx950 contiguous-q limit ignored": (
        "if problem is None and self.gfx950 and not q_fp8.is_contiguous():",
        "if False:",
        "API limits",
    ),
    "gfx950 max next_n ignored": (
        "if self.max_next_n is not None and next_n > self.max_next_n:",
        "if False:",
        "API limits",
    ),
    "gfx950 heads limit ignored": (
        "if self.heads is not None and heads not in self.heads:",
        "if False:",
        "API limits",
    ),
    "gfx950 KVBlockSize limit ignored": (
        "if self.block_sizes is not None and block_size not in self.block_sizes:",
        "if False:",
        "API limits",
    ),
    "i32 pool limit off by one": (
        "if num_blocks * block_size * index_dim >= I32_OFFSET_LIMIT:",
        "if num_blocks * block_size * index_dim > I32_OFFSET_LIMIT:",
        "pool at the i32 offset limit (shapes only)",
    ),
    "unknown caller trusted with next_n > 1": (
        "    if caller not in MULTI_ROW:\n",
        "    caller = caller or TARGET_MODULE\n    if caller not in MULTI_ROW:\n",
        "bounds and callers",
    ),
    "next_n 1 taken with (B, 2) bounds": (
        "if next_n == 1 and lens.dim() == 2 and lens.shape[1] != 1:",
        "if False:",
        "bounds and callers",
    ),
}
RULE_MODULES = (router, target_module, kernels, tuning, selftest, measure)


def plant(monkeypatch, old: str, new: str) -> int:
    """Replace the objects of the one module whose source holds ``old``, wherever this package bound them.

    Every submodule is imported first: one imported later would bind the
    mutated objects for good. The router's rule lists are rebound too.
    """
    for info in pkgutil.walk_packages(vllm_flydsl_indexer.__path__, "vllm_flydsl_indexer."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    holders = [m for m in RULE_MODULES if Path(m.__file__).read_text().count(old) == 1]
    assert len(holders) == 1, f"the mutation matches no single rule module: {old!r}"
    (module,) = holders
    source = Path(module.__file__).read_text()
    mutated = types.ModuleType(module.__name__)
    mutated.__file__ = module.__file__
    exec(compile(source.replace(old, new), module.__file__, "exec"), vars(mutated))  # noqa: S102
    originals = {id(v): k for k, v in vars(module).items() if not k.startswith("__")}

    def swap(value):
        key = originals.get(id(value))
        return vars(mutated)[key] if key is not None and key in vars(mutated) else value

    rebound = 0
    for name, bound in list(sys.modules.items()):
        if not name.startswith("vllm_flydsl_indexer"):
            continue
        for attr, value in list(vars(bound).items()):
            if isinstance(value, types.ModuleType):
                continue
            if isinstance(value, tuple) and value and all(callable(v) for v in value):
                swapped = tuple(swap(v) for v in value)
                if any(a is not b for a, b in zip(swapped, value, strict=True)):
                    monkeypatch.setattr(bound, attr, swapped)
                    rebound += 1
            elif swap(value) is not value:
                monkeypatch.setattr(bound, attr, swap(value))
                rebound += 1
    return rebound


@pytest.mark.mutation
@pytest.mark.parametrize("bug", MUTATIONS)
@pytest.mark.slow_except("raw (B, next_n) table to the kernel")
def test_check_catches_planted_routing_bug(bug, target, workspace, monkeypatch, capsys):

    old, new, failing_case = MUTATIONS[bug]
    assert plant(monkeypatch, old, new) > 0  # planted where check builds and runs its routers
    rc, out = run_check(capsys)
    assert rc != 0, f"check passed with the planted bug {bug!r}:\n{out}"
    assert f"FAIL {failing_case}: " in out, out


@pytest.mark.slow
def test_check_without_gfx950_uses_the_mirror_and_says_why(monkeypatch, capsys, workspace, target):
    monkeypatch.setattr(target, "_ON_GFX950", False)
    rc, out = run_check(capsys)
    assert rc == 0, out
    assert "stock:   this package's stock copy of vLLM's gfx950 branches (vLLM does not report gfx950" in out
    assert ALL_PASS in out


@pytest.mark.slow
def test_check_with_aiter_disabled_uses_the_mirror(monkeypatch, capsys, workspace):
    from vllm._aiter_ops import rocm_aiter_ops

    monkeypatch.setattr(rocm_aiter_ops, "is_enabled", classmethod(lambda cls: False))
    rc, out = run_check(capsys)
    assert rc == 0, out
    assert "VLLM_ROCM_USE_AITER is not 1" in out


@pytest.mark.slow
def test_a_shape_stock_itself_rejects_passes_when_the_patched_call_delegates_alike(
    target, workspace, monkeypatch, capsys
):
    """A real Gluon may reject a head count no model uses: that is vLLM's answer, on both arms."""
    from vllm_flydsl_indexer.tools import paths, reference

    def picky_gluon(q_fp8, *args, **kwargs):
        if q_fp8.shape[2] == 24:
            raise RuntimeError("Gluon: unsupported heads")
        return reference.gluon_contract_reference(q_fp8, *args, **kwargs)

    monkeypatch.setattr(paths, "gluon_contract_reference", picky_gluon)
    rc, out = run_check(capsys)
    assert rc == 0, out
    assert "note heads=24 (no kernel takes it): stock raised RuntimeError" in out


def test_a_patched_call_that_raises_where_stock_does_not_fails(target, workspace, monkeypatch, capsys):
    from vllm_flydsl_indexer import router as adapter_module

    original = adapter_module.FlyDSLRouter.call_from

    def call_from(self, caller, q_fp8, *args, **kwargs):
        if q_fp8.shape[2] == 24:
            raise RuntimeError("router bug")
        return original(self, caller, q_fp8, *args, **kwargs)

    monkeypatch.setattr(adapter_module.FlyDSLRouter, "call_from", call_from)
    rc, out = run_check(capsys)
    assert rc == 1
    assert "FAIL heads=24 (no kernel takes it): the patched call raised RuntimeError: router bug" in out


@pytest.mark.parametrize("flydsl,dispatcher", [("general", False), ("gfx950", False), ("gfx950", True)])
@pytest.mark.slow
def test_check_applies_the_found_variants_contract(
    flydsl, dispatcher, aiter_as, target, workspace, monkeypatch, capsys
):
    """With each kernel variant's double as the FlyDSL arm, check's expected arms follow that variant."""
    from vllm_flydsl_indexer.tools import arms as arms_module
    from vllm_flydsl_indexer.tools import check
    from vllm_flydsl_indexer.tools.reference import gluon_contract_reference

    aiter_as(flydsl=flydsl, dispatcher=dispatcher)
    variant, _ = kernels.find_kernel()
    assert variant is not None and variant.name == ("dispatcher" if dispatcher else flydsl)
    found = arms_module.Arms(
        False, f"doubles ({variant.name})", "", gluon_contract_reference, variant.fn, variant
    )
    monkeypatch.setattr(check, "detect_arms", lambda device, force_reference=False: found)
    rc, out = run_check(capsys)
    assert rc == 0, out
    rows = {line.split("  ")[0]: line for line in out.splitlines() if line.endswith(("PASS", "FAIL"))}
    deepseek = rows["DeepSeek-V3.2 KVB=64 preshuffle next_n=1"]
    plain = rows["GLM-5.x/DSV4.1 KVB=1 plain next_n=1"]
    glm = rows["GLM-5.x/DSV4.1 KVB=64 preshuffle next_n=2"]
    if variant.name == "dispatcher":
        # Its double's table picks FlyDSL only from batch 64; check's CPU batch is 4, so it would launch
        # Gluon with its own knobs: vLLM's original runs instead.
        assert all(" stock     stock " in row for row in (deepseek, plain, glm))
        return
    if variant.name == "gfx950":  # 32 heads, KVB 64 with preshuffle only
        assert " stock     stock " in deepseek and " stock     stock " in plain
    else:
        assert " FlyDSL    FlyDSL " in deepseek and " FlyDSL    FlyDSL " in plain
    assert " FlyDSL    FlyDSL " in glm


@pytest.mark.slow
def test_check_fails_a_flydsl_arm_that_writes_past_the_read_windows(target, workspace, monkeypatch, capsys):
    """FlyDSL writes exactly the read columns (hence no -inf prefill): check holds it to that."""
    from vllm_flydsl_indexer.tools import arms as arms_module
    from vllm_flydsl_indexer.tools import check, reference

    def prefilling(q, kv, w, out, *args, **kwargs):
        out.fill_(float("-inf"))
        return reference.flydsl_contract_reference(q, kv, w, out, *args, **kwargs)

    real_detect = arms_module.detect_arms

    def detect(device, force_reference=False):
        found = real_detect(device, force_reference)
        found.flydsl = prefilling
        return found

    monkeypatch.setattr(check, "detect_arms", detect)
    rc, out = run_check(capsys)
    assert rc == 1
    # The self-test (on, as serving installs the router) catches it at the configuration's first call.
    assert "FAIL GLM-5.x/DSV4.1 KVB=64 preshuffle next_n=1: FlyDSL failed here: " in out
    assert (
        "self-test failed: FlyDSL at its default launch wrote 1280 columns, the consumers read 386"
        in " ".join(out.split())
    )
    # With the self-test off, the case's own comparison catches it.
    monkeypatch.setenv(envs.SELFTEST, "0")
    rc, out = run_check(capsys)
    assert rc == 1
    assert (
        "FAIL GLM-5.x/DSV4.1 KVB=64 preshuffle next_n=1: the arms disagree (written != read columns)" in out
    )


def test_vllm_target_says_why_vllms_own_function_is_not_used(target, monkeypatch):
    from vllm_flydsl_indexer.tools import paths

    assert paths.vllm_target() == (target, "vLLM would run aiter's Gluon kernel here")
    monkeypatch.setattr(target, "paged_mqa_logits_module", lambda: None)
    assert paths.vllm_target() == (None, "vLLM finds no aiter Gluon paged-MQA-logits module")
    monkeypatch.undo()

    def drifted(q_fp8, kv_cache_fp8, weights, context_lens, block_tables, max_model_len):
        raise AssertionError("never called")

    monkeypatch.setattr(target, "rocm_fp8_paged_mqa_logits", drifted)
    found, why = paths.vllm_target()
    # A def that is not at its file's top level has no fingerprint: not audited code, whatever its signature.
    assert (
        found is None
        and "rocm_fp8_paged_mqa_logits: its source is unreadable (LookupError: no def drifted" in why
    )


def test_check_in_a_patched_process_compares_against_the_original(installed, workspace, target):
    """Where the plugin is already installed, stock must be vLLM's original, not the plugin's wrapper."""
    import torch

    from vllm_flydsl_indexer.tools import arms, paths

    assert target.rocm_fp8_paged_mqa_logits is installed.wrapper
    found = paths.build_paths(arms.detect_arms(torch.device("cpu")), torch.device("cpu"), 8, 256)
    assert found.uses_vllm and found.stock is installed.original


@pytest.mark.parametrize(("value", "said"), [("0", "off"), ("garbage", "warning"), (None, "on")])
@pytest.mark.slow
def test_check_says_when_the_self_test_is_off_or_its_variable_did_not_parse(
    target, workspace, monkeypatch, capsys, value, said
):
    """The self-test section is never dropped without a word; a bad value warns as doctor does."""
    if value is None:
        monkeypatch.delenv(envs.SELFTEST, raising=False)
    else:
        monkeypatch.setenv(envs.SELFTEST, value)
    rc, out = run_check(capsys, [*SMALL, "--model", "glm-5", "--block-size", "64", "--next-n", "1"])
    assert rc == 0, out
    text = " ".join(out.split())
    assert check.SELF_TEST_SECTION in out
    off = f"off ({envs.SELFTEST}=0): the patched router ran without it"
    warning = f"warning: {envs.SELFTEST}='garbage' is not one of 1/0/true/false"
    assert (off in text) is (said == "off") and (warning in text) is (said == "warning"), out
    assert (": passed" in out) is (said != "off")
