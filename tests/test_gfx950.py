# SPDX-License-Identifier: Apache-2.0
"""The real thing, on an MI355X: real vLLM, real aiter Gluon and FlyDSL kernels.

Run there with ``pytest -m gfx950 -v``. Each test runs in a fresh interpreter
without the test doubles on its path, so it sees the machine's real amdsmi,
aiter and flydsl. Everywhere else these tests skip with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_flydsl_indexer import envs


def _on_gfx950() -> bool:
    if torch.version.hip is None or not torch.cuda.is_available():
        return False
    return "gfx950" in torch.cuda.get_device_properties(0).gcnArchName


pytestmark = [
    pytest.mark.gfx950,
    pytest.mark.skipif(
        not _on_gfx950(),
        reason="needs an AMD gfx950 GPU (MI355X) with ROCm vLLM and an aiter with PR #4221's FlyDSL kernel",
    ),
]


def real_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AMDSMI_DOUBLE")}
    env["VLLM_ROCM_USE_AITER"] = "1"
    env.update(extra)
    return env


def run(args: list[str], env: dict, timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def test_doctor_strict_says_flydsl_is_active():
    proc = run(
        [sys.executable, "-m", "vllm_flydsl_indexer", "doctor", "--strict"], real_env(**{envs.SWITCH: "1"})
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "arm:      FlyDSL" in proc.stdout


def test_check_real_kernels_agree():
    proc = run([sys.executable, "-m", "vllm_flydsl_indexer", "check", "--device", "cuda"], real_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "real kernels: aiter Gluon vs aiter FlyDSL" in proc.stdout
    assert (
        "stock:   vLLM's own vllm.v1.attention.ops.rocm_aiter_mla_sparse.rocm_fp8_paged_mqa_logits "
        in proc.stdout
    )
    assert "(aiter's Gluon kernel)" in proc.stdout
    assert "27 passed, 0 failed" in proc.stdout


END_TO_END = r"""
import torch
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm.v1.attention.ops.rocm_aiter_mla_sparse as t
from vllm.v1.worker.workspace import init_workspace_manager, current_workspace_manager
from vllm_flydsl_indexer import patch
from vllm_flydsl_indexer.tools.paths import call_site_in
from vllm_flydsl_indexer.selftest import read_window_ends
from vllm_flydsl_indexer.tools.harness import compare_in_windows
from vllm_flydsl_indexer.tools.models import eligible_configs
from vllm_flydsl_indexer.tools.reference import make_paged_problem

installed = patch.installed()
assert installed is not None, "plugin not active"
init_workspace_manager(torch.device("cuda"))
site = call_site_in(t)  # the defining module's own indexer call site
takes = {(h, d, b, n) for _, h, d, b, n in eligible_configs(installed.router.variant)}
for heads in (64, 32):
    for next_n in (1, 2):
        p = make_paged_problem(
            torch.randint(next_n, 8193, (16,)).tolist(), next_n=next_n, heads=heads, head_dim=128,
            block_size=64, preshuffle=True, max_model_len=8192,
            generator=torch.Generator().manual_seed(heads + next_n),
            device="cuda",
        )
        args = (p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, p.max_model_len)
        rows = p.batch * p.next_n
        def run(fn):
            (buf,) = current_workspace_manager().get_simultaneous(((rows, p.max_model_len), torch.float32))
            buf.fill_(float("nan"))
            return fn(*args).clone()
        taken = installed.router.calls_taken
        stock = run(installed.original)
        fly = run(lambda *a: site(t.rocm_fp8_paged_mqa_logits, a, {}))
        assert installed.router.calls_taken == taken + ((heads, 128, 64, next_n) in takes)
        res = compare_in_windows(stock, fly, read_window_ends(p.context_lens, rows, p.next_n))
        assert res.ok(1e-3), res.describe()
        # Graph capture of the patched call replays to the eager result.
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = site(t.rocm_fp8_paged_mqa_logits, args, {})
        g.replay()
        torch.cuda.synchronize()
        assert compare_in_windows(fly, out, read_window_ends(p.context_lens, rows, p.next_n)).ok(0)
print("END_TO_END_OK")
"""


def test_real_vllm_patched_call_agrees_and_captures():
    proc = run([sys.executable, "-c", END_TO_END], real_env(**{envs.SWITCH: "1"}))
    assert proc.returncode == 0 and "END_TO_END_OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_the_self_test_passes_on_real_kernels():
    """The runtime canary is gone (issue 43): the per-shape self-test, on by default, is what compares
    the real FlyDSL kernel with stock at each shape's first call; on the real kernels every one passes."""
    code = END_TO_END.replace(
        'print("END_TO_END_OK")',
        "assert installed.router.self_tests, 'no self-test ran'\n"
        "assert all(p is None for p in installed.router.self_tests.values()), installed.router.self_tests\n"
        "assert not installed.router.failed, installed.router.failed\n"
        'print("END_TO_END_OK")',
    )
    proc = run([sys.executable, "-c", code], real_env(**{envs.SWITCH: "1"}))
    assert proc.returncode == 0 and "END_TO_END_OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    assert "self-test failed" not in proc.stdout + proc.stderr


def test_tune_measures_deepseek_v32_buckets_once_and_caches_them(tmp_path):
    """Issue 44 for real: DeepSeek-V3.2's 64 heads have no table row, so `tune --model` times stock against
    aiter's FlyDSL kernels on this GPU, caches one aiter-format row per bucket, and a second run measures
    nothing."""
    import csv

    from vllm_flydsl_indexer.tools.tune_model import CACHED, MEASURED

    env = real_env(VLLM_CACHE_ROOT=str(tmp_path))
    env.pop(envs.TUNED_CSV, None)
    args = [sys.executable, "-m", "vllm_flydsl_indexer", "tune", "--model", "deepseek-ai/DeepSeek-V3.2"]
    first = run([*args, "--max-batch", "4"], env)
    assert first.returncode == 0, first.stdout + first.stderr[-4000:]
    assert first.stdout.count(MEASURED) == 3, first.stdout  # buckets 1, 2 and 4 at next_n 1
    (path,) = (tmp_path / "flydsl_indexer").glob("paged_mqa_logits_gfx950_*cu_*.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["batch_size"]) for r in rows) == [1, 2, 4] and {r["heads"] for r in rows} == {"64"}
    assert all(r["backend"] in ("gluon", "flydsl") and float(r["gluon_us"]) > 0 for r in rows)
    second = run([*args, "--max-batch", "4"], env)
    assert second.returncode == 0 and second.stdout.count(CACHED) == 3, second.stdout
    assert MEASURED not in second.stdout
