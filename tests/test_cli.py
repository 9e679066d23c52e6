# SPDX-License-Identifier: Apache-2.0
"""doctor, check and bench, on three simulated machines."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from conftest import DOUBLES, simulation_env
from vllm_flydsl_indexer import envs

CLI = [sys.executable, "-m", "vllm_flydsl_indexer"]


def cli(args, env, timeout=300):
    return subprocess.run(CLI + args, env=env, capture_output=True, text=True, timeout=timeout)


def no_vllm_env(**extra):
    env = simulation_env(rocm=False, aiter=False, **extra)
    env["PYTHONPATH"] = str(DOUBLES / "hide_vllm")
    return env


GATE_NAMES = ["switch", "vllm", "rocm", "gfx950", "kernel", "target"]


def test_doctor_on_simulated_gfx950_reports_flydsl_and_strict_passes():
    env = simulation_env(**{envs.SWITCH: "1"})
    text = cli(["doctor"], env)
    assert text.returncode == 0, text.stderr[-2000:]
    assert "arm:      FlyDSL" in text.stdout
    assert "FlyDSL paged MQA logits ACTIVE" in text.stdout
    data = json.loads(cli(["doctor", "--json"], env).stdout)
    assert [g["name"] for g in data["gates"]] == GATE_NAMES
    assert all(g["ok"] for g in data["gates"])
    assert data["arm"] == "flydsl" and data["platform"]["gcn_arch"] == "gfx950"
    assert data["versions"]["vllm"] == f"{importlib.metadata.version('vllm')} (vllm)"
    assert cli(["doctor", "--strict"], env).returncode == 0


def test_doctor_switch_off_on_gfx950_reports_every_gate_and_strict_fails():
    env = simulation_env(**{envs.SWITCH: "maybe"})
    data = json.loads(cli(["doctor", "--json"], env).stdout)
    assert data["arm"] == "stock"
    assert data["switch"] == {
        "name": envs.SWITCH,
        "value": "maybe",
        "parsed": False,
        "enabled": False,
        "error": data["switch"]["error"],
    }
    assert "1/0/true/false" in data["switch"]["error"]
    assert [g["ok"] for g in data["gates"]] == [False, True, True, True, True, True]
    strict = cli(["doctor", "--strict"], env)
    assert strict.returncode == 1 and "would not be active" in strict.stderr


def test_doctor_with_vllm_but_not_rocm():
    env = simulation_env(rocm=False, aiter=False, **{envs.SWITCH: "1"})
    data = json.loads(cli(["doctor", "--json"], env).stdout)
    assert data["arm"] == "stock"
    assert data["reason"].startswith("not ROCm")
    assert data["platform"]["gcn_arch"] is None
    assert cli(["doctor"], env).returncode == 0
    assert cli(["doctor", "--strict"], env).returncode == 1


def test_doctor_without_vllm():
    env = no_vllm_env(**{envs.SWITCH: "1"})
    text = cli(["doctor"], env)
    assert text.returncode == 0, text.stderr[-2000:]
    data = json.loads(cli(["doctor", "--json"], env).stdout)
    assert data["versions"]["vllm"] == "not installed"
    assert data["versions"]["aiter"] == "not installed"
    assert data["platform"]["vllm_platform"] == "vLLM not installed"
    assert data["reason"] == "vLLM is not installed"
    assert cli(["doctor", "--strict"], env).returncode == 1


@pytest.mark.parametrize("machine", ["gfx950-sim", "no-rocm", "no-vllm"])
def test_check_passes_with_reference_arms_and_says_so(machine):
    env = {"gfx950-sim": simulation_env(), "no-rocm": simulation_env(rocm=False), "no-vllm": no_vllm_env()}[
        machine
    ]
    proc = cli(["check", "--batch", "2", "--context-len", "512"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "reference contracts (pure torch; NOT the real kernels)" in proc.stdout
    stock = {
        "gfx950-sim": "stock:   vLLM's own vllm.v1.attention.ops.rocm_aiter_mla_sparse.rocm_fp8_paged_mqa",
        "no-rocm": "stock:   the mirror of vLLM 0.33.0's gfx950 branches (vLLM does not report gfx950",
        "no-vllm": "stock:   the mirror of vLLM 0.33.0's gfx950 branches (vLLM unavailable",
    }[machine]
    assert stock in proc.stdout
    assert "22 passed, 0 failed" in proc.stdout
    assert proc.stdout.count("PASS") == 22
    assert "check [" in proc.stderr  # progress bar


def test_check_fails_on_disagreement(monkeypatch, capsys):
    """A FlyDSL arm that is wrong must turn check red."""
    from vllm_flydsl_indexer import arms, check
    from vllm_flydsl_indexer import cli as cli_mod

    real_detect = arms.detect_arms

    def wrong(*a, **k):
        out = arms.flydsl_contract_reference(*a, **k)
        out.add_(1.0)
        return out

    def detect(device, force_reference=False):
        found = real_detect(device, force_reference)
        found.flydsl = wrong
        return found

    monkeypatch.setattr(check, "detect_arms", detect)
    rc = cli_mod.main(
        [
            "check",
            "--batch",
            "2",
            "--context-len",
            "256",
            "--model",
            "glm-5",
            "--next-n",
            "2",
            "--block-size",
            "64",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr()
    assert rc == 1
    assert "FAIL GLM-5.x/DSV4.1 KVB=64 preshuffle next_n=2" in out.out


def test_bench_cpu_reference_arms_json_csv(tmp_path):
    j, c = tmp_path / "b.json", tmp_path / "b.csv"
    proc = cli(
        [
            "bench",
            "--batch",
            "2",
            "--context-len",
            "1024",
            "--heads",
            "32",
            "--next-n",
            "2",
            "--block-size",
            "64",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--json",
            str(j),
            "--csv",
            str(c),
        ],
        no_vllm_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(j.read_text())
    arms_run = {r["arm"]: r for r in data["results"]}
    assert set(arms_run) == {"stock-call[ref]", "patched-call[ref]", "reference"}
    for r in arms_run.values():
        assert r["status"] == "timed"
        assert 0 < r["min_us"] <= r["median_us"] <= r["max_us"]
        assert r["kv_mb"] == pytest.approx(2 * 1024 * 132 / 1e6)
    assert data["meta"]["device"] == "cpu"
    assert c.read_text().count("\n") == 4


def test_bench_skips_pools_over_two_gib():
    from vllm_flydsl_indexer.bench import Shape

    assert Shape(64, 128, 64, 1, 128, 131072).pool_bytes() >= 2**31
    assert Shape(64, 128, 64, 1, 32, 131072).pool_bytes() < 2**31


def test_python_m_entry_and_console_script_agree():
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-flydsl-indexer")
    a = subprocess.run([exe, "doctor", "--json"], env=no_vllm_env(), capture_output=True, text=True)
    b = cli(["doctor", "--json"], no_vllm_env())
    assert a.returncode == b.returncode == 0
    assert json.loads(a.stdout)["reason"] == json.loads(b.stdout)["reason"]
