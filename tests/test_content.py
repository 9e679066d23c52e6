# SPDX-License-Identifier: Apache-2.0
"""Start-up: vLLM's target is an audited release's code (its fingerprint), and every name the router uses
is resolved.

The doubles are a release's own target with one edit: the function compiled from a copy of its module's
source with that edit (so the fingerprint reads what runs), over the installed module's globals; or a
helper dropped from the installed module. A target that is no audited release's code stays stock, with one
WARNING that names the vLLM version and the audited releases; there is no opt-in.
"""

from __future__ import annotations

import ast
import json
import logging
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_flydsl_indexer
from test_drift import audited_releases, release_source, target_def
from vllm_flydsl_indexer import envs, gates, patch
from vllm_flydsl_indexer import target as content
from vllm_flydsl_indexer.target import AUDITED, MARKER, TARGET_NAME, fingerprint

STOCK = "vllm-flydsl-indexer: stock paged MQA logits (FlyDSL inactive: "
ACTIVE = "vllm-flydsl-indexer: FlyDSL paged MQA logits ACTIVE"
# An early return in front of Gluon, as a release that adds a route of its own would have (issue 43).
ANCHOR = "    block_size = kv_cache_fp8.shape[1]\n"
EARLY_RETURN = (
    "    if block_size > 1 and q_fp8.shape[0] == 7:\n"
    "        return fp8_paged_mqa_logits_torch(\n"
    "            q_fp8, kv_cache_fp8, weights, context_lens, block_tables, max_model_len\n"
    "        )\n"
)


def not_audited(version: str) -> str:
    """The target gate's reason for code that is no audited release's, on vLLM ``version``."""
    releases = ", ".join(release for release, _ in AUDITED.values())
    return f"vLLM {version}'s {TARGET_NAME}: its code is none of the audited releases' ({releases})"


def edit_def(source: str, *edits: str) -> str:
    """``source`` with each ``old, new`` pair of ``edits`` made once inside the target's ``def``."""
    node = target_def(source)
    lines = source.splitlines(keepends=True)
    start, end = node.lineno - 1, node.end_lineno
    body = "".join(lines[start:end])
    for old, new in zip(edits[::2], edits[1::2], strict=True):
        assert old in body, old
        body = body.replace(old, new, 1)
    return "".join(lines[:start]) + body + "".join(lines[end:])


def compiled(target, text: str, path: Path):
    """The target function of module source ``text``, written to ``path`` and compiled from there over a
    copy of the installed module's globals (its fingerprint reads ``path``)."""
    path.write_text(text)
    namespace = dict(vars(target))
    exec(compile(ast.Module([target_def(text)], []), str(path), "exec"), namespace)  # noqa: S102
    return namespace[TARGET_NAME]


def fingerprint_of_text(text: str, path: Path) -> str:
    path.write_text(text)
    return fingerprint(str(path), target_def(text).lineno)


def edited(target, tmp_path: Path, *edits: str):
    """The installed target with ``edits`` made, compiled from a copy of its module's file."""
    return compiled(target, edit_def(Path(target.__file__).read_text(), *edits), tmp_path / "edited.py")


def register_once(target, monkeypatch, fresh_register, plugin_log, fn) -> str:
    """Register with the switch on over ``fn`` as vLLM's target; assert one line. Returns it; the patch is
    installed or not as the gates said."""
    monkeypatch.setattr(target, TARGET_NAME, fn)
    monkeypatch.setenv(envs.SWITCH, "1")
    fresh_register()
    assert len(plugin_log) == 1, [r.getMessage() for r in plugin_log]
    return plugin_log[0].getMessage()


def register_stock(target, monkeypatch, fresh_register, plugin_log, fn=None) -> str:
    """Register with the switch on; assert vLLM is untouched and one WARNING says why. Returns the why."""
    before = vars(target)[TARGET_NAME] if fn is None else fn
    line = register_once(target, monkeypatch, fresh_register, plugin_log, before)
    assert vars(target)[TARGET_NAME] is before and not getattr(before, MARKER, False)
    assert patch.installed() is None
    assert plugin_log[0].levelno == logging.WARNING
    assert line.startswith(STOCK) and line.endswith(")"), line
    return line[len(STOCK) : -1]


def test_the_installed_target_passes_and_its_hooks_hold_vllms_objects(target):
    gate, module, hooks = gates.check_target()
    release, form = AUDITED[content.fingerprint_of(vars(target)[TARGET_NAME])]
    assert gate == (
        "target",
        True,
        f"{target.__name__}.{TARGET_NAME} is vLLM {release}'s audited code",
    )
    assert module is target and form == ("layout" if release >= "0.34" else "size")
    assert hooks.per_sequence_lens is target._per_sequence_context_lens
    assert hooks.gluon_objection(1, 64) is None  # gfx950, aiter on, its Gluon module found (the double)
    assert hooks.gluon_objection(4, 64).startswith("vLLM's own C4A Triton route")


@pytest.mark.parametrize("version", audited_releases())
def test_an_early_return_planted_in_each_release_keeps_stock(
    target, monkeypatch, tmp_path, fresh_register, plugin_log, version
):
    """Issue 43's hole: one extra branch in front of Gluon. The content audit let it through (every audited
    piece is still there); its fingerprint is no audited release's, so vLLM stays stock, with one WARNING
    naming the version and the audited releases. An opt-in that once let such code through is gone."""
    source, origin = release_source(version)
    assert AUDITED[fingerprint_of_text(source, tmp_path / "release.py")][0] == version, origin
    planted = edit_def(source, ANCHOR, ANCHOR + EARLY_RETURN)
    assert fingerprint_of_text(planted, tmp_path / "check.py") not in AUDITED
    fn = compiled(target, planted, tmp_path / "planted.py")
    installed = gates.vllm_version()
    assert register_stock(target, monkeypatch, fresh_register, plugin_log, fn) == not_audited(installed)
    assert gates.evaluate().reason == not_audited(installed)
    monkeypatch.setattr(vllm_flydsl_indexer, "_registered", False)  # a second start-up, with the old opt-in
    plugin_log.clear()
    monkeypatch.setenv("VLLM_FLYDSL_INDEXER_ALLOW_UNTESTED_VLLM", "1")
    assert register_stock(target, monkeypatch, fresh_register, plugin_log, fn) == not_audited(installed)


def test_a_target_without_readable_source_is_not_audited(target, monkeypatch, fresh_register, plugin_log):
    """No source file (compiled from a string): no fingerprint, stock."""
    text = Path(target.__file__).read_text()
    namespace = dict(vars(target))
    exec(compile(ast.Module([target_def(text)], []), "<vllm built elsewhere>", "exec"), namespace)  # noqa: S102
    fn = namespace[TARGET_NAME]
    reason = register_stock(target, monkeypatch, fresh_register, plugin_log, fn)
    assert reason.startswith(f"vLLM {gates.vllm_version()}'s {TARGET_NAME}: its source is unreadable (")
    assert reason.endswith(")") and gates.check_target()[0][1] is False, reason


# Formatting is not code: the fingerprint holds across it.

REFORMATS = {
    "comments": (
        "    batch_size, next_n = q_fp8.shape[:2]\n",
        "    # FlyDSL: aiter.ops.flydsl.flydsl_fp8_paged_mqa_logits() is faster at some shapes\n"
        "    batch_size, next_n = q_fp8.shape[:2]  # (B, next_n)\n",
        "                ChunkK=256,\n",
        "                ChunkK=256,  # aiter's default\n",
    ),
    # Every audited release has this line (0.32.0 has no log line of the target's own).
    "quotes": ('out_qk.fill_(float("-inf"))', "out_qk.fill_(float('-inf'))"),
    "line breaks": (
        "            (out_logits,) = current_workspace_manager().get_simultaneous(\n"
        "                ((batch_size * next_n, max_model_len), torch.float32),\n"
        "            )\n",
        "            (out_logits,) = current_workspace_manager().get_simultaneous(((batch_size * next_n,\n"
        "                                  max_model_len),\n"
        "                                 torch.float32))\n",
        "    batch_size, next_n = q_fp8.shape[:2]\n",
        "    batch_size, next_n = (q_fp8\n        .shape[:2])\n\n\n",
    ),
    "docstring": (
        '    """Compute FP8 MQA logits using paged KV-cache.',
        '    """flydsl_fp8_paged_mqa_logits(q) would do',
    ),
}


@pytest.mark.parametrize("reformat", REFORMATS)
def test_formatting_keeps_the_fingerprint(target, tmp_path, reformat):
    source = Path(target.__file__).read_text()
    expected = fingerprint_of_text(source, tmp_path / "stock.py")
    assert expected in AUDITED
    text = edit_def(source, *REFORMATS[reformat])
    assert text != source
    assert fingerprint_of_text(text, tmp_path / "reformatted.py") == expected


@pytest.mark.parametrize("version", audited_releases())
def test_a_whole_reformat_of_each_release_keeps_its_fingerprint(tmp_path, version):
    """ast.unparse rewrites every line (quotes, parentheses, line breaks, no comments), and the def moves."""
    source, _ = release_source(version)
    node = target_def(source)
    text = "import torch\n\n# moved down\n\n" + ast.unparse(node).replace("\n", "  # a comment\n", 3)
    assert text.count("\n") != len(ast.get_source_segment(source, node).splitlines())
    assert AUDITED[fingerprint_of_text(text, tmp_path / "unparsed.py")][0] == version


# Code is: any change in the function is another fingerprint (the old audit's cases among them).

CODE_CHANGES = {
    "ChunkK": ("ChunkK=256", "ChunkK=128"),
    "WavePerEU": ("WavePerEU=2", "WavePerEU=1"),
    "an extra knob": ("WavePerEU=2,", "WavePerEU=2, SplitKV=4,"),
    "lengths unreduced": ("_per_sequence_context_lens(context_lens),", "context_lens,"),
    "block size": ("block_size = kv_cache_fp8.shape[1]", "block_size = kv_cache_fp8.shape[-2]"),
    "output rows": (
        "((batch_size * next_n, max_model_len), torch.float32)",
        "((batch_size, max_model_len), torch.float32)",
    ),
    "the result": ("            return out_logits", "            return out_logits * 1"),
    "a Gluon condition": (
        "rocm_aiter_ops.is_enabled() or rocm_aiter_ops.is_rdna_aiter_enabled()",
        "rocm_aiter_ops.is_enabled()",
    ),
    "a string argument": ('out_qk.fill_(float("-inf"))', 'out_qk.fill_(float("+inf"))'),
    "a name that is not called": (
        "    aiter_paged_mqa_logits_module = None\n",
        "    _flydsl = None\n    aiter_paged_mqa_logits_module = None\n",
    ),
    "a FlyDSL call": ("paged_mqa_logits_module()", "flydsl_fp8_paged_mqa_logits()"),
    "an early return": (ANCHOR, ANCHOR + EARLY_RETURN),
}


@pytest.mark.parametrize("change", CODE_CHANGES)
def test_a_code_change_is_another_fingerprint(target, tmp_path, change):
    source = Path(target.__file__).read_text()
    text = edit_def(source, *CODE_CHANGES[change])
    assert fingerprint_of_text(text, tmp_path / "changed.py") not in AUDITED


@pytest.mark.parametrize("call", ["torch.cuda.synchronize()", "flydsl_fp8_paged_mqa_logits(q_fp8)"])
def test_a_leading_call_where_the_docstring_was_is_code(
    target, monkeypatch, tmp_path, fresh_register, plugin_log, call
):
    """Only a docstring (a constant) is left out of the fingerprint: a call statement first in the body,
    in the docstring's place, is code (a sync, a launch), so vLLM stays stock with the WARNING."""
    source = Path(target.__file__).read_text()
    docstring = target_def(source).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
    lines = source.splitlines(keepends=True)
    planted = [" " * docstring.col_offset + call + "\n"]
    text = "".join(lines[: docstring.lineno - 1] + planted + lines[docstring.end_lineno :])
    assert ast.unparse(target_def(text).body[0]) == call
    assert fingerprint_of_text(text, tmp_path / "called.py") not in AUDITED
    fn = compiled(target, text, tmp_path / "planted.py")
    assert register_stock(target, monkeypatch, fresh_register, plugin_log, fn) == not_audited(
        gates.vllm_version()
    )


def test_the_targets_source_is_read_with_the_cap(target, monkeypatch, tmp_path, fresh_register, plugin_log):
    """The release's own code, in a file past the plugin's read cap (a runaway comment after it): the gate
    reads at most the cap plus one byte, finds no fingerprint and keeps stock, naming the size."""
    import os
    import tracemalloc

    comment = "# " + os.urandom(content.MAX_READ_BYTES // 2).hex() + "\n"
    path = tmp_path / "runaway.py"
    fn = compiled(target, Path(target.__file__).read_text() + comment, path)
    assert path.stat().st_size > content.MAX_READ_BYTES
    reason = register_stock(target, monkeypatch, fresh_register, plugin_log, fn)
    assert reason == (
        f"vLLM {gates.vllm_version()}'s {TARGET_NAME}: its source is unreadable (OSError: {path} is larger "
        f"than {content.MAX_READ_BYTES} bytes)"
    )
    # The read itself stops at the cap: a 256 MiB file (sparse) costs no more memory than the cap.
    huge = tmp_path / "huge.py"
    with open(huge, "wb") as f:
        f.write(comment[:4096].encode())
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(OSError, match="is larger than 4096 bytes"):
            content.read_capped(str(huge), 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_target_that_calls_flydsl_is_stock_not_in_tree(
    target, monkeypatch, tmp_path, fresh_register, plugin_log
):
    """The in-tree AST gate is gone: a vLLM whose target calls a FlyDSL function has another fingerprint,
    and the plugin keeps stock with the WARNING (only vllm.envs declaring the switch is vLLM's own route)."""
    fn = edited(target, tmp_path, *CODE_CHANGES["a FlyDSL call"])
    assert register_stock(target, monkeypatch, fresh_register, plugin_log, fn) == not_audited(
        gates.vllm_version()
    )
    decision = gates.evaluate(full=True)
    assert not decision.in_tree and ("in-tree", True, "vLLM does not route it itself") in decision.gates


def test_a_comment_or_docstring_mention_of_flydsl_is_stocks_code(
    target, monkeypatch, tmp_path, fresh_register, plugin_log
):
    """A mention is not code: the fingerprint is the audited one and the plugin installs."""
    fn = edited(target, tmp_path, *REFORMATS["comments"], *REFORMATS["docstring"])
    line = register_once(target, monkeypatch, fresh_register, plugin_log, fn)
    assert line.startswith(ACTIVE) and vars(target)[TARGET_NAME].__wrapped__ is fn, line


# The canonical form leaves out what Python versions add, drop or place differently.


def test_the_canonical_form_ignores_positions_contexts_and_empty_fields():
    """What differs across Python versions: positions, and fields one version lacks where another has them
    empty (3.12 added ``type_params=[]``; 3.13 fills absent optional fields with ``None`` or ``[]``)."""
    code = "def f(a):\n    return a\n"
    plain = content._canonical(ast.parse(code).body[0])
    assert "lineno" not in plain and "col_offset" not in plain and "Load" not in plain
    assert content._canonical(ast.parse("\n\n\ndef f(a):  # moved\n    return (a)\n").body[0]) == plain
    for field, empty in (
        ("returns", None),
        ("type_comment", None),
        ("decorator_list", []),
        ("type_params", []),
    ):
        lacking, emptied = ast.parse(code).body[0], ast.parse(code).body[0]
        lacking._fields = tuple(f for f in lacking._fields if f != field)  # as a version without the field
        emptied._fields = tuple(dict.fromkeys((*emptied._fields, field)))  # as a version that has it empty
        setattr(emptied, field, empty)
        assert content._canonical(lacking) == content._canonical(emptied) == plain, field
    # Constant.kind ("u" for u"...") is not code either; names, values and their types are.
    assert content._canonical(ast.parse('u"x"').body[0]) == content._canonical(ast.parse('"x"').body[0])
    for other in ("def f(a):\n    return b\n", "def f(a):\n    return a, a\n", "def f(a):\n    return 1\n"):
        assert content._canonical(ast.parse(other).body[0]) != plain
    assert content._canonical(ast.parse("1").body[0]) != content._canonical(ast.parse("1.0").body[0])


FINGERPRINT_IN = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("target_alone", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
print(json.dumps([sys.version_info[:2], module.fingerprint(sys.argv[2], int(sys.argv[3]))]))
"""


def other_pythons() -> list[str]:
    """Interpreters of the Python versions vLLM supports (3.10-3.13) other than this one, found here."""
    found = []
    for minor in range(10, 14):
        if minor == sys.version_info.minor:
            continue
        candidates = [
            shutil.which(f"python3.{minor}"),
            *sorted(Path.home().glob(f".pyenv/versions/3.{minor}*/bin/python3")),
        ]
        for candidate in filter(None, candidates):
            probe = subprocess.run(
                [str(candidate), "-c", "import sys; print(sys.version_info[1])"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if probe.returncode == 0 and probe.stdout.strip() == str(minor):
                found.append(str(candidate))
                break
    return found


def test_the_fingerprint_is_the_same_under_other_pythons(target):
    """target.py needs no vLLM to fingerprint: each other Python computes the audited hash of this vLLM."""
    pythons = other_pythons()
    if not pythons:
        pytest.skip("no other Python 3.10-3.13 interpreter found here (python3.X on PATH or ~/.pyenv)")
    fn = vars(target)[TARGET_NAME]
    expected = content.fingerprint_of(fn)
    assert expected in AUDITED
    args = [content.__file__, fn.__code__.co_filename, str(fn.__code__.co_firstlineno)]
    for python in pythons:
        proc = subprocess.run(
            [python, "-c", FINGERPRINT_IN, *args], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        version, found = json.loads(proc.stdout)
        assert found == expected, (python, version)


# Every vLLM name the hooks use is resolved at start-up.


@pytest.mark.parametrize(
    "name",
    [
        "_per_sequence_context_lens",
        "paged_mqa_logits_module",
        "_indexer_k_is_c4a_block_flat",
        "current_workspace_manager",
        "_ON_GFX950",
    ],
)
def test_a_helper_the_hooks_use_gone_stays_stock(target, monkeypatch, fresh_register, plugin_log, name):
    monkeypatch.delattr(target, name)
    what = "flag" if name.startswith("_ON_") else "function"
    assert register_stock(target, monkeypatch, fresh_register, plugin_log) == (
        f"{target.__name__}.{TARGET_NAME}: LookupError: vLLM's {target.__name__} has no {what} {name} "
        "(the router uses it)"
    )


def test_gfx942_is_asked_only_where_vllm_does_not_report_gfx950(target, monkeypatch):
    """The original asks ``_ON_GFX950 or _ON_GFX942``: on gfx950 the hooks need not resolve the latter."""
    monkeypatch.delattr(target, "_ON_GFX942")
    assert content.vllm_stock_hooks(target, "size").gluon_objection(1, 64) is None
    monkeypatch.setattr(target, "_ON_GFX950", False)
    with pytest.raises(LookupError, match="has no flag _ON_GFX942"):
        content.vllm_stock_hooks(target, "size")


def test_vllms_aiter_question_gone_stays_stock(target, monkeypatch, fresh_register, plugin_log):
    from vllm._aiter_ops import rocm_aiter_ops

    monkeypatch.delattr(rocm_aiter_ops, "is_rdna_aiter_enabled")
    assert register_stock(target, monkeypatch, fresh_register, plugin_log).endswith(
        "vLLM's rocm_aiter_ops has no function is_rdna_aiter_enabled (the router uses it)"
    )


def test_the_layout_helper_is_required_only_where_preshuffle_asks_it(target, monkeypatch):
    """0.34.0's Preshuffle reads indexer_k_cache_is_shuffled and _ON_RDNA; 0.32/0.33's reads neither."""
    monkeypatch.setattr(target, "indexer_k_cache_is_shuffled", lambda bs: bs >= 32, raising=False)
    monkeypatch.setattr(target, "_ON_RDNA", False, raising=False)
    assert content.vllm_stock_hooks(target, "layout").preshuffle(16) is False
    assert content.vllm_stock_hooks(target, "layout").preshuffle(32) is True
    monkeypatch.setattr(target, "_ON_RDNA", True)
    assert content.vllm_stock_hooks(target, "layout").preshuffle(32) is False
    monkeypatch.delattr(target, "_ON_RDNA")
    with pytest.raises(LookupError, match="has no flag _ON_RDNA"):
        content.vllm_stock_hooks(target, "layout")
    monkeypatch.delattr(target, "indexer_k_cache_is_shuffled")
    hooks = content.vllm_stock_hooks(target, "size")
    assert hooks.preshuffle(16) is True and hooks.preshuffle(1) is False


def test_the_hooks_read_no_vllm_module_attribute_per_call(target, workspace, monkeypatch):
    """Resolved at install: renaming a helper afterwards does not reach a call."""
    import torch

    hooks = content.vllm_stock_hooks(target, "size")
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


def test_the_largest_decode_batch_is_vllms_max_num_seqs_as_its_workspace_bound_reads_it(target):
    """vLLM sizes the logits workspace for ``max_num_seqs`` decode sequences (``_max_decode_logits_rows``,
    read from the current config at run time): the measurement's sweep stops there; no config, none."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    hooks, seqs = content.vllm_stock_hooks(target, "size"), random.randint(3, 900)
    assert hooks.max_batch() == 0
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=seqs))
    with set_current_vllm_config(config):
        assert hooks.max_batch() == seqs


def test_the_hooks_ask_what_the_original_asks(target, monkeypatch):
    """Each of the original's conditions before Gluon, through the hooks, in its order."""
    from vllm._aiter_ops import rocm_aiter_ops

    monkeypatch.setattr(target, "paged_mqa_logits_module", lambda: None)
    assert content.vllm_stock_hooks(target, "size").gluon_objection(1, 64) == (
        "vLLM finds no aiter Gluon paged-MQA-logits module"
    )
    monkeypatch.setattr(rocm_aiter_ops, "is_enabled", lambda: False)
    monkeypatch.setattr(rocm_aiter_ops, "is_rdna_aiter_enabled", lambda: False)
    assert (
        content.vllm_stock_hooks(target, "size")
        .gluon_objection(1, 64)
        .startswith("VLLM_ROCM_USE_AITER is not 1")
    )
    monkeypatch.setattr(target, "_ON_GFX950", False)
    assert (
        content.vllm_stock_hooks(target, "size")
        .gluon_objection(1, 64)
        .startswith("vLLM does not report gfx950")
    )
    # C4A with a paged cache is vLLM's own Triton route, on gfx942 too; block_size 1 is not C4A's.
    monkeypatch.setattr(target, "_ON_GFX942", True)
    assert content.vllm_stock_hooks(target, "size").gluon_objection(4, 64).startswith("vLLM's own C4A")
    assert content.vllm_stock_hooks(target, "size").gluon_objection(4, 1).startswith("vLLM does not report")


def test_check_does_not_take_a_drifted_vllm_for_stock(target, monkeypatch, tmp_path):
    """``check`` and ``bench`` run vLLM's own function as stock only where the router could install."""
    from vllm_flydsl_indexer.tools import paths

    fn = edited(target, tmp_path, *CODE_CHANGES["lengths unreduced"])
    monkeypatch.setattr(target, TARGET_NAME, fn)
    found, why = paths.vllm_target()
    assert found is None and why == not_audited(gates.vllm_version())
