# SPDX-License-Identifier: Apache-2.0
"""Opt-in: the plugin's router into a real aiter checkout's FlyDSL wrapper, compiled for gfx950.

No GPU needed: flydsl's ``COMPILE_ONLY`` mode runs the whole compile (MLIR,
LLVM's AMDGPU backend, ``ld.lld``) and skips the launch. For every model
shape the identified kernel takes, the router (``arms.patched_call``, called
as vLLM's audited call site calls it) launches the real wrapper three times
with exactly the arguments it passes in production, and the test asserts:

* every call was taken (the wrapper accepted the router's arguments);
* flydsl compiled once, on the first call, and not again for the same shapes
  nor for another batch size and ``max_model_len`` (the router marks a
  configuration compiled after its first call and then allows it inside graph
  capture);
* what it compiled is a gfx950 code object, read from the object itself: an
  AMDGPU ELF (``e_machine`` 224) whose ``e_flags`` name gfx950 (0x4F) and whose
  metadata note says ``amdhsa.target`` ``amdgcn-amd-amdhsa-[unknown]-gfx950``,
  not what flydsl was asked to compile for (flydsl 0.5.0 no longer passes an
  ``arch`` to its compile step);
* the wrapper received exactly the keyword arguments the router computes
  (:meth:`KernelVariant.launch_kwargs`), an explicit ``SplitKV`` included for
  the gfx950 revision (issue 43 dropped the early one; identification refuses it).

Each configuration runs in a fresh interpreter (``tests/real_wrapper/
compile_config.py``, which documents what it stubs) with an empty flydsl
cache. Run with::

    VLLM_FLYDSL_INDEXER_AITER_CHECKOUT=/path/to/aiter python -m pytest tests/test_real_wrapper.py -rs

The variable may list several checkouts, separated by ``:``: a git checkout of
aiter, or a directory assembled from public aiter files at given commits (the
gfx950 revisions; the README lists the files), each parametrizing the tests.

It needs flydsl in this environment (the version the checkout pins, or any
other: 0.3.1, 0.4.2 and 0.5.0 were run; one layered on ``PYTHONPATH`` is the
one used, since the helper's process keeps this ``PYTHONPATH`` after the
plugin's ``src``) and an LLVM 19+ ``ld.lld`` (``VLLM_FLYDSL_INDEXER_LD_LLD``,
``$ROCM_PATH/llvm/bin``, ``ld.lld-NN`` or ``/usr/lib/llvm-NN/bin``); it skips
with the reason otherwise. The flydsl that compiled (version and path) is in
every assertion message, in the skip reasons and on a line of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_flydsl_indexer.tools.models import MODEL_SHAPES, REPORT_BLOCK_SIZES, REPORT_NEXT_NS

CHECKOUT_ENV = "VLLM_FLYDSL_INDEXER_AITER_CHECKOUT"
LD_LLD_ENV = "VLLM_FLYDSL_INDEXER_LD_LLD"
MIN_LLD_MAJOR = 19
TESTS = Path(__file__).resolve().parent
HELPER = TESTS / "real_wrapper" / "compile_config.py"
SRC = TESTS.parent / "src"
EM_AMDGPU = 224
EF_AMDGPU_MACH = 0x0FF
EF_AMDGPU_MACH_AMDGCN_GFX950 = 0x04F
# The code object's amdhsa.target: "amdgcn-amd-amdhsa--gfx950", or with the triple's
# environment spelled "unknown" (what flydsl 0.3.1-0.5.0 produce), features after a ':'.
AMDHSA_TARGET_GFX950 = re.compile(r"amdgcn-amd-amdhsa-(unknown)?-gfx950(:.*)?")
CALL_LABELS = ("first", "same shapes again", "other batch and length")
KNOWN_VARIANTS = ("general", "gfx950")
# The gfx950 wrapper must always get an explicit SplitKV from the router.
EXPLICIT_SPLIT_KV = ("gfx950",)
# Issue 43 dropped the early gfx950 revision and the padded-q one: identification refuses them in one line.
UNSUPPORTED = "this aiter revision is not supported: "
CHECKOUTS = [p for p in os.environ.get(CHECKOUT_ENV, "").split(os.pathsep) if p]

pytestmark = [
    pytest.mark.real_wrapper,
    pytest.mark.skipif(
        not os.environ.get(CHECKOUT_ENV),
        reason=f"opt-in: set {CHECKOUT_ENV} to an aiter checkout with the FlyDSL paged MQA logits kernel",
    ),
]

CONFIGS = [
    (m.label, m.heads, m.head_dim, block_size, next_n)
    for m in MODEL_SHAPES
    for block_size in REPORT_BLOCK_SIZES
    for next_n in REPORT_NEXT_NS
]


def _lld_major(path: str) -> int | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"LLD (\d+)", out)
    return int(match.group(1)) if match else None


def find_ld_lld() -> tuple[str | None, list[str]]:
    """An LLVM 19+ ``ld.lld``, and what was tried."""
    candidates = [os.environ.get(LD_LLD_ENV)]
    for root in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if root:
            candidates.append(os.path.join(root, "llvm", "bin", "ld.lld"))
    for major in range(30, MIN_LLD_MAJOR - 1, -1):
        candidates += [shutil.which(f"ld.lld-{major}"), f"/usr/lib/llvm-{major}/bin/ld.lld"]
    candidates.append(shutil.which("ld.lld"))
    tried = []
    for path in dict.fromkeys(c for c in candidates if c):
        if not os.path.isfile(path):
            continue
        major = _lld_major(path)
        if major is not None and major >= MIN_LLD_MAJOR:
            return path, tried
        tried.append(f"{path} (LLD {major})")
    return None, tried


@pytest.fixture(scope="module", params=CHECKOUTS, ids=[Path(p).name for p in CHECKOUTS])
def checkout(request) -> Path:
    path = Path(request.param).expanduser().resolve()
    if not (path / "aiter" / "ops" / "flydsl" / "kernels").is_dir():
        pytest.fail(f"{CHECKOUT_ENV}={path} is not an aiter checkout with aiter/ops/flydsl/kernels")
    return path


@pytest.fixture(scope="module")
def compile_env(tmp_path_factory) -> dict[str, str]:
    """The subprocess environment: compile-only for gfx950, a scratch ROCM_PATH holding ld.lld."""
    if importlib.util.find_spec("flydsl") is None:
        pytest.skip("flydsl is not installed here (pip install the flydsl version the aiter checkout pins)")
    lld, tried = find_ld_lld()
    if lld is None:
        pytest.skip(
            f"no LLVM {MIN_LLD_MAJOR}+ ld.lld found (set {LD_LLD_ENV}, or apt-get install lld-19); "
            f"tried: {', '.join(tried) or 'none present'}"
        )
    rocm = tmp_path_factory.mktemp("rocm")
    (rocm / "llvm" / "bin").mkdir(parents=True)
    (rocm / "llvm" / "bin" / "ld.lld").symlink_to(lld)
    # The kernels' defaults, not this shell's knobs (FlyDSL's and aiter's own variables).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLYDSL_", "AITER_"))}
    env.update(
        COMPILE_ONLY="1",
        ARCH="gfx950",
        FLYDSL_GPU_ARCH="gfx950",
        ROCM_PATH=str(rocm),
        # Prepended, not replaced: a flydsl (or torch) layered on PYTHONPATH stays the one imported.
        PYTHONPATH=os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    return env


def flydsl_here() -> str:
    """Where this process would import flydsl from (the helper's process must use the same)."""
    spec = importlib.util.find_spec("flydsl")
    return str(Path(spec.origin).resolve().parent) if spec and spec.origin else "?"


def flydsl_line(result: dict) -> str:
    used = result.get("flydsl") or {}
    return f"flydsl {used.get('version')} at {used.get('path')}"


@pytest.fixture(scope="module")
def run_config(checkout, compile_env, tmp_path_factory):
    """``run_config(heads, head_dim, block_size, next_n)``: the helper's report, once per config."""
    results: dict[tuple[int, ...], dict] = {}

    def run(heads: int, head_dim: int, block_size: int, next_n: int) -> dict:
        key = (heads, head_dim, block_size, next_n)
        if key not in results:
            env = dict(compile_env, FLYDSL_RUNTIME_CACHE_DIR=str(tmp_path_factory.mktemp("flydsl-cache")))
            proc = subprocess.run(
                [sys.executable, str(HELPER), str(checkout), *map(str, key)],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, (
                f"helper exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
            )
            results[key] = json.loads(lines[-1].removeprefix("RESULT "))
        return results[key]

    return run


def test_identifies_the_checkouts_flydsl_kernel(run_config, checkout, capsys):
    _, heads, head_dim, block_size, next_n = CONFIGS[0]
    result = run_config(heads, head_dim, block_size, next_n)
    used = flydsl_line(result)
    with capsys.disabled():  # one visible line per checkout, whatever pytest captures
        print(f"\n[real_wrapper] {checkout.name}: compiled by {used}")
    assert Path(result["flydsl"]["path"]).resolve() == Path(flydsl_here()), (
        f"the helper imported {used}, this process imports flydsl from {flydsl_here()}"
    )
    missing = [p for p in result["problems"] if "ModuleNotFoundError: No module named 'aiter." in p]
    if result["variant"] is None and str(result.get("unknown")).startswith(UNSUPPORTED):
        assert "the stock path is kept" in result["unknown"], result["unknown"]
        pytest.skip(f"{checkout}: {result['unknown']}")
    if result["variant"] is None and missing:
        pytest.skip(f"{checkout} cannot be imported whole (its kernel imports a missing module): {missing}")
    assert result["variant"] in KNOWN_VARIANTS, (
        f"identification.identify_flydsl found no FlyDSL kernel API it knows: {result.get('unknown')}; "
        f"probes: {result['problems']}; {used}"
    )
    assert Path(result["fn_file"]).resolve().is_relative_to(checkout), (
        f"the kernel came from {result['fn_file']}, not from {checkout}"
    )
    assert result["eligible"], f"the {result['variant']} kernel takes none of the model shapes ({used})"
    variant, location = result["variant"], result["location"]
    print(f"{checkout} ({used}): {variant} kernel at {location}, takes {result['eligible']}")


@pytest.mark.parametrize(
    "model,heads,head_dim,block_size,next_n",
    CONFIGS,
    ids=[f"H{h}-D{d}-KVB{b}-nn{n}" for _, h, d, b, n in CONFIGS],
)
def test_router_launch_compiles_once_for_gfx950(run_config, model, heads, head_dim, block_size, next_n):
    result = run_config(heads, head_dim, block_size, next_n)
    used = flydsl_line(result)
    if result["variant"] is None:
        pytest.skip(f"no kernel this package launches: {result.get('unknown')} ({used})")
    if result.get("ineligible"):
        pytest.skip(
            f"the {result['variant']} kernel does not take {model}'s shape: {result['ineligible']} "
            f"(flydsl {result['flydsl']['version']})"
        )
    calls, compiles, log = result["calls"], result["compiles"], result["log"]
    assert [c["label"] for c in calls] == list(CALL_LABELS), used
    assert result["router_failed"] is None, f"the wrapper raised ({used}): {result['router_failed']}\n{log}"
    assert [c["taken_so_far"] for c in calls] == [1, 2, 3], f"the router sent calls to stock ({used}): {log}"
    assert [c["delegated_so_far"] for c in calls] == [0, 0, 0], f"{used}: {log}"
    assert [c["kwargs"] for c in calls] == [[c["expected_kwargs"]] for c in calls], (
        f"the wrapper did not receive exactly the router's launch arguments ({used})"
    )
    if result["variant"] in EXPLICIT_SPLIT_KV:
        assert all(isinstance(c["expected_kwargs"].get("SplitKV"), int) for c in calls), (used, calls)
    assert result["router_compiled"], f"the router did not record the configuration as compiled ({used})"
    assert [c["compiles_so_far"] for c in calls] == [1, 1, 1], (
        f"{used} compiles after each call: {[c['compiles_so_far'] for c in calls]} (want one, on the first)"
    )
    (compiled,) = compiles
    assert compiled["objects"], f"the module {used} compiled holds no GPU object"
    for obj in compiled["objects"]:
        assert obj["elf"], f"{used} produced a GPU object that is no 64-bit little-endian ELF: {obj}"
        assert obj["e_machine"] == EM_AMDGPU, f"{used}: ELF e_machine {obj['e_machine']}, not AMDGPU: {obj}"
        assert obj["e_flags"] & EF_AMDGPU_MACH == EF_AMDGPU_MACH_AMDGCN_GFX950, (
            f"{used}: ELF e_flags {obj['e_flags']:#x}, not an AMDGCN gfx950 code object: {obj}"
        )
        targets = obj["amdhsa_targets"]
        assert targets and all(AMDHSA_TARGET_GFX950.fullmatch(t) for t in targets), (
            f"{used}: the code object's amdhsa.target is {targets}, not gfx950's: {obj}"
        )
    shape = f"{model} H{heads} D{head_dim} KVB{block_size} nn{next_n}"
    targets = sorted({t for obj in compiled["objects"] for t in obj["amdhsa_targets"]})
    kwargs = [c["kwargs"][0] for c in calls]
    print(f"{result['variant']} {shape} ({used}): {compiled['kernels']} -> {targets}, {kwargs}")
