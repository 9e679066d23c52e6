# SPDX-License-Identifier: Apache-2.0
"""Test double of "a machine without vLLM": vllm cannot be imported or found."""

import importlib.abc
import importlib.metadata
import sys


class _HideVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _HideVllm())
_version = importlib.metadata.version


def _hidden_version(name):
    if name.lower() == "vllm":
        raise importlib.metadata.PackageNotFoundError(name)
    return _version(name)


importlib.metadata.version = _hidden_version
