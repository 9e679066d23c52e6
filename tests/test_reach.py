# SPDX-License-Identifier: Apache-2.0
"""``doctor --model``: the per-model verdicts, their pinned table against vLLM, and the README's table."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import simulation_env
from test_cli import cli
from test_drift import function, module_source, vllm_root
from vllm_flydsl_indexer import envs
from vllm_flydsl_indexer.kernels import BLOCK_OUTER_NOTE
from vllm_flydsl_indexer.target import TARGET_MODULE
from vllm_flydsl_indexer.tools import reach
from vllm_flydsl_indexer.tools.audit import CALL_SITES
from vllm_flydsl_indexer.tools.reach import FP8_SETTING, MXFP4_DEFAULT_FUNCTION, mxfp4_reason

ROOT = Path(__file__).resolve().parents[1]
VLLM = importlib.metadata.version("vllm")
ACTIVE = SimpleNamespace(active=True, reason="all gates passed", variant=None)
OFF = SimpleNamespace(active=False, reason="the switch is off", variant=None)
# Which models stay stock, and the words their first reason starts with (vLLM 0.33.0 and 0.34.0).
FIRST_REASON = {
    "deepseek_v32": None,
    "glm_moe_dsa": None,
    "deepseek_v4": "deepseek_v4 runs aiter's MXFP4 indexer",
    "deepseek_v41": "vLLM resolves the block-outer KV cache layout",
    "glm5_next": "vLLM resolves the block-outer KV cache layout",
}


V41_OPS = "vllm.models.deepseek_v41.amd.ops.sparse_indexer"


def source(relative: str) -> str:
    path = vllm_root() / relative
    if not path.is_file():
        pytest.skip(f"vLLM {VLLM} has no {relative}")
    return path.read_text()


# ------------------------------------------------------------------ verdicts


@pytest.mark.parametrize("model_type", list(reach.MODELS))
def test_each_model_type_gets_its_verdict_and_first_reason(model_type):
    if VLLM.startswith("0.32."):
        pytest.skip("0.32.0 has no MXFP4 default and no DeepSeek-V4.1 call site: other first reasons")
    data = reach.assess(model_type, None, ACTIVE)
    expected = FIRST_REASON[model_type]
    assert data["reaches_flydsl"] is (expected is None) is data["allows_flydsl"]
    if expected is None:
        assert data["reason"] is None and data["layer_contiguous"]
    else:
        assert data["reason"].startswith(expected), data["reason"]


def test_deepseek_v4_names_the_fp8_setting_then_the_c4a_route_then_the_strided_cache():
    if VLLM.startswith("0.32."):
        pytest.skip("0.32.0 has no MXFP4 default")
    data = reach.assess("deepseek_v4", None, ACTIVE)
    assert data["indexer_path"].startswith("MXFP4")
    assert """--attention-config '{"indexer_kv_dtype": "fp8"}'""" in data["reason"]
    c4a, strided = data["reasons"][1:]
    assert c4a == (
        "stock does not use aiter's Gluon kernel here: "
        "vLLM's own C4A Triton route (compress_ratio=4, block_size=64)"
    )
    assert "so this layer stays on the stock path" in strided and strided.endswith(BLOCK_OUTER_NOTE)


def test_a_model_flydsl_can_take_still_reports_the_machine_gate():
    data = reach.assess("deepseek_v32", None, OFF)
    assert data["allows_flydsl"] and not data["reaches_flydsl"]
    assert data["reason"] == "this machine: the switch is off"


def test_shapes_come_from_config_json_and_the_found_variant_decides():
    refuses_64 = SimpleNamespace(
        active=True,
        reason="all gates passed",
        variant=SimpleNamespace(
            name="gfx950",
            index_dim=None,
            shape_violation=lambda h, d, b, i, n: None if h == 32 else f"heads={h}",
        ),
    )
    data = reach.assess("deepseek_v32", {"index_n_heads": 64, "index_head_dim": 128}, refuses_64)
    assert data["shape_source"] == "config.json" and data["contract"] == "the found kernel gfx950"
    assert not data["reaches_flydsl"]
    assert data["reason"] == "the found kernel gfx950 does not take heads=64, head_dim=128 at any KVBlockSize"
    data = reach.assess("deepseek_v32", {"index_n_heads": 32, "index_head_dim": 128}, refuses_64)
    assert data["reaches_flydsl"] and data["heads"] == 32


def test_without_a_found_kernel_the_general_contract_decides():
    data = reach.assess("deepseek_v32", {"index_n_heads": 48, "index_head_dim": 128}, ACTIVE)
    assert data["contract"] == "the general FlyDSL contract (no kernel found)"
    assert data["reason"].startswith("the general FlyDSL contract (no kernel found) does not take heads=48")


def test_next_n_2_stays_stock_from_a_caller_not_audited_for_it():
    shapes = reach.assess("glm5_next", None, ACTIVE)["shapes"]
    assert {s["flydsl"] for s in shapes if s["next_n"] == 2} == {False}
    assert {s["flydsl"] for s in reach.assess("deepseek_v32", None, ACTIVE)["shapes"]} == {True}
    c4a = reach.assess("deepseek_v4", None, ACTIVE)["shapes"]  # compress_ratio 4: bounds not one apart
    assert {s["flydsl"] for s in c4a if s["next_n"] == 2} == {False}


# ------------------------------------------------------------------ input


def test_resolve_reads_a_model_directory_or_a_bare_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "index_n_heads": 32}))
    assert reach.resolve(str(tmp_path)) == ("glm_moe_dsa", {"model_type": "glm_moe_dsa", "index_n_heads": 32})
    assert reach.resolve("deepseek_v4") == ("deepseek_v4", None)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: "m" * 300, "cannot be looked up as a path (File name too long)"),
        (lambda d: str(d / ("m" * 300)), "cannot be looked up as a path (File name too long)"),
        (
            lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000) and str(d),
            "is JSON nested too deeply to read",
        ),
    ],
    ids=["long-name", "long-path", "nested-json"],
)
def test_every_model_path_problem_is_one_line_exit_2_for_doctor_and_check(tmp_path, make, words):
    arg = make(tmp_path)
    for command in ("doctor", "check"):
        done = cli([command, "--model", arg], simulation_env(), timeout=60)
        assert done.returncode == 2 and done.stdout == "", (command, done.stderr[-2000:])
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"vllm-flydsl-indexer {command}: error: ") and words in line, line


def test_a_model_directory_whose_parent_cannot_be_entered_is_one_line(tmp_path, monkeypatch):
    """Root enters any directory: the stat of a path under a mode-0 parent is refused as for a user."""
    locked = tmp_path / "locked"
    (locked / "model").mkdir(parents=True)
    real_stat = os.stat

    def refusing_stat(path, *a, **k):
        if str(path).startswith(str(locked) + os.sep):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *a, **k)

    monkeypatch.setattr(os, "stat", refusing_stat)
    with pytest.raises(reach.ModelError, match=r"cannot be looked up as a path \(Permission denied\)"):
        reach.resolve(str(locked / "model"))
    assert reach.resolve("deepseek_v32") == ("deepseek_v32", None)  # a known name is never a path problem


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: "llama", "not a directory or a known model type"),
        (lambda d: "", "is empty"),
        (lambda d: str(d), "no readable config.json"),
        (lambda d: (d / "config.json").write_text("{") and str(d), "no readable config.json"),
        (
            lambda d: (d / "config.json").write_text('{"model_type": "llama"}') and str(d),
            "field model_type is 'llama'",
        ),
    ],
)
def test_bad_model_is_one_line_exit_2_before_any_work(tmp_path, make, words):
    arg = make(tmp_path)
    done = cli(["doctor", "--model", arg], simulation_env(), timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"vllm-flydsl-indexer doctor: error: --model {arg}: ") and words in line
    assert ", ".join(reach.MODELS) in line


@pytest.mark.slow
def test_doctor_json_carries_the_model_verdict_on_simulated_gfx950(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    done = cli(
        ["doctor", "--json", "--strict", "--model", str(tmp_path)], simulation_env(**{envs.SWITCH: "1"})
    )
    assert done.returncode == 0, done.stderr[-2000:]
    model = json.loads(done.stdout)["model"]
    assert model["reaches_flydsl"] is True and model["reason"] is None
    text = cli(["doctor", "--strict", "--model", "glm5_next"], simulation_env(**{envs.SWITCH: "1"}))
    assert "  verdict:        stays stock: vLLM resolves the block-outer KV cache layout BLHNC" in text.stdout
    assert text.returncode == 1
    assert "\ndoctor --strict: GLM-5-next would stay stock (vLLM resolves the block-outer" in text.stderr


# ------------------------------------------------------------------ the pinned table against vLLM

# Where each model returns its indexer backends (what vLLM decides only when it builds the model).
BACKEND_RETURNS = {
    "deepseek_v32": "models/deepseek_v32/amd/rocm.py",
    "glm_moe_dsa": "models/deepseek_v32/amd/rocm.py",
    "deepseek_v4": "models/deepseek_v4/attention.py",
    "deepseek_v41": "models/deepseek_v41/attention.py",
    "glm5_next": "models/glm5next/common/attention.py",
}


@pytest.mark.parametrize("model_type", list(reach.MODELS))
def test_model_table_matches_the_installed_vllm(model_type):
    model = reach.MODELS[model_type]
    registry = source("model_executor/models/registry.py")
    assert f'"{model.architecture}":' in registry
    assert f'"{model_type}"' in source("config/speculative.py")
    text = source(BACKEND_RETURNS[model_type])
    for backend in model.backends:
        cls = reach._backend(backend)  # importable by name
        if "Indexer" in cls.__name__ or "Kpool" in cls.__name__:
            assert f"return {cls.__name__}" in text, (model_type, cls.__name__)
    assert model.call_site in CALL_SITES
    if reach._vllm_file(model.call_site) is None:
        pytest.skip(f"vLLM {VLLM} has no {model.call_site}")


def test_pinned_ratios_block_sizes_and_heads_match_vllm():
    from vllm.platforms import current_platform
    from vllm.utils.deep_gemm import get_paged_mqa_page_sizes
    from vllm.v1.attention.backends.mla import indexer

    v4 = source("models/deepseek_v4/attention.py")
    assert (
        "if self.compress_ratio == 4:\n            # Only C4A uses sparse attention and hence has indexer."
        in v4
    )
    assert "self.n_head = config.index_n_heads  # 64" in v4
    assert reach.MODELS["deepseek_v4"].compress_ratios == (4,) and reach.MODELS["deepseek_v4"].heads == 64
    assert indexer.DeepseekV4IndexerBackend.get_supported_kernel_block_sizes() == [256]
    assert reach.MODELS["deepseek_v4"].block_sizes == (256 // 4,)
    glm5next = source("models/glm5next/common/attention.py")
    assert "self.n_head = config.index_n_heads  # 64" in glm5next
    assert reach.MODELS["glm5_next"].heads == 64
    assert set(reach.MODELS["glm5_next"].block_sizes) == set(get_paged_mqa_page_sizes())
    assert CALL_SITES[reach.MODELS["glm5_next"].call_site].compress_ratio.startswith("does NOT pass it")
    v41 = source("models/deepseek_v41/attention.py")
    assert "if self.compress_ratio not in (0, 1, 2):" in v41 and "if self.compress_ratio > 0:" in v41
    # On the simulated gfx950 (capability 9.5: family 90), as on MI350/MI355.
    assert current_platform.is_rocm() and current_platform.is_device_capability_family(90)
    assert indexer.DeepseekV41IndexerBackend.get_supported_kernel_block_sizes() == [64]
    assert reach.MODELS["deepseek_v41"].block_sizes == tuple(64 // r for r in (1, 2))
    assert reach.MODELS["deepseek_v41"].compress_ratios == (1, 2)
    for model_type in ("deepseek_v32", "glm_moe_dsa", "deepseek_v41"):
        assert reach.MODELS[model_type].call_site == TARGET_MODULE
    for model_type in ("deepseek_v32", "glm_moe_dsa"):
        assert reach.MODELS[model_type].compress_ratios == (1,)


def test_deepseek_v41_reaches_the_target_through_vllms_indexer_on_gfx950():
    """V4.1's AMD ops layer (which calls the target in _decode_step) is taken only with --monokernel
    on gfx942 (0.33.0 on; 0.32.0 has none); elsewhere its FP8 indexer is vLLM's, whose op is
    rocm_aiter_sparse_attn_indexer."""
    if not (vllm_root() / "models/deepseek_v41/amd/rocm.py").is_file():
        pytest.skip(f"vLLM {VLLM} has no DeepSeek-V4.1 AMD module")
    rocm = source("models/deepseek_v41/amd/rocm.py")
    tree = ast.parse(rocm)
    klass = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepseekV41ROCMAiterMLAAttention"
    )
    choice = ast.get_source_segment(
        rocm, next(n for n in klass.body if getattr(n, "name", "") == "_indexer_cls")
    )
    if not (vllm_root() / "models/deepseek_v41/amd/ops/sparse_indexer.py").is_file():
        # 0.32.0: no AMD ops module and no gfx942 path; the FP8 indexer is always vLLM's.
        assert "gfx942" not in rocm.lower() and "return super()._indexer_cls(k_cache)" in choice
        return
    gate = ast.get_source_segment(rocm, function(tree, "_gfx942_monokernel"))
    assert "kernel_config.monokernel) and on_gfx942()" in gate
    assert "if _gfx942_monokernel():\n            return DeepseekV41Gfx942Indexer" in choice
    assert "attn_cls = Gfx942SparseAttnIndexer" in rocm
    assert "calls it only with --monokernel on gfx942" in CALL_SITES[V41_OPS].note


def test_mxfp4_default_is_read_from_vllm():
    tree = module_source("vllm.platforms.rocm")
    if VLLM.startswith("0.32."):
        assert reach.mxfp4_default_models() == frozenset()
        return
    src = ast.unparse(function(tree, MXFP4_DEFAULT_FUNCTION))
    assert "attention_config.indexer_kv_dtype = 'mxfp4'" in src
    assert reach.mxfp4_default_models() == {"deepseek_v4"}


def dsv4_config(indexer_kv_dtype: str) -> SimpleNamespace:
    """The parts of a VllmConfig that vLLM's MXFP4 default reads, for DeepSeek-V4."""
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v4")),
        attention_config=SimpleNamespace(indexer_kv_dtype=indexer_kv_dtype, indexer_sparse_logits=False),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
    )


def test_doctor_model_says_a_model_on_the_mxfp4_indexer_stays_stock_and_how_to_reach_flydsl():
    """The MXFP4 watch is doctor --model's only (the plugin no longer wraps vLLM's default at run time):
    its verdict names vLLM's default function and the FP8 setting, in text and JSON."""
    env = simulation_env(**{envs.SWITCH: "1"})
    # --strict prints the same report and fails on the model (two doctor runs, not three: each imports vLLM).
    text = cli(["doctor", "--strict", "--model", "deepseek_v4"], env)
    assert "Traceback" not in text.stderr, text.stderr[-2000:]
    if VLLM.startswith("0.32."):  # no MXFP4 default: the model's other first reason
        assert "deepseek_v4 runs aiter's MXFP4 indexer" not in text.stdout + text.stderr
        return
    assert f"  verdict:        stays stock: {mxfp4_reason('deepseek_v4')}" in text.stdout, text.stdout
    assert FP8_SETTING in text.stdout and MXFP4_DEFAULT_FUNCTION in text.stdout
    assert text.returncode == 1 and "deepseek_v4 runs aiter's MXFP4 indexer" in text.stderr
    model = json.loads(cli(["doctor", "--json", "--model", "deepseek_v4"], env).stdout)["model"]
    assert model["reaches_flydsl"] is False and model["reason"] == mxfp4_reason("deepseek_v4")
    assert model["indexer_path"].startswith("MXFP4") and model["fp8_setting"] == FP8_SETTING


def test_the_active_plugin_leaves_vllms_mxfp4_default_alone_and_logs_nothing(installed, plugin_log):
    """No run-time watch: vLLM's own function stays in place, and a config it switches to MXFP4 gives no
    plugin line (doctor --model is where an operator learns the model stays stock)."""
    import vllm.platforms.rocm as rocm

    if VLLM.startswith("0.32."):
        assert not hasattr(rocm, MXFP4_DEFAULT_FUNCTION)
        return
    default = getattr(rocm, MXFP4_DEFAULT_FUNCTION)
    assert not hasattr(default, "__wrapped__") and default.__module__ == "vllm.platforms.rocm"
    assert not hasattr(installed, "config_watch")
    logged = len(plugin_log)
    config = dsv4_config("auto")
    default(config)
    assert config.attention_config.indexer_kv_dtype == "mxfp4"  # vLLM's real default ran
    assert plugin_log[logged:] == []
    assert reach.assess("deepseek_v4", None, ACTIVE)["reason"] == mxfp4_reason("deepseek_v4")


# ------------------------------------------------------------------ the README's table


def readme_rows() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Which models reach this call", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    by_arch = {m.architecture: t for t, m in reach.MODELS.items()}
    out = {}
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        (arch,) = [a for a in re.findall(r"`(\w+ForCausalLM)`", cells[0]) if a in by_arch]
        out[by_arch[arch]] = cells
    return out


@pytest.mark.parametrize("model_type", list(reach.MODELS))
def test_readme_model_table_agrees_with_doctor(model_type):
    if VLLM.startswith("0.32."):
        pytest.skip("the README's table is for 0.33.0 and 0.34.0; 0.32.0 differs where it says so")
    rows = readme_rows()
    assert set(rows) == set(reach.MODELS)
    _, reaches, layout, takes = rows[model_type]
    data = reach.assess(model_type, None, ACTIVE)
    mxfp4 = data["indexer_path"].startswith("MXFP4")
    assert (": no.**" in reaches) is mxfp4 and (MXFP4_DEFAULT_FUNCTION in reaches) is mxfp4
    assert reaches.startswith("yes") is not mxfp4
    for ratio in re.findall(r"`compress_ratio` (\d+)", reaches):
        assert int(ratio) in data["compress_ratio"], (model_type, ratio)
    named = {
        s.function if s.module == TARGET_MODULE else s.module.removeprefix("vllm.models."): s.module
        for s in CALL_SITES.values()
    }
    for words, module in named.items():
        if words in reaches:
            assert module == reach.MODELS[model_type].call_site, (model_type, words)
    if layout != "as DeepSeek-V3.2":
        assert layout.startswith("block-outer") is not data["layer_contiguous"]
        assert data["kv_cache_layout"] in layout
    assert takes.startswith("yes") is data["allows_flydsl"]
    assert takes.startswith(("yes", "no")) and (("strided" in takes) is (not data["layer_contiguous"]))


# ------------------------------------------------------------------ a vLLM that raises on import


@pytest.mark.parametrize(
    ("raises", "where"),
    [("ImportError('boom')", "path"), ("ImportError('boom')", "cwd"), ("RuntimeError('boom')", "cwd")],
)
@pytest.mark.slow
def test_doctor_answers_whatever_a_broken_vllm_raises_on_import(tmp_path, raises, where):
    """A ``vllm`` package that raises on import (on PYTHONPATH, or in the current directory, which
    ``python -m`` puts first on the path): every doctor form answers, exit 0, and says vLLM is broken."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(f"raise {raises}\n")
    env = simulation_env(**{envs.SWITCH: "1"})
    if where == "path":
        env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    kind = raises.split("(")[0]
    runs = [["doctor"], ["doctor", "--json"], *(["doctor", "--model", m] for m in reach.MODELS)]
    for args in [*runs, ["doctor", "--json", "--model", "glm5_next"]]:
        done = cli(args, env, cwd=tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr[-3000:])
        if "--json" in args and "--model" in args:
            data = json.loads(done.stdout)["model"]
            assert data["vllm_import_error"] == f"{kind}: boom" and data["not_read_from_vllm"]
        elif "--model" in args:
            (line,) = [x for x in done.stdout.splitlines() if x.startswith("  vLLM broken:")]
            assert f"import vllm raises {kind}: boom" in line, done.stdout


@pytest.mark.parametrize("probe", ["mxfp4_default_models", "resolved_layout", "c4a_objection"])
def test_each_vllm_probe_that_raises_is_a_line_not_a_crash(monkeypatch, probe):
    """Each probe of an importable vLLM that raises (a module of it broken) is said, never raised."""

    def broken(*args):
        raise RuntimeError(f"{probe} broke")

    monkeypatch.setattr(reach, probe, broken)
    for model_type in reach.MODELS:
        data = reach.assess(model_type, None, ACTIVE)
        assert any(f"{probe} broke" in u for u in data["unknown"]), (model_type, data["unknown"])
        assert any(f"{probe} broke" in line for line in reach.render(data))


@pytest.mark.parametrize(
    ("given", "shape", "source"),
    [
        (
            {"index_n_heads": 32},
            (32, 128),
            "index_n_heads from config.json, index_head_dim from this package's",
        ),
        (
            {"index_head_dim": 256},
            (64, 256),
            "index_head_dim from config.json, index_n_heads from this package's",
        ),
        ({"index_n_heads": 32, "index_head_dim": 64}, (32, 64), "config.json"),
        ({}, (64, 128), "this package's model table"),
    ],
)
def test_config_json_shape_fields_are_used_one_by_one_and_their_source_said(tmp_path, given, shape, source):
    """DeepSeek-V3.2 in the table is 64x128: a config.json field given alone is still the one used."""
    from vllm_flydsl_indexer.tools import cli_args

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32", **given}))
    model_type, config = reach.resolve(str(tmp_path))
    data = reach.assess(model_type, config, ACTIVE)
    assert (data["heads"], data["head_dim"]) == shape and data["shape_source"].startswith(source)
    assert f"heads={shape[0]} head_dim={shape[1]} ({source}" in "\n".join(reach.render(data))
    if shape == (32, 128):  # check --model runs it as the shape it is
        assert cli_args.check_model(str(tmp_path)) == "glm-5"
