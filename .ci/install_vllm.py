#!/usr/bin/env python3
"""Install one vLLM release into the active environment, even where one of its pins is not served.

Usage: ``python .ci/install_vllm.py VERSION``

vLLM 0.34.0 pins ``flashinfer-python==0.7.3`` (a CUDA-only package nothing here
imports), and this machine's package registry does not serve that version, so a
plain ``pip install vllm==0.34.0`` fails. This script reads the release's own
requirements from its wheel's metadata, installs them, and drops a requirement
only when pip says no distribution matches it (named on one line); then it
installs vLLM itself with ``--no-deps``. Once every pin is served, nothing is
dropped and the result equals a plain install.
"""

from __future__ import annotations

import email
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NO_MATCH = re.compile(r"No matching distribution found for ([^\s;]+)")
MAX_DROPS = 5


def pip(*args: str, capture: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", *args]
    return subprocess.run(cmd, text=True, capture_output=capture, check=False)


def project(requirement: str) -> str:
    """The normalised project name of a requirement string."""
    return re.split(r"[<>=!~\[;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` entries, without those of optional extras."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(name))
    return [r for r in meta.get_all("Requires-Dist", []) if "extra ==" not in r]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not re.fullmatch(r"\d+\.\d+\.\d+", argv[0]):
        print("usage: install_vllm.py VERSION (e.g. 0.34.0)", file=sys.stderr)
        return 2
    version = argv[0]
    with tempfile.TemporaryDirectory() as tmp:
        if pip("download", "-q", "--no-deps", f"vllm=={version}", "-d", tmp).returncode:
            return 1
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        reqs = requirements(wheel)
        dropped: list[str] = []
        for _ in range(MAX_DROPS + 1):
            listing = Path(tmp) / "requirements.txt"
            listing.write_text("\n".join(reqs) + "\n")
            done = pip("install", "-q", "-r", str(listing), capture=True)
            if done.returncode == 0:
                break
            missing = NO_MATCH.search(done.stderr)
            if missing is None or len(dropped) == MAX_DROPS:
                sys.stderr.write(done.stdout + done.stderr)
                return 1
            spec = missing.group(1)
            kept = [r for r in reqs if project(r) != project(spec)]
            if len(kept) == len(reqs):
                sys.stderr.write(done.stdout + done.stderr)
                return 1
            reqs = kept
            dropped.append(spec)
            print(f"install_vllm: vLLM {version} requires {spec}, which the registry does not serve: dropped")
        if pip("install", "-q", "--no-deps", str(wheel)).returncode:
            return 1
    print(f"install_vllm: vLLM {version} installed" + (f" without {', '.join(dropped)}" if dropped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
