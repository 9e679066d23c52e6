# SPDX-License-Identifier: Apache-2.0
"""Run the plugin's router into a real aiter checkout's FlyDSL wrapper, compile-only, for gfx950.

Usage: ``python compile_config.py CHECKOUT HEADS HEAD_DIM KV_BLOCK_SIZE NEXT_N``

Run by ``tests/test_real_wrapper.py`` in a fresh interpreter with
``COMPILE_ONLY=1 ARCH=gfx950 FLYDSL_GPU_ARCH=gfx950``, ``ROCM_PATH`` holding an
LLVM 19+ ``llvm/bin/ld.lld`` and an empty ``FLYDSL_RUNTIME_CACHE_DIR``. Prints
one line ``RESULT {json}``: the kernel variant that :func:`identification.identify`
finds in the checkout and which flydsl (version and path) this process
imported, then either why it does not take this configuration or what three
routed calls did (flydsl compiles counted, what every code object produced
says it targets, what the router did).

The target is read from the code object itself, not from what flydsl was
asked for: its ELF header (``e_machine``, the ``EF_AMDGPU_MACH`` bits of
``e_flags``, the OS ABI) and the ``amdhsa.target`` string of its
``NT_AMDGPU_METADATA`` note, with the standard library only. The objects come
from the module ``flydsl.compiler.jit_function.MlirCompiler.compile`` returns:
each ``gpu.binary``'s ``gpu.object`` bytes, which flydsl's own loader reads
too. That classmethod exists in flydsl 0.3.1, 0.4.2 and 0.5.0, with other
arguments each time (0.3.1 and 0.4.2 ``compile(module, *, arch, func_name,
link_libs)``, 0.5.0 ``compile(asm, *, func_name, config)``), so the hook
passes whatever it gets through unread.

A fresh process per configuration: flydsl keys its in-process compile cache
on fewer things than the router's shape ``(heads, head_dim, KVBlockSize, next_n)`` (the general kernel shares
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
# The third call: same shape, other batch, max_model_len and table width.
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


NT_AMDGPU_METADATA = 32
SHT_NOTE, PT_NOTE = 7, 4


def _msgpack_str(data: bytes, at: int) -> str | None:
    """The msgpack string starting at ``data[at]`` (fixstr, str8/16/32), else ``None``."""
    if at >= len(data):
        return None
    tag = data[at]
    if 0xA0 <= tag <= 0xBF:
        size, start = tag & 0x1F, at + 1
    elif tag in (0xD9, 0xDA, 0xDB):
        width = {0xD9: 1, 0xDA: 2, 0xDB: 4}[tag]
        if at + 1 + width > len(data):
            return None
        size, start = int.from_bytes(data[at + 1 : at + 1 + width], "big"), at + 1 + width
    else:
        return None
    raw = data[start : start + size]
    return raw.decode("utf-8", "replace") if len(raw) == size else None


def _notes(blob: bytes, ranges) -> list[tuple[str, int, bytes]]:
    """``(name, type, desc)`` of every ELF note in the byte ranges (4-byte aligned, as AMDGPU's)."""
    found = []
    for offset, size in ranges:
        at, end = offset, min(offset + size, len(blob))
        while at + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", blob, at)
            name_at = at + 12
            desc_at = name_at + (namesz + 3) // 4 * 4
            if desc_at + descsz > end:
                break
            name = blob[name_at : name_at + namesz].rstrip(b"\0").decode("ascii", "replace")
            found.append((name, ntype, blob[desc_at : desc_at + descsz]))
            at = desc_at + (descsz + 3) // 4 * 4
    return found


def code_object(blob: bytes) -> dict:
    """What an AMDGPU code object says it targets: its ELF header and ``amdhsa.target``.

    Standard library only. ``amdhsa.target`` is read from the msgpack map of
    the ``AMDGPU`` note of type ``NT_AMDGPU_METADATA`` (code object v3+); the
    key is found by its encoding, the value decoded as a msgpack string.
    """
    info: dict = {"bytes": len(blob), "elf": False}
    if not (blob[:4] == b"\x7fELF" and len(blob) >= 64 and blob[4] == 2 and blob[5] == 1):
        info["head"] = blob[:16].hex()
        return info  # only a 64-bit little-endian ELF can be an AMDGPU code object
    e_machine = struct.unpack_from("<H", blob, 18)[0]
    e_flags = struct.unpack_from("<I", blob, 48)[0]
    e_phoff, e_shoff = struct.unpack_from("<QQ", blob, 32)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", blob, 54)
    ranges = set()
    for i in range(e_shnum if e_shentsize >= 64 else 0):
        sh = e_shoff + i * e_shentsize
        if sh + 64 <= len(blob) and struct.unpack_from("<I", blob, sh + 4)[0] == SHT_NOTE:
            ranges.add(struct.unpack_from("<QQ", blob, sh + 24))  # sh_offset, sh_size
    for i in range(e_phnum if e_phentsize >= 56 else 0):
        ph = e_phoff + i * e_phentsize
        if ph + 56 <= len(blob) and struct.unpack_from("<I", blob, ph)[0] == PT_NOTE:
            offset, _, _, filesz = struct.unpack_from("<QQQQ", blob, ph + 8)
            ranges.add((offset, filesz))
    targets = []
    notes = _notes(blob, sorted(ranges))
    for name, ntype, desc in notes:
        if name != "AMDGPU" or ntype != NT_AMDGPU_METADATA:
            continue
        key = bytes([0xA0 | len("amdhsa.target")]) + b"amdhsa.target"
        at = desc.find(key)
        while at >= 0:
            value = _msgpack_str(desc, at + len(key))
            if value is not None:
                targets.append(value)
            at = desc.find(key, at + 1)
    info.update(
        elf=True,
        e_machine=e_machine,
        e_flags=e_flags,
        ei_osabi=blob[7],  # 64: ELFOSABI_AMDGPU_HSA
        ei_abiversion=blob[8],  # 2, 3, 4: code object v4, v5, v6
        notes=sorted({f"{name}:{ntype}" for name, ntype, _ in notes}),
        amdhsa_targets=sorted(set(targets)),
    )
    return info


def _objects(module) -> list[dict]:
    """Every ``gpu.object`` of the compiled module: what its code object says it targets."""
    from flydsl._mlir.dialects import gpu

    found = []
    for op in module.body.operations:
        if op.operation.name != "gpu.binary":
            continue
        for attr in op.attributes["objects"]:
            obj = gpu.ObjectAttr(attr)
            # The MLIR target attribute only says what flydsl asked for; reported, not trusted.
            found.append({"requested": str(obj.target), **code_object(obj.object)})
    return found


def _count_compiles(log: list[dict]) -> None:
    """Record every flydsl MLIR-to-binary compilation (the expensive step the router must not repeat)."""
    from flydsl.compiler import jit_function

    original = jit_function.MlirCompiler.compile.__func__

    def compile(cls, *args, **kwargs):  # noqa: A001 - the name flydsl calls; its arguments differ by version
        out = original(cls, *args, **kwargs)
        log.append(
            {
                "func_name": kwargs.get("func_name"),
                "kernels": sorted(set(_kernel_names(out))),
                "objects": _objects(out),
            }
        )
        return out

    jit_function.MlirCompiler.compile = classmethod(compile)


def _flydsl() -> dict:
    """The flydsl this process imported: the one that compiles."""
    import flydsl

    try:
        from importlib.metadata import version

        dist = version("flydsl")
    except Exception:  # noqa: BLE001 - reported as unknown
        dist = None
    return {
        "version": getattr(flydsl, "__version__", None) or dist,
        "path": os.path.dirname(os.path.abspath(flydsl.__file__)),
    }


def _kernel_names(module) -> list[str]:
    import re

    asm = module.operation.get_asm(large_elements_limit=16)
    return re.findall(r'#gpu\.kernel_metadata<"([^"]+)"', asm)


def _find_variant():
    """The first FlyDSL kernel module of the checkout, identified by the plugin's own rules."""
    from vllm_flydsl_indexer import kernels as identification

    problems = []
    for path in identification.KERNEL_MODULES:
        try:
            module = importlib.import_module(path)
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"{path}: {type(e).__name__}: {e}")
            continue
        fn = getattr(module, identification.KERNEL_NAME, None)
        if not callable(fn):
            problems.append(f"{path}: no {identification.KERNEL_NAME}")
            continue
        return identification.identify_flydsl(fn, module, f"{path}.{identification.KERNEL_NAME}"), problems
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
    used = _flydsl()

    import logging

    import torch

    from vllm_flydsl_indexer import kernels
    from vllm_flydsl_indexer.tools.arms import Arms, Workspace, from_defining_module, patched_call
    from vllm_flydsl_indexer.tools.models import eligible_configs
    from vllm_flydsl_indexer.tools.reference import gluon_contract_reference, make_paged_problem

    kernels._cu_count = lambda device_type, index: MI355X_CUS  # what kernels.cu_count reads
    variant, problems = _find_variant()
    result: dict = {"problems": problems, "flydsl": used}
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
    index_dim = variant.index_dim or head_dim + kernels.SCALE_BYTES
    reason = variant.shape_violation(heads, head_dim, block_size, index_dim, next_n)
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
    # Compile-only launches nothing, so the router's self-test would compare an unwritten buffer with
    # stock's answer and keep every configuration stock: it is off here (its own tests cover it).
    router.self_test = False
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
    shape = (heads, head_dim, block_size, next_n)  # the router's shape: what FlyDSL compiles
    result.update(
        calls=calls,
        compiles=compiles,
        router_compiled=shape in router.compiled,
        router_failed=router.failed.get(shape),
        launch_kwargs=[dict(route.kwargs) for route in router.routes.values() if route.shape],
        log=records,
    )
    return result


if __name__ == "__main__":
    checkout, *numbers = sys.argv[1:]
    out = main(checkout, *(int(n) for n in numbers))
    print("RESULT " + json.dumps(out, default=str), flush=True)
