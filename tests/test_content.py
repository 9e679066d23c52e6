# SPDX-License-Identifier: Apache-2.0
"""Start-up: vLLM's target is held to its audited content, and every name the router uses is resolved.

The doubles are vLLM's own target with one edit: its function recompiled from its module's source
with one change (in a copy of the file, so the check reads what runs), or a helper dropped from the
module. Each stays stock at start-up, with one WARNING naming what differed.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
from pathlib import Path

import pytest

from vllm_flydsl_indexer import envs, gates, patch
from vllm_flydsl_indexer import target as content
from vllm_flydsl_indexer.target import MARKER, TARGET_NAME

STOCK = "vllm-flydsl-indexer: stock paged MQA logits (FlyDSL inactive: "
WHERE = f"vLLM's {TARGET_NAME} "


def edited(target, tmp_path: Path, *edits: str) -> tuple[Path, object]:
    """A copy of ``target``'s source with each ``old, new`` pair of ``edits`` made once inside the target
    function, and the function compiled from that copy over a copy of the module's globals."""
    source = Path(target.__file__).read_text()
    node = content.function_node(source)
    assert node is not None
    lines = source.splitlines(keepends=True)
    start, end = node.lineno - 1, node.end_lineno
    body = "".join(lines[start:end])
    for old, new in zip(edits[::2], edits[1::2], strict=True):
        assert old in body, old
        body = body.replace(old, new, 1)
    text = "".join(lines[:start]) + body + "".join(lines[end:])
    path = tmp_path / "rocm_aiter_mla_sparse.py"
    path.write_text(text)
    tree = ast.parse(text)
    fn_node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == TARGET_NAME)
    namespace = dict(vars(target))
    exec(compile(ast.Module([fn_node], []), str(path), "exec"), namespace)  # noqa: S102
    return path, namespace[TARGET_NAME]


def register_stock(target, monkeypatch, fresh_register, plugin_log) -> str:
    """Register with the switch on; assert vLLM is untouched and one WARNING says why. Returns the why."""
    before = vars(target)[TARGET_NAME]
    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    assert vars(target)[TARGET_NAME] is before and not getattr(before, MARKER, False)
    assert patch.installed() is None
    assert len(plugin_log) == 1 and plugin_log[0].levelno == logging.WARNING
    line = plugin_log[0].getMessage()
    assert line.startswith(STOCK) and line.endswith(")"), line
    return line[len(STOCK) : -1]


def test_the_installed_target_passes_and_its_hooks_hold_vllms_objects(target):
    from vllm_flydsl_indexer.target import vllm_stock_hooks

    assert content.audit(target.rocm_fp8_paged_mqa_logits) in {
        a.preshuffle for a in content.RELEASES.values()
    }
    hooks = vllm_stock_hooks(target)
    assert hooks.per_sequence_lens is target._per_sequence_context_lens
    question = hooks.gluon_objection
    assert question.gluon_module is target.paged_mqa_logits_module
    assert question.c4a_block_flat is target._indexer_k_is_c4a_block_flat
    assert question.on_gfx950 is True and question.on_gfx942 is False


def test_context_lens_passed_unreduced_stays_stock(target, monkeypatch, tmp_path, fresh_register, plugin_log):
    """A vLLM (its main branch, at one point) that hands Gluon (B, next_n) bounds: the router would not."""
    _, fn = edited(target, tmp_path, "_per_sequence_context_lens(context_lens),", "context_lens,")
    monkeypatch.setattr(target, TARGET_NAME, fn)
    assert register_stock(target, monkeypatch, fresh_register, plugin_log) == (
        f"{WHERE}passes context_lens unreduced to Gluon; audited: _per_sequence_context_lens(context_lens)"
    )


def test_a_development_build_the_version_gate_lets_through_is_held_to_the_content(
    target, monkeypatch, tmp_path, fresh_register, plugin_log
):
    """A 0.34.x dev build passes the version gate; a snapshot like vLLM's main branch (lengths passed
    unreduced, no _per_sequence_context_lens) is still kept stock, by what its function does."""
    monkeypatch.setattr(gates, "vllm_version", lambda: "0.34.1.dev12+g002ef941")
    assert gates.check_version(gates.vllm_version(), False).ok
    _, fn = edited(target, tmp_path, "_per_sequence_context_lens(context_lens),", "context_lens,")
    monkeypatch.setattr(target, TARGET_NAME, fn)
    monkeypatch.delattr(target, "_per_sequence_context_lens")
    assert register_stock(target, monkeypatch, fresh_register, plugin_log) == (
        f"{WHERE}passes context_lens unreduced to Gluon; audited: _per_sequence_context_lens(context_lens)"
    )


AUDITED_PRESHUFFLE = " or ".join(
    f"{form} (vLLM {releases})"
    for form, releases in (
        (content.PRESHUFFLE_BY_SIZE, "0.32, 0.33"),
        (content.PRESHUFFLE_BY_LAYOUT, "0.34"),
    )
)


@pytest.mark.parametrize(
    "old,new,why",
    [
        ("ChunkK=256", "ChunkK=128", "passes ChunkK=128 to Gluon; audited: ChunkK=256"),
        ("WavePerEU=2", "WavePerEU=1", "passes WavePerEU=1 to Gluon; audited: WavePerEU=2"),
        ("WavePerEU=2,", "WavePerEU=2, SplitKV=4,", "passes SplitKV=4 to Gluon; audited: no SplitKV"),
        ("Preshuffle=", "Preshuffle=True or ", "passes Preshuffle=True or "),
        (
            "if _ON_GFX942 or _ON_GFX950",
            "if _ON_GFX942",
            "reaches Gluon under _ON_GFX942",
        ),
        (
            "(_ON_GFX950 or _ON_GFX942)\n        and _indexer_k_is_c4a_block_flat",
            "_ON_GFX942\n        and _indexer_k_is_c4a_block_flat",
            "guards its C4A route with if _ON_GFX942 and _indexer_k_is_c4a_block_flat(compress_ratio) and "
            f"(block_size > 1); audited: if {content.C4A_GUARD}: return",
        ),
        (
            "rocm_aiter_ops.is_enabled() or rocm_aiter_ops.is_rdna_aiter_enabled()",
            "rocm_aiter_ops.is_enabled()",
            f"looks aiter's Gluon module up under rocm_aiter_ops.is_enabled(); audited: "
            f"{content.AITER_LOOKUP} if {content.AITER_ON}",
        ),
        (
            "block_size = kv_cache_fp8.shape[1]",
            "block_size = kv_cache_fp8.shape[-2]",
            "reads block_size as kv_cache_fp8.shape[-2]; audited: kv_cache_fp8.shape[1]",
        ),
        (
            "((batch_size * next_n, max_model_len), torch.float32)",
            "((batch_size, max_model_len), torch.float32)",
            "takes Gluon's output from current_workspace_manager().get_simultaneous(((batch_size, "
            f"max_model_len), torch.float32)); audited: {content.OUTPUT}",
        ),
        ("            return out_logits", "            return out_logits * 1", "audited: return out_logits"),
        ("                weights,\n                out_logits", "                out_logits", "positional"),
    ],
)
def test_a_gluon_call_or_branch_unlike_the_audit_stays_stock(
    target, monkeypatch, tmp_path, fresh_register, plugin_log, old, new, why
):
    _, fn = edited(target, tmp_path, old, new)
    monkeypatch.setattr(target, TARGET_NAME, fn)
    reason = register_stock(target, monkeypatch, fresh_register, plugin_log)
    assert reason.startswith(WHERE) and why in reason, reason
    if why.startswith("passes Preshuffle"):
        assert reason.endswith(f"; audited: {AUDITED_PRESHUFFLE}"), reason
    if why.startswith("reaches Gluon"):
        assert content.RELEASES[(0, 32)].gluon_branch in reason and "(vLLM 0.34)" in reason


@pytest.mark.parametrize(
    "name",
    [
        "_per_sequence_context_lens",
        "paged_mqa_logits_module",
        "_indexer_k_is_c4a_block_flat",
        "current_workspace_manager",
        "_ON_GFX950",
        "_ON_GFX942",
    ],
)
def test_a_helper_the_hooks_use_gone_stays_stock(target, monkeypatch, fresh_register, plugin_log, name):
    monkeypatch.delattr(target, name)
    what = "flag" if name.startswith("_ON_") else "function"
    assert register_stock(target, monkeypatch, fresh_register, plugin_log) == (
        f"vLLM's {target.__name__} has no {what} {name} (the router's stock side uses it)"
    )


def test_vllms_aiter_question_gone_stays_stock(target, monkeypatch, fresh_register, plugin_log):
    from vllm._aiter_ops import rocm_aiter_ops

    monkeypatch.delattr(rocm_aiter_ops, "is_rdna_aiter_enabled")
    assert register_stock(target, monkeypatch, fresh_register, plugin_log) == (
        "vLLM's rocm_aiter_ops has no function is_rdna_aiter_enabled (the router's stock side uses it)"
    )


def test_the_layout_helper_is_required_only_where_preshuffle_asks_it(target, monkeypatch, tmp_path):
    """0.34.0's Preshuffle reads indexer_k_cache_is_shuffled and _ON_RDNA; 0.32/0.33's reads neither."""
    from vllm_flydsl_indexer.target import vllm_stock_hooks

    source = Path(target.__file__).read_text()
    by_layout = content.PRESHUFFLE_BY_LAYOUT.replace("(not _ON_RDNA)", "not _ON_RDNA")
    old = "Preshuffle=" + (by_layout if by_layout in source else content.PRESHUFFLE_BY_SIZE)
    for form in (content.PRESHUFFLE_BY_SIZE, by_layout):
        _, fn = edited(target, tmp_path, old, f"Preshuffle={form}")
        monkeypatch.setattr(target, TARGET_NAME, fn)
        monkeypatch.setattr(target, "indexer_k_cache_is_shuffled", lambda bs: bs >= 32, raising=False)
        monkeypatch.setattr(target, "_ON_RDNA", False, raising=False)
        assert vllm_stock_hooks(target).preshuffle(16) is (form != by_layout)
        monkeypatch.delattr(target, "_ON_RDNA")
        if form == by_layout:
            with pytest.raises(content.ContentDrift, match="has no flag _ON_RDNA"):
                vllm_stock_hooks(target)
        else:
            assert vllm_stock_hooks(target).preshuffle(16) is True
        monkeypatch.undo()


def test_the_hooks_read_no_vllm_module_attribute_per_call(target, workspace, monkeypatch):
    """Resolved at install: renaming a helper afterwards does not reach a call."""
    import torch

    from vllm_flydsl_indexer.target import vllm_stock_hooks

    hooks = vllm_stock_hooks(target)
    for name in (
        "_per_sequence_context_lens",
        "paged_mqa_logits_module",
        "_indexer_k_is_c4a_block_flat",
        "current_workspace_manager",
    ):
        monkeypatch.delattr(target, name)
    assert hooks.gluon_objection(1, 64) is None
    assert hooks.gluon_objection(4, 64).startswith("vLLM's own C4A Triton route")
    assert hooks.per_sequence_lens(torch.tensor([[3, 4], [5, 6]])).tolist() == [4, 6]
    assert hooks.output_buffer(2, 8).shape == (2, 8)
    assert hooks.preshuffle(64) is True and hooks.dcp_world_size() == 1


def test_check_does_not_take_a_drifted_vllm_for_stock(target, monkeypatch, tmp_path):
    """``check`` and ``bench`` run vLLM's own function as stock only where the router could install."""
    from vllm_flydsl_indexer.tools import paths

    _, fn = edited(target, tmp_path, "_per_sequence_context_lens(context_lens),", "context_lens,")
    monkeypatch.setattr(target, TARGET_NAME, fn)
    found, why = paths.vllm_target()
    assert found is None and why.startswith(f"{WHERE}passes context_lens unreduced to Gluon")


# The in-tree gate reads code: a call of a FlyDSL function, not a mention.


def in_tree_with(target, monkeypatch, tmp_path, *edits: str) -> str | None:
    """The in-tree gate's answer where the target module's file is ``target``'s with ``edits``."""
    path, _ = edited(target, tmp_path, *edits)
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == target.__name__:
            return importlib.util.spec_from_file_location(name, path)
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return gates.in_tree_route()


MENTIONS = {
    "comment": "    # FlyDSL: aiter.ops.flydsl.flydsl_fp8_paged_mqa_logits() is faster at some shapes\n",
    "docstring": '    """flydsl_fp8_paged_mqa_logits(q) would do; not called here."""\n',
    "string argument": '    logger.debug("flydsl_fp8_paged_mqa_logits() not used")\n',
    "a name that is not called": "    _flydsl = None\n",
}


@pytest.mark.parametrize("mention", MENTIONS)
def test_a_mention_of_flydsl_is_not_an_in_tree_route(
    target, original_target, monkeypatch, tmp_path, fresh_register, plugin_log, mention
):
    anchor = "    aiter_paged_mqa_logits_module = None\n"
    assert in_tree_with(target, monkeypatch, tmp_path, anchor, MENTIONS[mention] + anchor) is None
    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    assert vars(target)[TARGET_NAME].__wrapped__ is original_target
    assert "FlyDSL paged MQA logits ACTIVE" in plugin_log[0].getMessage()


IMPORT = "    from vllm._aiter_ops import rocm_aiter_ops\n"


@pytest.mark.parametrize(
    "edits",
    [
        ("paged_mqa_logits_module()", "flydsl_fp8_paged_mqa_logits()"),
        ("paged_mqa_logits_module()", "aiter.ops.flydsl.run()"),
        # Imported from a FlyDSL module under another name.
        (
            IMPORT,
            IMPORT + "    from aiter.ops.flydsl import flydsl_fp8_paged_mqa_logits as fast\n",
            "paged_mqa_logits_module()",
            "fast()",
        ),
    ],
)
def test_a_call_of_a_flydsl_function_is_an_in_tree_route(target, monkeypatch, tmp_path, edits):
    assert in_tree_with(target, monkeypatch, tmp_path, *edits) == (
        f"{target.__name__}.{TARGET_NAME} already calls aiter's FlyDSL kernel"
    )


@pytest.fixture
def original_target(target):
    fn = vars(target)[TARGET_NAME]
    assert not getattr(fn, MARKER, False)
    return fn
