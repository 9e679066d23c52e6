# SPDX-License-Identifier: Apache-2.0
"""Drift tests: the installed vLLM still looks the way the adapter assumes.

They parse vLLM's source with ``ast`` (and, where it is cheap, build a vLLM
config), so a new vLLM release that changes a call site, the stock Gluon call,
the consumers of the logits or the warm-up before graph capture fails here
before it can make the plugin wrong. The installed target's fingerprint is its
release's entry of ``target.AUDITED`` (CI runs this in a venv per release); the
other releases' entries are recomputed from their wheels where
``$FLYDSL_INDEXER_TEST_VLLM_WHEELS`` names a directory holding them.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest

from vllm_flydsl_indexer.target import TARGET_KEYWORD_ONLY, TARGET_MODULE, TARGET_NAME, TARGET_POSITIONAL


def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin
    return Path(spec.origin).parent


def module_source(name: str) -> ast.Module:
    """The source of vLLM module ``name``, read from its file without importing its packages."""
    path = vllm_root().joinpath(*name.split(".")[1:]).with_suffix(".py")
    assert path.is_file(), f"{name} is not in the installed vLLM ({path})"
    return ast.parse(path.read_text())


def call_sites() -> list[tuple[Path, ast.Call]]:
    found = []
    for path in vllm_root().rglob("*.py"):
        text = path.read_text(errors="ignore")
        if TARGET_NAME + "(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == TARGET_NAME:
                    found.append((path, node))
    return found


# A directory holding vLLM wheels, as ``pip download --no-deps -d DIR vllm==X`` leaves them (any depth).
WHEELS = "FLYDSL_INDEXER_TEST_VLLM_WHEELS"
TARGET_FILE = "/".join(TARGET_MODULE.split(".")) + ".py"


def audited_releases() -> list[str]:
    from vllm_flydsl_indexer.target import AUDITED

    return sorted({release for release, _ in AUDITED.values()})


def release_source(version: str, file: str = TARGET_FILE) -> tuple[str, str]:
    """The source of vLLM ``version``'s ``file`` (the target module's by default) and where it came from: the
    installed file where ``version`` is installed, else the release's wheel under
    ``$FLYDSL_INDEXER_TEST_VLLM_WHEELS``. Skips with the reason otherwise (CI runs each release in its own
    venv, so each is pinned there); ``FileNotFoundError`` where the release has no such file."""
    import zipfile

    installed = importlib.metadata.version("vllm")
    if installed == version:
        path = vllm_root().parent / file
        return path.read_text(), str(path)
    directory = os.environ.get(WHEELS)
    why = f"vLLM {version} is not installed (this venv has {installed})"
    if not directory:
        pytest.skip(
            f"{why} and ${WHEELS} is unset (a directory where `pip download --no-deps -d DIR "
            f"vllm=={version}` put its wheel); CI tests it in its own venv"
        )
    wheels = sorted(Path(directory).rglob(f"vllm-{version}-*.whl"))
    if not wheels:
        pytest.skip(f"{why} and ${WHEELS}={directory} holds no vllm-{version}-*.whl")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if file not in wheel.namelist():
            raise FileNotFoundError(f"{wheels[0]} has no {file}")
        return wheel.read(file).decode(), f"{wheels[0]}!{file}"


def target_def(source: str) -> ast.FunctionDef:
    """The target's ``def`` in a module's source."""
    return function(ast.parse(source), TARGET_NAME)


def release() -> tuple[int, int]:
    """The installed vLLM's (major, minor)."""
    major, minor = importlib.metadata.version("vllm").split(".")[:2]
    return int(major), int(minor)


def function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_every_call_site_passes_the_arguments_the_adapter_expects():
    sites = call_sites()
    # 0.32.0: the indexer and glm5next; 0.33.0 adds deepseek_v41.
    assert len(sites) >= 2, "expected at least the indexer and glm5next call sites"
    for path, call in sites:
        where = f"{path.relative_to(vllm_root().parent)}:{call.lineno}"
        assert not any(isinstance(a, ast.Starred) for a in call.args), where
        assert all(k.arg is not None for k in call.keywords), f"{where}: **kwargs"
        names = list(TARGET_POSITIONAL[: len(call.args)]) + [k.arg for k in call.keywords]
        assert len(names) == len(set(names)), where
        assert set(names) <= set(TARGET_POSITIONAL) | set(TARGET_KEYWORD_ONLY), f"{where}: {names}"
        assert set(TARGET_POSITIONAL) <= set(names), f"{where}: missing {set(TARGET_POSITIONAL) - set(names)}"


def test_module_level_bindings_are_the_ones_the_patch_covers():
    """Module-level ``from ... import rocm_fp8_paged_mqa_logits`` must be patched in place."""
    import importlib

    from vllm_flydsl_indexer.patch import _bindings

    module_level = []
    for path in vllm_root().rglob("*.py"):
        text = path.read_text(errors="ignore")
        if TARGET_NAME not in text:
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.ImportFrom) and any(a.name == TARGET_NAME for a in node.names):
                module_level.append(".".join(path.relative_to(vllm_root().parent).with_suffix("").parts))
    # Known: 0.33.0's deepseek_v41 binds the name at import (0.32.0 has no such module);
    # glm5next imports it at call time. A new binding must be reviewed, then added here.
    known = {"vllm.models.deepseek_v41.amd.ops.sparse_indexer"}
    assert set(module_level) <= known, f"new module-level binding(s): {set(module_level) - known}"
    if release() >= (0, 33):
        assert set(module_level) == known
    target = importlib.import_module(TARGET_MODULE)
    for name in module_level:
        importlib.import_module(name)
    bound = {m.__name__ for m in _bindings(vars(target)[TARGET_NAME])}
    assert set(module_level) | {TARGET_MODULE} <= bound


# What the audited releases' Gluon call passes (docs/vllm-audit.md). The fingerprint pins the rest; these
# say, where a release differs, which part the hooks mirror.
GLUON_ARGS = (
    "q_fp8",
    "kv_cache_fp8",
    "weights",
    "out_logits",
    "_per_sequence_context_lens(context_lens)",
    "block_tables",
    "max_model_len",
)
GLUON_KNOBS = {"ChunkK": "256", "KVBlockSize": "block_size", "WavePerEU": "2"}
# How each form of AUDITED passes Preshuffle (what target.vllm_stock_hooks' preshuffle answers).
PRESHUFFLE = {
    "size": "block_size > 1",
    "layout": "indexer_k_cache_is_shuffled(block_size) and (not _ON_RDNA)",
}


def installed_release() -> str:
    """The installed vLLM's release, without a local or dev suffix (what AUDITED names)."""
    return importlib.metadata.version("vllm").split("+")[0]


def assert_audited_release(source: str, version: str, origin: str) -> None:
    """``source`` (a target module's) fingerprints as vLLM ``version``'s entry of AUDITED, and the entry's
    form is how its Gluon call passes Preshuffle."""
    import tempfile

    from vllm_flydsl_indexer.target import AUDITED, fingerprint

    fn = target_def(source)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, "rocm_aiter_mla_sparse.py")
        path.write_text(source)
        found = AUDITED.get(fingerprint(str(path), fn.lineno))
    assert found is not None and found[0] == version, f"{origin}: {found}"
    (call,) = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "deepgemm_fp8_paged_mqa_logits"
    ]
    assert tuple(ast.unparse(a) for a in call.args) == GLUON_ARGS
    knobs = {k.arg: ast.unparse(k.value) for k in call.keywords}
    assert knobs == {**GLUON_KNOBS, "Preshuffle": PRESHUFFLE[found[1]]}, (version, knobs)


@pytest.mark.parametrize("version", audited_releases())
def test_each_releases_entry_builds_the_preshuffle_its_gluon_call_passes(target, monkeypatch, version):
    """Without the release's wheel: the target gate, finding a release's fingerprint, builds the router's
    ``Preshuffle`` hook in that release's form (0.32.0, 0.33.0: ``block_size > 1``; 0.34.0:
    ``indexer_k_cache_is_shuffled(block_size) and not _ON_RDNA``, as its Gluon call reads). A fresh random
    layout helper, unlike ``block_size > 1``, tells the forms apart."""
    import random

    from vllm_flydsl_indexer import gates
    from vllm_flydsl_indexer import target as content

    (fingerprint,) = [f for f, (release, _) in content.AUDITED.items() if release == version]
    monkeypatch.setattr(content, "fingerprint_of", lambda fn: fingerprint)
    seed = random.randrange(2**32)
    sizes = [1, 16, 32, 48, 64, 128, 256]
    shuffled = set(random.Random(seed).sample(sizes, 3)) | {1}  # never block_size > 1's answer
    monkeypatch.setattr(target, "indexer_k_cache_is_shuffled", lambda bs: bs in shuffled, raising=False)
    monkeypatch.setattr(target, "_ON_RDNA", False, raising=False)
    (_, ok, detail), _, hooks = gates.check_target()
    assert ok and f"is vLLM {version}'s audited code" in detail, detail
    layout = tuple(int(x) for x in version.split(".")[:2]) >= (0, 34)
    wanted = {bs: bs in shuffled if layout else bs > 1 for bs in sizes}
    assert {bs: hooks.preshuffle(bs) for bs in sizes} == wanted, (seed, shuffled)
    monkeypatch.setattr(target, "_ON_RDNA", True)  # 0.34.0's "and not _ON_RDNA"
    hooks = gates.check_target()[2]
    assert {bs: hooks.preshuffle(bs) for bs in sizes} == {bs: not layout and bs > 1 for bs in sizes}, seed


def test_the_installed_target_is_its_release_in_the_audit(target):
    """The installed vLLM's target is its own release's entry of AUDITED, with its form. CI installs each
    audited release in its own venv, so this pins each there; the function this process imported is the
    one the start-up gate fingerprints."""
    from vllm_flydsl_indexer.target import AUDITED, fingerprint_of

    version = installed_release()
    fn = vars(target)[TARGET_NAME]
    assert AUDITED.get(fingerprint_of(fn)) == (version, "layout" if release() >= (0, 34) else "size")
    assert_audited_release(Path(fn.__code__.co_filename).read_text(), version, fn.__code__.co_filename)
    src = ast.unparse(target_def(Path(fn.__code__.co_filename).read_text()))
    # The branch that reaches Gluon: gfx9 in 0.32/0.33; 0.34.0 adds RDNA but gfx1151.
    branch = "_ON_GFX942 or _ON_GFX950" + (
        " or (_ON_RDNA and (not _ON_GFX1151))" if release() >= (0, 34) else ""
    )
    assert f"if {branch}:" in src, branch
    # No -inf fill or sanitize on the gfx9 Gluon branch: the plugin adds none either.
    gluon_branch = src[src.index("deepgemm_fp8_paged_mqa_logits = ") : src.index("return out_logits")]
    assert "fill_" not in gluon_branch and "nan_to_num" not in gluon_branch


@pytest.mark.parametrize("version", audited_releases())
def test_each_audited_release_is_its_entry(version):
    """Each release's own source (installed, or its wheel) fingerprints as its entry, with its form."""
    source, origin = release_source(version)
    assert_audited_release(source, version, origin)


@pytest.mark.parametrize("version", audited_releases())
def test_each_audited_releases_multi_row_callers_are_their_entries(tmp_path, version):
    """The call sites trusted with next_n > 1 are held to their own code, as the target is: in each release
    (installed, or its wheel) the function of each that calls the target fingerprints as its
    ``CALLER_CODE`` entry for that release, and only there; a release without the module (deepseek_v41
    before 0.33.0) has no entry for it."""
    from vllm_flydsl_indexer.target import CALLER_CODE, MULTI_ROW, fingerprint

    assert set(CALLER_CODE) == {module for module, why in MULTI_ROW.items() if why is None}
    for module, (name, releases) in CALLER_CODE.items():
        listed = [f for f, found in releases.items() if version in found.split(", ")]
        try:
            source, origin = release_source(version, "/".join(module.split(".")) + ".py")
        except FileNotFoundError:
            assert listed == [], (module, version)
            continue
        fn = function(ast.parse(source), name)
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == TARGET_NAME]
        assert len(calls) == 1, f"{origin}: {name} calls the target {len(calls)} times"
        path = tmp_path / f"{version}-{name}.py"
        path.write_text(source)
        found = fingerprint(str(path), (fn.decorator_list or [fn])[0].lineno, name)
        assert listed == [found], f"{origin}: {module}.{name} fingerprints as {found}, listed {listed}"


def test_every_release_in_the_window_has_an_audited_entry():
    """The fingerprint knows one release of every minor the version gate lets through, and only those."""
    from vllm_flydsl_indexer import gates
    from vllm_flydsl_indexer.target import AUDITED

    (low_major, low), (high_major, high) = gates.SUPPORTED_VLLM
    assert low_major == high_major
    minors = [tuple(int(x) for x in version.split(".")[:2]) for version, _ in AUDITED.values()]
    assert sorted(minors) == [(low_major, minor) for minor in range(low, high + 1)]
    assert installed_release() in audited_releases()


def test_decode_consumers_read_what_the_window_rule_assumes():
    """Top-k reads ``seq_lens.reshape(-1)``; candidate selection repeats per-sequence bounds."""
    src = ast.unparse(function(module_source(TARGET_MODULE), "rocm_aiter_sparse_attn_indexer"))
    assert "rocm_aiter_ops.indexer_top_k_decode(logits, 1, decode_metadata.seq_lens.reshape(-1)" in src
    assert "visible = decode_metadata.seq_lens.reshape(-1)" in src
    if release() < (0, 34):
        assert "visible = visible.repeat_interleave(next_n)" in src
    else:
        # 0.34.0 repeats a per-sequence entry in-kernel: row r reads ends[r // row_repeat].
        assert "row_repeat = next_n if visible.numel() != num_rows else 1" in src
        assert src.count("row_repeat)") == 2  # both candidate paths get it
        kernels = [
            module_source("vllm.v1.attention.ops.rocm_aiter_mla_sparse"),
            module_source("vllm.model_executor.kernels.attention.dsa.candidate_blocks"),
        ]
        loads = [
            ast.unparse(n)
            for tree in kernels
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and ast.unparse(n.func) == "tl.load"
            and "ends" in ast.unparse(n.args[0])
        ]
        assert loads and all("row // ROW_REPEAT * stride_end" in load for load in loads), loads
    # Nothing touches the logits between the call and the consumers.
    between = src[
        src.index("logits = rocm_fp8_paged_mqa_logits(") : src.index("if candidate_blocks is not None")
    ]
    assert "fill_" not in between and "nan_to_num" not in between


def test_native_mtp_bounds_are_one_apart():
    """The native table is ``max(L_b - max_decode_len + j + 1, 0)``, ``max_decode_len`` columns wide.

    Flattened rows get the same formula per token (the Triton kernel). The
    router takes ``next_n > 1`` only when q's rows equal the table's width, so a
    table wider than q (0.34.0's adaptive verification pins the width to
    ``next_n`` while q is packed to the step's longest request) stays stock.
    """
    tree = module_source("vllm.v1.attention.backends.mla.indexer")
    text = ast.unparse(tree)
    assert "per_token_seq_len = tl.maximum(seq_len - max_decode_len + local_idx + 1, 0)" in text
    assert "seq_lens //= self.compress_ratio" in text
    native = ast.unparse(method(tree, "DeepseekV32IndexerMetadataBuilder", "_prepare_decode_tensors"))
    assert (
        "seq_lens_buffer = self.decode_seq_lens_buffer[:num_decodes * max_decode_len].view(num_decodes, "
        "max_decode_len)" in native
    )
    assert (
        "seq_lens_buffer[:] = (seq_lens.unsqueeze(1) - max_decode_len + 1 + "
        "self.offsets_buffer[:max_decode_len]).clamp_(min=0)" in native
    )
    build = ast.unparse(method(tree, "DeepseekV32IndexerMetadataBuilder", "build"))
    decode = build[build.index("decode_metadata = None") :]
    if release() >= (0, 34):
        # Adaptive verification widens the table to next_n; ShardQ touches only the prefill chunks.
        adaptive = decode[decode.index("if self.use_adaptive_verification:") :]
        assert adaptive.split("\n")[1].strip() == "max_decode_len = next_n", adaptive[:200]
        assert "positions" not in decode and "shardq" not in decode
    else:
        assert "adaptive" not in decode


def test_adaptive_verification_on_rocm_is_flattened_or_refused():
    """0.34.0: on ROCm only the DeepSeek-V4/V4.1 indexer backends take adaptive verification, flattened.

    What callers.py's 0.34.0 audit rests on: DeepSeek-V3.2/GLM-5.x's backend
    refuses a device/CPU query-length mismatch there, so their native table is
    never wider than q.
    """
    if release() < (0, 34):
        pytest.skip("the indexer builder's adaptive verification width override is new in vLLM 0.34.0")
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla import indexer

    assert current_platform.is_rocm()
    assert not indexer.DeepseekV32IndexerBackend.supports_device_cpu_query_lens_mismatch()
    assert indexer.DeepseekV4IndexerBackend.supports_device_cpu_query_lens_mismatch()
    assert issubclass(indexer.DeepseekV41IndexerBackend, indexer.DeepseekV4IndexerBackend)
    tree = module_source("vllm.v1.attention.backends.mla.indexer")
    flattening = ast.unparse(function(tree, "_use_flattening"))
    assert "speculative_config.enable_adaptive_verification" in flattening
    assert "_supports_deepseek_v4_flattened_device_query_lens(vllm_config)" in flattening


@pytest.mark.parametrize(
    "name",
    [
        "_per_sequence_context_lens",
        "paged_mqa_logits_module",
        "_indexer_k_is_c4a_block_flat",
        "current_workspace_manager",
    ],
)
def test_helpers_the_hooks_use_exist(target, name):
    assert callable(getattr(target, name))


def _enclosing_calls() -> list[tuple[str, str, ast.Call]]:
    """(module, enclosing function, call) for every call of the target in the installed vLLM."""
    found = []
    for path in vllm_root().rglob("*.py"):
        text = path.read_text(errors="ignore")
        if TARGET_NAME + "(" not in text:
            continue
        module = ".".join(path.relative_to(vllm_root().parent).with_suffix("").parts)
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and TARGET_NAME == (
                    node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                ):
                    found.append((module, fn.name, node))
    # A call inside a nested function is seen from each enclosing def: keep the innermost.
    innermost: dict[int, tuple[str, str, ast.Call]] = {}
    for module, name, call in found:
        innermost[id(call)] = (module, name, call)
    return list(innermost.values())


def test_every_call_site_is_in_the_audit_with_the_recorded_arguments():
    """An unaudited call site, or an audited one whose arguments changed, fails CI.

    At runtime such a caller is already safe (next_n == 1 only); this makes it loud.
    """
    from vllm_flydsl_indexer.tools.audit import CALL_SITES

    sites = _enclosing_calls()
    assert sites, "no call site of the target found"
    version = importlib.metadata.version("vllm")
    seen = set()
    for module, function_name, call in sites:
        where = f"{module}.{function_name}:{call.lineno}"
        assert module in CALL_SITES, f"{where} calls the target and is not in callers.CALL_SITES: audit it"
        site = CALL_SITES[module]
        assert function_name == site.function, f"{where}: the audit records {site.function}"
        passed = set(TARGET_POSITIONAL[: len(call.args)]) | {k.arg for k in call.keywords}
        assert passed == site.passes, (
            f"{where} passes {sorted(passed)}, the audit records {sorted(site.passes)}"
        )
        assert version.split("+")[0].rsplit(".", 1)[0] in site.vllm or version in site.vllm, (
            f"{where}: the audit does not list vLLM {version}"
        )
        seen.add(module)
    # Every audited site that this vLLM release has must still be there.
    expected = {
        m for m, s in CALL_SITES.items() if any(v.startswith(version[:4]) for v in s.vllm.split(", "))
    }
    assert expected <= seen, f"audited call sites gone from vLLM {version}: {expected - seen}"


def test_glm5next_kpool_bounds_are_pooled_and_the_call_passes_no_ratio():
    """What the audit says of GLM-5-next: tokens_per_state = index_kpool, no compress_ratio passed."""
    text = (vllm_root() / "models/glm5next/common/attention.py").read_text()
    assert "replace(spec, tokens_per_state=self._index_kpool)" in text
    builder = (vllm_root() / "v1/attention/backends/mla/indexer.py").read_text()
    assert "self.compress_ratio = self.kv_cache_spec.tokens_per_state" in builder
    src = ast.unparse(
        function(module_source("vllm.models.glm5next.amd.sparse_indexer"), "sparse_attn_indexer_kpool")
    )
    assert "max_model_len=max_pool_len" in src


# What the adapter's no-compile-inside-capture guard rests on: vLLM runs the
# model eagerly, outside capture, before it captures any graph, so FlyDSL's JIT
# compile of each configuration happens there and the guard should never fire.


def method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def calls_in_order(tree: ast.Module, cls: str, name: str) -> list[str]:
    """Names of the calls method ``cls.name`` makes, in source order, with ``self.`` helpers inlined."""
    names: list[str] = []

    def visit(fn: ast.FunctionDef, stack: tuple[str, ...]) -> None:
        for node in _source_order(fn):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called is None:
                continue
            names.append(called)
            on_self = isinstance(func, ast.Attribute) and ast.unparse(func.value) == "self"
            if on_self and called not in stack:
                try:
                    visit(method(tree, cls, called), (*stack, called))
                except StopIteration:
                    pass  # not a method of this class (an inherited or runner method)

    visit(method(tree, cls, name), (name,))
    return names


def _source_order(fn: ast.FunctionDef) -> list[ast.AST]:
    return sorted((n for n in ast.walk(fn) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset))


def test_config_forces_one_cudagraph_warmup_when_graphs_are_on(monkeypatch):
    """``VllmConfig`` turns CompilationConfig's default of 0 warm-ups into 1 on a graph platform.

    The test process's platform is ROCm gfx950 (the amdsmi double), so this is
    the branch a GPU takes; a platform without graphs (a CPU) keeps 0.
    """
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    environ = dict(os.environ)  # VllmConfig may set VLLM_* variables; keep other tests clean
    try:
        assert CompilationConfig().cudagraph_num_of_warmups == 0
        assert current_platform.support_static_graph_mode()
        config = VllmConfig().compilation_config
        assert config.cudagraph_mode != CUDAGraphMode.NONE
        assert config.cudagraph_num_of_warmups == 1, "vLLM no longer forces a warm-up before each capture"
        monkeypatch.setattr(
            type(current_platform), "support_static_graph_mode", classmethod(lambda cls: False)
        )
        assert VllmConfig().compilation_config.cudagraph_num_of_warmups == 0
    finally:
        os.environ.clear()
        os.environ.update(environ)


def test_v1_runner_warms_up_that_many_times_before_each_capture():
    """Model Runner V1 runs ``cudagraph_num_of_warmups`` eager steps before each capture.

    0.34.0 removed Model Runner V1: the worker builds only V2, whose warm-ups
    the two tests below pin.
    """
    if release() >= (0, 34):
        assert not (vllm_root() / "v1/worker/gpu_model_runner.py").exists()
        worker = ast.unparse(module_source("vllm.v1.worker.gpu_worker"))
        assert "gpu_model_runner" not in worker
        assert "from vllm.v1.worker.gpu.model_runner import GPUModelRunner" in worker
        return
    fn = method(module_source("vllm.v1.worker.gpu_model_runner"), "GPUModelRunner", "_warmup_and_capture")
    src = ast.unparse(fn)
    assert "num_warmups = self.compilation_config.cudagraph_num_of_warmups" in src
    assert "for _ in range(num_warmups):" in src
    warmups = src.index("for _ in range(num_warmups):")
    assert warmups < src.index("cudagraph_runtime_mode=cudagraph_runtime_mode")  # the capture step


def test_worker_warms_up_kernels_before_it_captures():
    """The worker runs Model Runner V2's ``warmup_kernels`` (real steps) before ``capture_model``.

    In 0.32.0 this is inline in ``compile_or_warm_up_model``; 0.33.0 moves it to
    a helper of the same class, which is followed.
    """
    from vllm.config import KernelConfig

    assert KernelConfig().enable_jit_warmup, "the JIT warm-up is no longer on by default"
    names = calls_in_order(module_source("vllm.v1.worker.gpu_worker"), "Worker", "compile_or_warm_up_model")
    assert "warmup_kernels" in names, "the worker no longer runs warmup_kernels"
    assert "capture_model" in names, "the worker no longer calls capture_model"
    assert names.index("warmup_kernels") < names.index("capture_model"), names


def test_v2_graph_manager_runs_one_eager_forward_before_each_capture():
    """Model Runner V2's graph manager runs ``forward_fn(NONE)`` before each ``torch.cuda.graph``."""
    fn = method(module_source("vllm.v1.worker.gpu.cudagraph_utils"), "CudaGraphManager", "capture")
    order = [ast.unparse(n) for n in _source_order(fn) if isinstance(n, ast.Call)]
    eager = "forward_fn(CUDAGraphMode.NONE)"
    graph = next((i for i, c in enumerate(order) if c.startswith("torch.cuda.graph(")), None)
    assert eager in order and graph is not None, order
    assert order.index(eager) < graph


# What the README's "Which models reach this call" table rests on.


def test_which_indexer_caches_are_forced_block_outer():
    """DeepSeek-V4/V4.1 and GLM-5-next force a block-outer layout; DeepSeek-V3.2/GLM-5.x take the default.

    vLLM resolves one KV cache layout for the whole model from every backend's
    supported layouts, so GLM-5-next's kpool tail cache decides its indexer
    cache's layout too.
    """
    from vllm.v1.attention.backends.mla import indexer
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_flydsl_indexer.tools.doctor import BLOCK_OUTER_LAYOUTS

    assert {layout.name for layout in KVCacheLayout if not layout.is_layer_compact} == set(
        BLOCK_OUTER_LAYOUTS
    )
    for backend in (
        indexer.DeepseekV4IndexerBackend,
        indexer.DeepseekV41IndexerBackend,
        indexer.KpoolTailBackend,
    ):
        layouts = backend.supported_kv_cache_layouts()
        assert layouts and not any(layout.is_layer_compact for layout in layouts), (backend, layouts)
    glm5next = get_supported_kv_cache_layouts([indexer.Glm5NextIndexerBackend, indexer.KpoolTailBackend])
    assert glm5next and not any(layout.is_layer_compact for layout in glm5next)
    assert indexer.DeepseekV32IndexerBackend.supported_kv_cache_layouts() is None
    assert get_supported_kv_cache_layouts([indexer.DeepseekV32IndexerBackend])[0].is_layer_compact
    # GLM-5-next always has the tail cache: its indexer asserts index_kpool > 1.
    text = (vllm_root() / "models/glm5next/common/attention.py").read_text()
    assert 'assert index_kpool > 1, "Glm5NextTailCache expects index_kpool > 1"' in text
    assert "self.tail_cache = Glm5NextTailCache(" in text


def test_deepseek_v4_defaults_to_the_mxfp4_indexer_on_cdna4():
    """0.33.0: DeepSeek-V4 (not V4.1) on MI350/MI355 with aiter uses aiter's MXFP4 indexer.

    Unless FP8 is asked for. 0.32.0 has no such default (its DeepSeek-V4 indexer
    cache stays FP8). Either way only DeepSeek-V4's compress-ratio-4 (C4A) layers
    have an indexer, and stock sends those calls to vLLM's own Triton kernel.
    """
    tree = module_source("vllm.platforms.rocm")
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    version = importlib.metadata.version("vllm")
    if version.startswith("0.32."):
        assert "_maybe_default_dsv4_mxfp4_indexer" not in defined
    else:
        src = ast.unparse(function(tree, "_maybe_default_dsv4_mxfp4_indexer"))
        assert "!= 'deepseek_v4'" in src and "get_cdna_version() != 4" in src
        assert "attention_config.indexer_kv_dtype != 'auto'" in src
        assert "attention_config.indexer_kv_dtype = 'mxfp4'" in src
    text = (vllm_root() / "models/deepseek_v4/attention.py").read_text()
    assert (
        "if self.compress_ratio == 4:\n            # Only C4A uses sparse attention and hence has indexer."
        in text
    )


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_hooks_preshuffle_is_what_stock_passes_gluon(target, monkeypatch, block_size):
    """The router launches FlyDSL with the layout vLLM's own Gluon call is told, release by release."""
    from vllm_flydsl_indexer.target import AUDITED, fingerprint_of, vllm_stock_hooks

    # The hooks resolve vLLM's names when they are built (at install): each change is made first.
    _, form = AUDITED[fingerprint_of(vars(target)[TARGET_NAME])]
    hooks = vllm_stock_hooks(target, form)
    assert hooks.preshuffle(block_size) is (block_size > 1)
    if release() >= (0, 34):
        assert target.indexer_k_cache_is_shuffled(block_size) is (block_size > 1)
        monkeypatch.setattr(target, "_ON_RDNA", True)  # stock's "and not _ON_RDNA"
        assert vllm_stock_hooks(target, form).preshuffle(block_size) is False
        monkeypatch.setattr(target, "_ON_RDNA", False)
        monkeypatch.setattr(target, "indexer_k_cache_is_shuffled", lambda bs: bs >= 32)
        assert vllm_stock_hooks(target, form).preshuffle(block_size) is (block_size >= 32)


def test_the_indexer_op_breaks_breakable_graphs_and_runs_eagerly():
    """Breakable CUDA graphs (docs/vllm-audit.md): the defining module's indexer op is vLLM's
    ``eager_break_during_capture`` wrapper, and ``add_eager`` ends the capture segment before it runs
    the op, so the router never runs inside a capture and runs again at every replay."""
    import inspect
    import textwrap

    breakable = pytest.importorskip("vllm.compilation.breakable_cudagraph")
    module = importlib.import_module(TARGET_MODULE)
    (indexer,) = (
        node
        for node in ast.parse(Path(module.__file__).read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "rocm_aiter_sparse_attn_indexer"
    )
    assert [ast.unparse(d) for d in indexer.decorator_list][:1] == ["eager_break_during_capture"]
    assert TARGET_NAME in ast.unparse(indexer)
    op = module.rocm_aiter_sparse_attn_indexer
    if op.__code__.co_name == "rocm_aiter_sparse_attn_indexer":
        # vLLM 0.32.0 reads VLLM_USE_BREAKABLE_CUDAGRAPH when the module is imported (off here: no wrapper).
        decorator = inspect.getsource(breakable.eager_break_during_capture)
        assert not breakable.is_breakable_cudagraph_enabled()
        assert "if not is_breakable_cudagraph_enabled():" in decorator
    else:
        # 0.33.0 and 0.34.0 wrap always, and decide at each call.
        assert op.__code__ is breakable.eager_break_during_capture(lambda: None).__code__
    body = [
        type(node.value).__name__ + ":" + ast.unparse(node)
        for node in ast.parse(
            textwrap.dedent(inspect.getsource(breakable.BreakableCUDAGraphCapture.add_eager))
        )
        .body[0]
        .body
        if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Constant)
    ]
    ends = body.index("Call:self._end_segment()")
    runs = next(i for i, line in enumerate(body) if line.endswith("= fn()"))
    records = body.index("Call:self.segments.append(fn)")
    begins = body.index("Call:self._begin_segment()")
    assert ends < runs < records < begins, body


def test_vllm_locks_its_workspace_after_capture_and_the_hooks_read_it(target, workspace):
    """The measurement stops once vLLM serves: the hooks' ``serving`` is vLLM's own workspace lock, which
    both model runners take at the end of ``capture_model`` (after warm-up and every capture)."""
    from vllm_flydsl_indexer.target import AUDITED, fingerprint_of, vllm_stock_hooks

    _, form = AUDITED[fingerprint_of(vars(target)[TARGET_NAME])]
    hooks = vllm_stock_hooks(target, form)
    assert hooks.serving() is False
    workspace.lock_workspace()
    assert hooks.serving() is True and workspace.current_workspace_manager().is_locked()
    runners = ["vllm.v1.worker.gpu.model_runner"]  # Model Runner V2, in every audited release
    if release() < (0, 34):  # 0.34.0 removed the V1 runner
        runners.append("vllm.v1.worker.gpu_model_runner")
    for module in runners:
        names = calls_in_order(module_source(module), "GPUModelRunner", "capture_model")
        assert "lock_workspace" in names, (
            f"{module}.GPUModelRunner.capture_model no longer locks the workspace"
        )
