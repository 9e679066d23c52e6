# SPDX-License-Identifier: Apache-2.0
"""Run the plugin's router into a real aiter checkout's FlyDSL wrapper, compile-only, for gfx950.

Usage: ``python compile_config.py CHECKOUT HEADS HEAD_DIM KV_BLOCK_SIZE NEXT_N``

Run by ``tests/test_real_wrapper.py`` in a fresh interpreter with
``COMPILE_ONLY=1 ARCH=gfx950 FLYDSL_GPU_ARCH=gfx950``, ``ROCM_PATH`` holding an
LLVM 19+ ``llvm/bin/ld.lld`` and an empty ``FLYDSL_RUNTIME_CACHE_DIR``. Prints
one line ``RESULT {json}``: the kernel variant that :func:`kernels.identify`
finds in the checkout, then either why it does not take this configuration or
what three routed calls did (flydsl compiles counted, the target and ELF
header of every object produced, what the router did).

A fresh process per configuration: flydsl keys its in-process compile cache
on fewer things than the router's ``KernelConfig`` (the general kernel shares
one compiled launcher across ``next_n``), so "exactly once" is only
measurable from a clean state.

What is stubbed, and why (all of it here, none of it in the plugin):

* ``cutlass`` is hidden: flydsl's MLIR bindings abort the process when
  ``nvidia-cutlass-dsl`` (pulled in by the CPU vLLM wheel) loads in it too.
* ``aiter`` and ``aiter.ops.flydsl`` are bare packages over the checkout's
  directories, so their ``__init__`` files do not run: ``aiter/__init__.py``
  imports every C++/CK op (a ROCm JIT build), and ``aiter/ops/flydsl/__init__.py``
  re-exports every FlyDSL op, some of which import Triton. The kernel module
  and everything it imports below those packages are the checkout's own.
* ``aiter.jit.utils.chip_info`` is a module with only ``get_gfx()``, returning
  ``$ARCH``: the real one imports aiter's C++ build helpers, which read the
  ROCm install's version at import. The wrappers only ask it for the arch.
* ``aiter.ops.triton.utils.types`` is a module with only
  ``get_fp8_e4m3_dtype()``, returning what the real one returns for ``$ARCH``
  (``float8_e4m3fn`` on gfx950): the real one imports Triton and asks Triton's
  active GPU driver for the arch at import. The gfx950 wrappers only use it to
  check q's dtype. ``aiter.ops.triton`` and ``aiter.ops.triton.utils`` are bare
  packages, so a checkout's Triton ops never import.
* The CU count the router reads for its explicit SplitKV is an MI355X's (256),
  not the 1 a CPU tensor reports, so the launch arguments are the ones a
  gfx950 GPU would get (SplitKV is a runtime argument: the compile is the same).
* Without a CUDA/HIP torch, ``torch.cuda.current_stream()`` and
  ``torch.cuda.device(None)`` (the wrapper's launch context for CPU tensors)
  raise; they become the default stream (``None``, what flydsl launches on by
  default) and a null context. Neither changes what is compiled.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import os
import struct
import sys
import types

REQUIRED_ENV = {"COMPILE_ONLY": "1", "ARCH": "gfx950", "FLYDSL_GPU_ARCH": "gfx950"}
BATCH, MAX_MODEL_LEN = 4, 1024
MI355X_CUS = 256
# The third call: same KernelConfig, other batch, max_model_len and table width.
OTHER_BATCH, OTHER_MAX_MODEL_LEN = 7, 2048


class _HideCutlass(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cutlass" or name.startswith("cutlass."):
            raise ModuleNotFoundError(f"{name} is hidden from flydsl's process", name=name)
        return None


def _bare_package(name: str, directory: str) -> types.ModuleType:
    """``name`` as a package over ``directory`` whose ``__init__`` never runs."""
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [directory]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _stub_aiter(checkout: str) -> None:
    sys.path.insert(0, checkout)
    _bare_package("aiter", os.path.join(checkout, "aiter"))
    importlib.import_module("aiter.ops")
    _bare_package("aiter.ops.flydsl", os.path.join(checkout, "aiter", "ops", "flydsl"))
    utils = importlib.import_module("aiter.jit.utils")
    chip_info = types.ModuleType("aiter.jit.utils.chip_info")
    chip_info.get_gfx = lambda: os.environ["ARCH"]
    sys.modules[chip_info.__name__] = chip_info
    utils.chip_info = chip_info
    triton_dir = os.path.join(checkout, "aiter", "ops", "triton")
    _bare_package("aiter.ops.triton", triton_dir)
    triton_utils = _bare_package("aiter.ops.triton.utils", os.path.join(triton_dir, "utils"))
    dtypes = types.ModuleType("aiter.ops.triton.utils.types")
    dtypes.get_fp8_e4m3_dtype = _fp8_e4m3_dtype
    sys.modules[dtypes.__name__] = dtypes
    triton_utils.types = dtypes


def _fp8_e4m3_dtype():
    """aiter's ``get_fp8_e4m3_dtype()`` for ``$ARCH`` (its table: OCP e4m3 on gfx950/gfx12xx)."""
    import torch

    if os.environ["ARCH"] in ("gfx950", "gfx1250", "gfx1200", "gfx1201"):
        return torch.float8_e4m3fn
    return torch.float8_e4m3fnuz


def _stub_cuda_runtime() -> None:
    import contextlib

    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.current_stream = lambda device=None: None
    torch.cuda.device = lambda device: contextlib.nullcontext()


def _objects(module) -> list[dict]:
    """Every ``gpu.object`` of the compiled module: its target and ELF header."""
    from flydsl._mlir.dialects import gpu

    found = []
    for op in module.body.operations:
        if op.operation.name != "gpu.binary":
            continue
        for attr in op.attributes["objects"]:
            obj = gpu.ObjectAttr(attr)
            blob = obj.object
            elf = blob[:4] == b"\x7fELF" and len(blob) >= 52 and blob[4] == 2  # ELFCLASS64
            found.append(
                {
                    "target": str(obj.target),
                    "elf": elf,
                    "e_machine": struct.unpack_from("<H", blob, 18)[0] if elf else None,
                    "e_flags": struct.unpack_from("<I", blob, 48)[0] if elf else None,
                    "bytes": len(blob),
                }
            )
    return found


def _count_compiles(log: list[dict]) -> None:
    """Record every flydsl MLIR-to-binary compilation (the expensive step the router must not repeat)."""
    from flydsl.compiler import jit_function

    original = jit_function.MlirCompiler.compile.__func__

    def compile(cls, module, **kwargs):  # noqa: A001 - the name flydsl calls
        out = original(cls, module, **kwargs)
        log.append(
            {
                "arch": kwargs.get("arch"),
                "func_name": kwargs.get("func_name"),
                "kernels": sorted(set(_kernel_names(out))),
                "objects": _objects(out),
            }
        )
        return out

    jit_function.MlirCompiler.compile = classmethod(compile)


def _kernel_names(module) -> list[str]:
    import re

    asm = module.operation.get_asm(large_elements_limit=16)
    return re.findall(r'#gpu\.kernel_metadata<"([^"]+)"', asm)


def _find_variant(kernels):
    """The first FlyDSL kernel module of the checkout, identified by the plugin's own rules."""
    problems = []
    for path in kernels.KERNEL_MODULES:
        try:
            module = importlib.import_module(path)
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"{path}: {type(e).__name__}: {e}")
            continue
        fn = getattr(module, kernels.KERNEL_NAME, None)
        if not callable(fn):
            problems.append(f"{path}: no {kernels.KERNEL_NAME}")
            continue
        return kernels.identify(fn, module), problems
    return None, problems


def main(checkout: str, heads: int, head_dim: int, block_size: int, next_n: int) -> dict:
    wrong = {k: os.environ.get(k) for k, v in REQUIRED_ENV.items() if os.environ.get(k) != v}
    if wrong:
        raise SystemExit(f"refusing to run: need {REQUIRED_ENV}, have {wrong}")
    sys.meta_path.insert(0, _HideCutlass())
    _stub_aiter(checkout)
    _stub_cuda_runtime()
    compiles: list[dict] = []
    _count_compiles(compiles)

    import logging

    import torch

    from vllm_flydsl_indexer import kernels
    from vllm_flydsl_indexer.router import KernelConfig
    from vllm_flydsl_indexer.tools.arms import Arms, Workspace, from_defining_module, patched_call
    from vllm_flydsl_indexer.tools.models import eligible_configs
    from vllm_flydsl_indexer.tools.reference import gluon_contract_reference, make_paged_problem

    kernels._device_cu_count = lambda device_type, index: MI355X_CUS
    variant, problems = _find_variant(kernels)
    result: dict = {"problems": problems}
    if not isinstance(variant, kernels.KernelVariant):
        result["variant"] = None
        result["unknown"] = variant
        return result
    result.update(variant=variant.name, location=variant.location, fn_file=inspect.getsourcefile(variant.fn))
    # What the router hands the real wrapper, call by call (the wrapper itself runs unchanged).
    passed: list[dict] = []
    real_fn = variant.fn

    def recording(*args, **kwargs):
        passed.append(dict(kwargs))
        return real_fn(*args, **kwargs)

    variant = dataclasses.replace(variant, fn=recording)
    result["eligible"] = [list(c) for c in eligible_configs(variant)]
    index_dim = variant.limits.index_dim or head_dim + kernels.SCALE_BYTES
    reason = variant.limits.violation(heads, head_dim, block_size, index_dim, next_n)
    if reason is not None:
        result["ineligible"] = reason
        return result

    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname}: {record.getMessage()}")

    logger = logging.getLogger("vllm_flydsl_indexer.real_wrapper_test")
    logger.addHandler(Handler())
    logger.setLevel(logging.DEBUG)
    logger.propagate = False

    workspace = Workspace(OTHER_BATCH * next_n, OTHER_MAX_MODEL_LEN, torch.device("cpu"))
    arms = Arms(
        True, "real wrapper, compile-only", variant.location, gluon_contract_reference, variant.fn, variant
    )
    router = patched_call(arms, workspace, logger)
    call = from_defining_module(router)  # the audited call site: next_n > 1 may be taken
    gen = torch.Generator().manual_seed(heads * 1000 + block_size * 10 + next_n)

    def problem(batch: int, max_model_len: int):
        lens = torch.randint(next_n, max_model_len + 1, (batch,), generator=gen)
        lens[0] = max_model_len
        return make_paged_problem(
            lens.tolist(),
            next_n=next_n,
            heads=heads,
            head_dim=head_dim,
            block_size=block_size,
            preshuffle=block_size > 1,
            max_model_len=max_model_len,
            generator=gen,
        )

    calls = []
    first = problem(BATCH, MAX_MODEL_LEN)
    other = problem(OTHER_BATCH, OTHER_MAX_MODEL_LEN)
    for label, p in (("first", first), ("same shapes again", first), ("other batch and length", other)):
        before = len(passed)
        call(p.q_fp8, p.kv_cache, p.weights, p.context_lens, p.block_tables, None, p.max_model_len)
        calls.append(
            {
                "label": label,
                "kwargs": passed[before:],
                "expected_kwargs": variant.launch_kwargs(
                    p.batch, block_size, p.max_model_len, kernels.cu_count(p.q_fp8.device)
                ),
                "batch": p.batch,
                "max_model_len": p.max_model_len,
                "context_lens": list(p.context_lens.shape),
                "compiles_so_far": len(compiles),
                "taken_so_far": router.calls_taken,
                "delegated_so_far": router.calls_delegated,
            }
        )
    config = KernelConfig(heads, head_dim, block_size, next_n)
    result.update(
        calls=calls,
        compiles=compiles,
        router_compiled=config in router.compiled,
        router_failed=router.failed.get(config),
        launch_kwargs=[dict(route.kwargs) for route in router._routes.values() if route.config],
        log=records,
    )
    return result


if __name__ == "__main__":
    checkout, *numbers = sys.argv[1:]
    out = main(checkout, *(int(n) for n in numbers))
    print("RESULT " + json.dumps(out, default=str), flush=True)
