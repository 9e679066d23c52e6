# SPDX-License-Identifier: Apache-2.0
"""``vllm-flydsl-indexer doctor``: which arm this machine runs, and why.

It evaluates the same gates as ``register()``, in the same order and with the
same wording, and never raises: every probe failure becomes a line.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import stat
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from vllm_flydsl_indexer import envs, gates, measure, tuning
from vllm_flydsl_indexer.kernels import (
    AITER_DISTRIBUTIONS,
    BLOCK_OUTER_NOTE,
    KernelVariant,
    installed_version,
)
from vllm_flydsl_indexer.tools import files, tuned
from vllm_flydsl_indexer.tools.models import (
    MODEL_SHAPES,
    REPORT_BLOCK_SIZES,
    REPORT_NEXT_NS,
    eligible_configs,
)
from vllm_flydsl_indexer.tools.streams import safe_line, shown

__all__ = [
    "CACHE_ROOT",
    "NOT_INSTALLED",
    "PACKAGES",
    "RAY_NON_CARRY_OVER_FILE",
    "cache_dir",
    "cache_dir_problem",
    "cache_root_named",
    "describe",
    "flydsl_requirement_report",
    "kernel_report",
    "layout_report",
    "main",
    "node_cache_report",
    "package_version",
    "platform_report",
    "ray_non_carry_over_report",
    "register_line",
    "render",
    "render_node_cache",
    "report",
    "stock_report",
    "table_report",
]

NOT_INSTALLED = "not installed"
# vLLM's KV cache layouts with the block dimension outside the layer dimension
# (vllm/v1/kv_cache_layout.py; tests/test_drift.py pins them), and the variable that picks one.
BLOCK_OUTER_LAYOUTS = ("BLHNC", "BLNHC", "BHLNC")
LAYOUT_VARIABLE = "VLLM_KV_CACHE_LAYOUT"
# Distribution names to read versions from, first found wins.
PACKAGES = {
    "torch": ("torch",),
    "vllm": ("vllm",),
    "aiter": AITER_DISTRIBUTIONS,
    "flydsl": ("flydsl",),
    "triton": ("triton", "pytorch-triton-rocm"),
}


def package_version(dists: tuple[str, ...]) -> str:
    for dist in dists:
        try:
            return f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return NOT_INSTALLED


def platform_report() -> dict[str, Any]:
    """The platform and arch as vLLM sees them; never raises."""
    if gates.vllm_version() is None:
        return {"vllm_platform": "vLLM not installed", "gcn_arch": None}
    try:
        from vllm.platforms import current_platform

        name = type(current_platform).__name__
        arch = None
        if current_platform.is_rocm():
            from vllm.platforms.rocm import _GCN_ARCH

            arch = str(_GCN_ARCH)
        return {"vllm_platform": name, "gcn_arch": arch}
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        return {"vllm_platform": f"unavailable ({type(e).__name__}: {e})", "gcn_arch": None}


def kernel_report(variant: KernelVariant | None) -> dict[str, Any] | None:
    """The identified FlyDSL API and which model indexer shapes it would take."""
    if variant is None:
        return None
    takes = {(m, b, n) for m, _, _, b, n in eligible_configs(variant)}
    return {
        "variant": variant.name,
        "own_table": variant.own_table,
        "description": variant.description,
        "location": variant.location,
        "shapes": [
            {
                "model": m.label,
                "heads": m.heads,
                "head_dim": m.head_dim,
                "kv_block_size": block_size,
                "next_n": next_n,
                "flydsl": (m.label, block_size, next_n) in takes,
            }
            for m in MODEL_SHAPES
            for block_size in REPORT_BLOCK_SIZES
            for next_n in REPORT_NEXT_NS
        ],
    }


def table_report(decision: gates.Decision, environ: dict[str, str] | None) -> dict[str, Any]:
    """The tuned table the plugin would use here, where it comes from, what it picks, and why each row it
    skips is refused (the plugin reads leniently; this is the validator's word on every cell)."""
    if decision.variant is not None and decision.variant.own_table:
        note = "aiter's dispatcher decides with its own tuned table"
        return {"source": None, "origin": "dispatcher", "note": note}
    env = os.environ if environ is None else environ
    sources = tuning.sources(env.get(envs.TUNED_CSV), decision.variant.name if decision.variant else None)
    gfx = tuning.arch_of(decision.gcn_arch or gates.gcn_arch() or "") or "this machine (no ROCm arch)"
    ignored: list[dict[str, Any]] = []
    for path, origin, label in sources:
        if path is None:
            first = ignored[0] if ignored else {"source": None, "origin": origin, "note": label}
            return {**first, "in_use": label, "ignored": ignored}
        table = tuning.read(path, gfx, origin)  # the plugin's own reader: never raises
        if not isinstance(table, str):
            break
        name = tuning.BUILTIN_LABEL if origin == "built-in" else path  # as the reader names a table
        # Each row the plugin could not use, with its line, column and reason, as for a table in use.
        rows = [why for why in tuned.row_problems(path) if why.startswith(f"{path}: line ")]
        note = f"IGNORED: {table}; next source tried"
        ignored.append({"source": name, "origin": origin, "note": note, "skipped": rows})
    skipped = tuned.row_problems(path) if table.skipped else []
    shapes = describe(table)
    for shape in shapes:
        for bucket in shape["buckets"]:
            knob = bucket.get("wg_per_cu")
            problem = decision.variant.knob_problem(knob) if decision.variant and knob else None
            if problem is not None:
                bucket["arm"] = "stock"
                bucket["why"] = f"the found kernel cannot take {problem}"
    cus = _gpu_cu_count()
    if cus is None:
        applies = f"no GPU here: the rows apply on a {gfx} GPU of {_cu_list(table)} CUs"
    elif cus in table.cu_counts():
        applies = f"applies: this GPU has {cus} CUs"
    else:
        applies = (
            f"does NOT apply here: this GPU has {cus} CUs, the rows are for {_cu_list(table)}; "
            "every shape goes to this node's cache or measurement, else stock"
        )
    return {
        "source": table.name,
        "origin": origin,
        "label": label,
        "gfx": gfx,
        "rows": sum(len(rows) for buckets in table.shapes.values() for rows in buckets.values()),
        "skipped": skipped,
        "cu_here": cus,
        "applies": applies,
        "shapes": shapes,
        "note": "in use",
        "in_use": label,
        "ignored": ignored,
    }


CACHE_ROOT = "VLLM_CACHE_ROOT"
# A node cache file's name (measure.cache_path): gfx, CU count, the first 16 hex digits of its key's sha256.
CACHE_NAME = re.compile(r"paged_mqa_logits_(\w+?)_(\d+)cu_([0-9a-f]{16})\.csv")


def cache_root_named(environ: dict[str, str] | None = None) -> str:
    """``VLLM_CACHE_ROOT`` as a line names it: its value escaped and shortened, or that it is unset or
    empty (vLLM reads an empty one as the current directory; the plugin as unset, never wherever a process
    starts)."""
    raw = (os.environ if environ is None else environ).get(CACHE_ROOT)
    if raw is None:
        return f"{CACHE_ROOT} is not set"
    if not raw:
        return f"{CACHE_ROOT} is empty (vLLM reads that as the current directory; the plugin as unset)"
    return f"{CACHE_ROOT}={shown(raw)}"


def cache_dir(environ: dict[str, str] | None = None) -> tuple[Path | None, str | None]:
    """The node cache's directory, or ``(None, why)`` when the cache root cannot even be named (a ``~user``
    that does not exist); the reason names ``VLLM_CACHE_ROOT``."""
    try:
        return envs.cache_root(environ) / measure.CACHE_DIR, None
    except (OSError, RuntimeError, KeyError) as e:
        return None, f"{cache_root_named(environ)}: {type(e).__name__}: {e}"


def cache_dir_problem(directory: Path, make: bool, environ: dict[str, str] | None = None) -> str | None:
    """Why the node cache cannot be written in ``directory``, naming ``VLLM_CACHE_ROOT``, else ``None``.

    Judged as :func:`measure.write_cache` writes: ``make`` creates the directory as it does (``tune``,
    about to write); otherwise (``doctor``) nothing is created where it is missing and the nearest existing
    parent must be a directory this user can write. An existing one must be this user's, writable by no
    one else, and take a temporary file (made and removed at once). Never raises."""
    why = None
    try:
        if make:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for place in (directory, *directory.parents):
            try:
                os.lstat(place)
            except FileNotFoundError:
                continue
            info = os.stat(place)  # a dangling link or a loop raises here
            if not stat.S_ISDIR(info.st_mode):
                why = f"{place} is not a directory"
            elif place != directory:
                access = os.access(place, os.W_OK | os.X_OK)
                why = None if access else f"{place} is not writable, so {directory} cannot be made"
            else:
                why = measure.private_dir_problem(directory)  # the writer's own rule and words
                if why is None:
                    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
                    os.close(handle)
                    os.unlink(temporary)
            break
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    return None if why is None else f"{why} ({cache_root_named(environ)})"


def _this_gpu_key() -> tuple[str, int, str] | None:
    """``(gfx, CUs, key line)`` of the node cache this GPU's plugin reads, or ``None`` without a ROCm GPU
    (the key then is unknown: each file is judged by its own key line)."""
    cus = _gpu_cu_count()
    try:
        import torch

        if cus is None or torch.version.hip is None:
            return None
        device = torch.device("cuda", 0)
        gfx = tuning.arch_of(torch.cuda.get_device_properties(device).gcnArchName)
        key = measure.cache_key(device, gfx, cus)
        return None if key is None else (gfx, cus, key)
    except Exception:  # noqa: BLE001 - doctor reports, never crashes
        return None


def _cache_file_report(path: Path, here: tuple[str, int, str] | None) -> dict[str, Any]:
    """One node cache file as the plugin would read it: its key line, its usable rows, and the WARNING
    texts the plugin logs for it (:func:`measure.load_cache`'s own words)."""
    entry: dict[str, Any] = dict(path=str(path), key=None, usable_rows=0, problems=[], read_here=None)
    named = CACHE_NAME.fullmatch(path.name)
    gfx, cus, digest = (named.group(1), int(named.group(2)), named.group(3)) if named else ("", 0, "")
    if here is not None:
        entry["read_here"] = measure.cache_path(here[0], here[1], here[2]).name == path.name
    try:
        head = tuning.read_capped(str(path)).partition("\n")[0]
    except Exception:  # noqa: BLE001 - load_cache below says why, in the plugin's words
        head = None
    if entry["read_here"]:
        key = here[2]
    elif head is not None and hashlib.sha256(head.encode()).hexdigest()[:16] == digest:
        key = head  # the key of the stack whose plugin reads this file
    else:
        key = "\n"  # no key line names this file: whichever plugin reads it finds another stack's
    rows, problems = measure.load_cache(path, key, gfx, cus)
    if head is not None:
        entry["key"] = head.removeprefix(measure.KEY_PREFIX)
    entry["usable_rows"], entry["problems"] = len(rows), problems
    return entry


def node_cache_report(environ: dict[str, str] | None) -> dict[str, Any]:
    """What decides the shapes no table covers: this node's cache, file by file as the plugin reads it,
    whether the cache can be written at all, and the measurement."""
    env = os.environ if environ is None else environ
    off = (env.get(envs.TUNED_CSV) or "").strip().lower() in tuning.OFF_VALUES
    tune, error = envs.read_flag(envs.TUNE, env, default=True)
    if off:
        value = (env.get(envs.TUNED_CSV) or "").strip()
        decides = f"no table ({envs.TUNED_CSV}={value}): FlyDSL wherever eligible, nothing measured"
    elif tune:
        decides = "this node's cache, else measured at the bucket's first eager call (stock until then)"
    else:
        decides = f"this node's cache, else stock ({envs.TUNE}=0)"
    data: dict[str, Any] = {"dir": None, "files": [], "uncovered_shapes": decides, "error": error}
    data["in_use"] = not off  # the plugin reads and writes it (a dispatcher aside: the tuned table says)
    data["root"] = cache_root_named(environ)
    directory, why = cache_dir(environ)
    if directory is None:
        return data | {"unwritable": why, "root_problem": why}
    data["dir"] = str(directory)
    data["unwritable"] = cache_dir_problem(directory, make=False, environ=environ)
    data["root_problem"] = None
    try:
        paths = sorted(directory.glob("paged_mqa_logits_*.csv")) if os.path.lexists(directory) else []
        if paths or os.path.lexists(directory):
            os.listdir(directory)  # what the glob above swallows (a loop, a file, no permission) raises here
    except OSError as e:
        data["root_problem"] = f"{type(e).__name__}: {e} ({data['root']})"
        paths = []
    here = _this_gpu_key()
    data["files"] = [_cache_file_report(path, here) for path in paths]
    return data


def describe(table: tuning.TunedTable) -> list[dict[str, object]]:
    """Per shape and CU count, the arm (and FlyDSL knob) of each batch bucket."""
    out = []
    for (cus, next_n, heads, head_dim, block_size), buckets in sorted(table.shapes.items()):
        entries = []
        for batch in sorted(buckets):
            backend, _, wg_per_cu, conflict = table.choice(cus, batch, next_n, heads, head_dim, block_size)
            arm = backend if backend == "flydsl" and conflict is None else "stock"
            entry: dict[str, object] = {"batch_at_least": batch, "arm": arm}
            if backend == "flydsl":
                entry["wg_per_cu"] = wg_per_cu
            entries.append(entry)
        shape = {"cu_num": cus, "next_n": next_n, "heads": heads, "head_dim": head_dim}
        out.append({**shape, "kv_block_size": block_size, "preshuffle": block_size > 1, "buckets": entries})
    return out


def _cu_list(table: tuning.TunedTable) -> str:
    return "/".join(str(c) for c in sorted(table.cu_counts()))


def _gpu_cu_count() -> int | None:
    """This machine's GPU CU count (device 0), as the router reads it; ``None`` without a GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from vllm_flydsl_indexer.kernels import cu_count

        return cu_count(torch.device("cuda", 0))
    except Exception:  # noqa: BLE001 - doctor reports, never crashes
        return None


def layout_report(environ: dict[str, str] | None) -> dict[str, Any]:
    """What vLLM's KV cache layout means for FlyDSL, and whether this environment forces a bad one."""
    env = os.environ if environ is None else environ
    value = env.get(LAYOUT_VARIABLE) or None
    block_outer = value is not None and value.strip().upper() in BLOCK_OUTER_LAYOUTS
    return {"variable": value, "block_outer": block_outer, "note": BLOCK_OUTER_NOTE}


RAY_NON_CARRY_OVER_FILE = "ray_non_carry_over_env_vars.json"


def _vllm_config_root(environ: dict[str, str] | None) -> str:
    """``$VLLM_CONFIG_ROOT`` as vLLM computes it (its own ``vllm.envs`` when importable)."""
    if environ is not None and environ.get("VLLM_CONFIG_ROOT"):
        return os.path.expanduser(environ["VLLM_CONFIG_ROOT"])
    try:
        import vllm.envs

        return str(vllm.envs.VLLM_CONFIG_ROOT)
    except Exception:  # noqa: BLE001 - no (working) vLLM: its documented default
        root = os.environ.get("VLLM_CONFIG_ROOT") or os.path.join(
            os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "vllm"
        )
        return os.path.expanduser(root)


def ray_non_carry_over_report(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Which of the plugin's variables vLLM's Ray executor would not copy to its workers; never raises."""
    path = os.path.join(_vllm_config_root(environ), RAY_NON_CARRY_OVER_FILE)
    data: dict[str, Any] = {"file": path, "listed": [], "warning": None}
    try:
        names = set(json.loads(files.read_text(path)))  # a FIFO or device here is a note, never a hang
    except FileNotFoundError:
        return data | {"note": f"no {path}: Ray workers get the plugin's variables"}
    except RecursionError:
        return data | {"note": f"cannot read {path} (RecursionError: JSON nested too deeply)"}
    except (OSError, ValueError, TypeError) as e:
        return data | {"note": f"cannot read {path} ({type(e).__name__}: {e})"}
    listed = [name for name in envs.ALL_VARIABLES if name in names]
    if not listed:
        return data | {"note": f"{path} lists none of the plugin's variables"}
    effect = "the plugin is inactive there" if envs.SWITCH in listed else "they run without it"
    warning = f"{RAY_NON_CARRY_OVER_FILE} lists {', '.join(listed)}: Ray workers will not get it, so {effect}"
    return data | {"listed": listed, "warning": warning, "note": warning}


def _flydsl_requirement(requirements: list[str]) -> str | None:
    """The ``flydsl`` entry of a ``Requires-Dist`` list, without its environment marker."""
    for requirement in requirements:
        spec = requirement.split(";", 1)[0].strip()
        name = spec.split("[", 1)[0]
        for sep in "<>=!~ (":
            name = name.split(sep, 1)[0]
        if name.strip().lower().replace("_", "-") == "flydsl":
            return spec
    return None


def _satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` meets ``spec``'s specifier (``==`` only without ``packaging``)."""
    specifier = spec[len("flydsl") :].strip().strip("()")
    if not specifier:
        return True
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
    except ImportError:
        return not specifier.startswith("==") or specifier[2:].strip() == version
    try:
        return SpecifierSet(specifier).contains(version, prereleases=True)
    except InvalidSpecifier:
        return True


def flydsl_requirement_report() -> dict[str, Any]:
    """The flydsl that the installed aiter declares beside the installed one; never raises."""
    data: dict[str, Any] = {"aiter_dist": None, "declares": None, "installed": None, "warning": None}
    try:
        dists = importlib.metadata.packages_distributions().get("aiter") or list(PACKAGES["aiter"])
        for dist in dists:
            try:
                requirements = importlib.metadata.requires(dist) or []
            except importlib.metadata.PackageNotFoundError:
                continue
            data["aiter_dist"], data["declares"] = dist, _flydsl_requirement(requirements)
            break
        found = installed_version(PACKAGES["flydsl"])
        data["installed"] = None if found == "unknown" else found
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        return data | {"note": f"unknown ({type(e).__name__}: {e})"}
    if data["aiter_dist"] is None:
        return data | {"note": "aiter not installed"}
    if data["declares"] is None:
        return data | {"note": f"{data['aiter_dist']} declares no flydsl"}
    installed = data["installed"]
    if installed is None or not _satisfies(installed, data["declares"]):
        found = f"flydsl {installed} is installed" if installed else "flydsl is not installed"
        warning = f"{data['aiter_dist']} declares {data['declares']} but {found}"
        return data | {"warning": warning, "note": warning}
    return data | {"note": f"{data['aiter_dist']} declares {data['declares']}; flydsl {installed} installed"}


def stock_report(plat: dict[str, Any]) -> str:
    """What the stock arm runs here, in a few words: Gluon only on a ROCm gfx950 vLLM with aiter on."""
    if plat["vllm_platform"] == "vLLM not installed":
        return "vLLM not installed"
    if plat["gcn_arch"] is None or "gfx950" not in plat["gcn_arch"]:
        return "not a ROCm gfx950 GPU: vLLM's own path for this platform, not Gluon"
    try:
        from vllm_flydsl_indexer.tools.paths import vllm_target

        target, why = vllm_target()
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        return f"unknown: {type(e).__name__}: {e}"
    return "Gluon" if target is not None else why


# Retired with the runtime canary (issue 43): ``check --device`` and ``bench`` compare the arms.
VERIFY = "VLLM_FLYDSL_INDEXER_VERIFY"


def verify_hint(environ: dict[str, str] | None) -> str | None:
    """A note where the retired canary variable is still set, else ``None``."""
    if (os.environ if environ is None else environ).get(VERIFY) is None:
        return None
    return (
        f"{VERIFY} is retired and ignored: the plugin no longer runs a canary while serving; "
        "vllm-flydsl-indexer check --device and bench compare the two arms on this GPU"
    )


def _self_test_report(environ: dict[str, str] | None) -> str:
    """Whether each configuration proves itself against stock before its first use, and why."""
    enabled, error = envs.read_flag(envs.SELFTEST, environ, default=True)
    said = (
        "on: each FlyDSL configuration is checked against stock on this GPU at its first call"
        if enabled
        else "off: FlyDSL configurations are used unchecked"
    )
    raw = (os.environ if environ is None else environ).get(envs.SELFTEST)
    value = f"{envs.SELFTEST} is not set" if raw is None else f"{envs.SELFTEST}={raw!r}"
    return f"{said} ({value})" + (f" [{error}]" if error else "")


def register_line(decision: gates.Decision, environ: dict[str, str] | None) -> tuple[str, list[str]]:
    """The line ``register()`` logs in this environment, and the warnings bracketed at its end, in its
    order: the gates', then, where it installs the patch, a malformed ``VLLM_FLYDSL_INDEXER_TUNE`` (read only
    where a table of the plugin's is in use) and ``VLLM_FLYDSL_INDEXER_SELFTEST``. With the switch off or
    vLLM routing the call itself it logs the bare line."""
    env = os.environ if environ is None else environ
    if decision.in_tree or not envs.read_flag(envs.SWITCH, environ)[0]:
        return decision.log_line(), list(decision.warnings)
    warnings = list(decision.warnings)
    if decision.active and decision.variant is not None:
        if not decision.variant.own_table and (env.get(envs.TUNED_CSV) or "").strip().lower() not in (
            tuning.OFF_VALUES
        ):
            warnings += [e for e in [envs.read_flag(envs.TUNE, environ, default=True)[1]] if e]
        warnings += [e for e in [envs.read_flag(envs.SELFTEST, environ, default=True)[1]] if e]
    bracket = f" [{'; '.join(warnings)}]" if warnings else ""
    return decision.log_line() + bracket, warnings


def report(
    environ: dict[str, str] | None = None, model: tuple[str, dict | None] | None = None
) -> dict[str, Any]:
    """Everything doctor says; ``model`` (``reach.resolve``'s answer) adds the ``model`` section."""
    decision = gates.evaluate(environ, full=True)
    table = table_report(decision, environ)
    if decision.active:
        decision.table = table.get("in_use")  # the ACTIVE line names it, as register() does
    switch, switch_error = envs.read_flag(envs.SWITCH, environ)
    plat = platform_report()
    data = {
        "versions": {
            "python": platform.python_version(),
            **{name: package_version(dists) for name, dists in PACKAGES.items()},
        },
        "platform": plat,
        "switch": {
            "name": envs.SWITCH,
            "value": (os.environ if environ is None else environ).get(envs.SWITCH),
            "parsed": switch_error is None,
            "enabled": switch,
            "error": switch_error,
        },
        "verify": verify_hint(environ),
        "self_test": _self_test_report(environ),
        "gates": [
            {"name": name, "ok": bool(ok), "skipped": ok is None, "detail": detail}
            for name, ok, detail in decision.gates
        ],
        "kernel": kernel_report(decision.variant),
        "tuned_table": table,
        "node_cache": node_cache_report(environ),
        "kv_cache_layout": layout_report(environ),
        "ray_non_carry_over": ray_non_carry_over_report(environ),
        "flydsl_for_aiter": flydsl_requirement_report(),
        "arm": "flydsl" if decision.active else "vllm" if decision.in_tree else "stock",
        "stock": stock_report(plat),
        "reason": decision.reason,
    }
    data["log_line"], data["warnings"] = register_line(decision, environ)
    if model is not None:
        from vllm_flydsl_indexer.tools import reach

        data["model"] = reach.assess(*model, decision)
    return data


def _pointing_to_gates(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` whose reason and warnings point to the gate that prints their text.

    Each gate's text is printed once on its gate line (a bad switch value, say),
    and again only inside the log line, which is printed exactly as the plugin logs it.
    """
    details = {g["detail"] for g in data["gates"]}
    data = dict(data, warnings=[w for w in data["warnings"] if w not in details])
    failing = [(i, g) for i, g in enumerate(data["gates"], 1) if not g["ok"] and not g.get("skipped")]
    if failing and data["reason"] == failing[0][1]["detail"]:
        i, gate = failing[0]
        data["reason"] = f"gate {i}, {gate['name']}, below"
    return data


def render_table(table: dict[str, Any]) -> list[str]:
    """The tuned table's lines: its source, whether it applies here, and per shape the batch sizes
    that go to FlyDSL (``B>=64: flydsl (wg_per_cu=3)``: from batch 64 up to the next bucket)."""
    ignored = [
        line
        for i in table.get("ignored", ())
        for line in (
            f"tuned table: {i['source']}: {i['note']}",
            *(f"  skipped by the plugin: {w}" for w in i["skipped"]),
        )
    ]
    if table["source"] is None:
        return [*ignored, f"tuned table: {table['note']}"]
    if "rows" not in table:
        return ignored or [f"tuned table: {table['source']}: {table['note']}"]
    out = [
        *ignored,
        f"tuned table: {table['source']} ({table['rows']} rows for {table['gfx']}; uncovered shapes: below)",
        f"             {table['applies']}",
        *(f"  skipped by the plugin: {why}" for why in table.get("skipped", ())),
    ]
    for shape in table["shapes"]:
        out.append(
            f"  {shape['cu_num']} CUs, heads={shape['heads']} head_dim={shape['head_dim']} "
            f"KVB={shape['kv_block_size']} next_n={shape['next_n']}: {_batch_ranges(shape['buckets'])}"
        )
    return out


def render_node_cache(cache: dict[str, Any]) -> list[str]:
    """The node cache's lines: what decides uncovered shapes, whether the cache can be written, and each
    file's usable rows or the plugin's words for what it ignores there."""
    out = [f"uncovered shapes: {cache['uncovered_shapes']}"]
    out += [f"  note: {cache['error']}"] if cache["error"] else []
    out += [f"  note: {cache['root']}"] if cache["root"].startswith(f"{CACHE_ROOT} is empty") else []
    if cache["dir"] is None or cache["root_problem"]:
        return [*out, f"node cache: cannot be used: {cache['root_problem']}"]
    state = "writable" if not cache["unwritable"] else f"NOT writable: {cache['unwritable']}"
    out.append(f"node cache: {cache['dir']} ({len(cache['files'])} file(s); {state})")
    for f in cache["files"]:
        here = {True: "; this GPU's", False: "; another GPU's or stack's, not read here", None: ""}
        rows = f"{f['usable_rows']} usable row(s)" if f["usable_rows"] or f["problems"] else "no rows yet"
        key = f"; keyed on: {f['key']}" if f["key"] and f["usable_rows"] else ""
        out.append(f"  {os.path.basename(f['path'])}: {rows}{here[f['read_here']]}{key}")
        out += [f"    ignored by the plugin: {problem}" for problem in f["problems"]]
    return out


def _batch_ranges(buckets: list[dict[str, Any]]) -> str:
    """Consecutive buckets of one arm merged: ``B 1-63: stock, B 64-127: flydsl (wg_per_cu=3), ...``."""
    runs: list[tuple[int, int | None, str]] = []  # (first batch, last batch or None, arm with knob)
    for i, b in enumerate(buckets):
        arm = b["arm"] + (
            f" (wg_per_cu={b['wg_per_cu']})" if b["arm"] == "flydsl" and b.get("wg_per_cu") else ""
        )
        last = buckets[i + 1]["batch_at_least"] - 1 if i + 1 < len(buckets) else None
        if runs and runs[-1][2] == arm:
            runs[-1] = (runs[-1][0], last, arm)
        else:
            runs.append((b["batch_at_least"], last, arm))

    def span(first: int, last: int | None) -> str:
        return f">={first}" if last is None else (str(first) if first == last else f"{first}-{last}")

    return ", ".join(f"B {span(first, last)}: {arm}" for first, last, arm in runs)


def render(data: dict[str, Any]) -> str:
    """The answer first (the arm, its one reason, the log line, the warnings), then the details."""
    pointed = _pointing_to_gates(data)
    arm = {"flydsl": "FlyDSL", "vllm": "vLLM's own route (the plugin patches nothing)"}.get(
        data["arm"], f"stock ({data['stock']})"
    )
    out = [f"arm:      {arm}  ({pointed['reason']})", f"log line: {data['log_line']}"]
    out += [f"warning:  {w}" for w in pointed["warnings"]]
    out += [f"note:     {data['verify']}"] if data.get("verify") else []
    out += ["", "versions:"]
    out += [f"  {k:<8} {v}" for k, v in data["versions"].items()]
    needs = data["flydsl_for_aiter"]
    out.append(f"  {'':<8} warning: {needs['warning']}" if needs["warning"] else f"  {'':<8} {needs['note']}")
    plat = data["platform"]
    out += ["", f"platform: {plat['vllm_platform']}" + (f" ({plat['gcn_arch']})" if plat["gcn_arch"] else "")]
    sw = data["switch"]
    if sw["parsed"] and not (sw["value"] or "").strip():
        switch = f"{sw['name']} is not set: off (1/true enables it)"
    elif sw["parsed"]:
        switch = f"{sw['name']}={sw['value']!r} (parsed, {'on' if sw['enabled'] else 'off'})"
    else:  # the value and why it is refused: gate 1's text, printed once
        switch = f"{sw['name']} DID NOT PARSE, off (gate 1 says why)"
    out += [f"switch:   {switch}", f"self-test: {data['self_test']}", "", "gates:"]
    first_failure_seen = False
    for i, g in enumerate(data["gates"], 1):
        if g.get("skipped"):
            out.append(f"  {i}. {g['name']:<7} skipped ({g['detail']})")
            continue
        mark = "ok  " if g["ok"] else "FAIL"
        note = "  (after the deciding gate; report only)" if not g["ok"] and first_failure_seen else ""
        first_failure_seen = first_failure_seen or not g["ok"]
        out.append(f"  {i}. {g['name']:<7} {mark} {g['detail']}{note}")
    kernel = data["kernel"]
    if kernel is not None:
        out += ["", f"kernel:   {kernel['variant']}: {kernel['description']} ({kernel['location']})"]
        out += ["          model shape                       KVB  next_n  arm (when every gate passes)"]
        for shape in kernel["shapes"]:
            label = f"{shape['model']} {shape['heads']}x{shape['head_dim']}"
            arm = "FlyDSL" if shape["flydsl"] else "stock (outside this kernel's contract)"
            if shape["flydsl"] and kernel["own_table"]:
                arm = "aiter's dispatcher (its tuned table picks Gluon or FlyDSL)"
            if shape["flydsl"] and shape["next_n"] > 1:
                arm += " from audited callers"
            out.append(f"          {label:<33} {shape['kv_block_size']:<4} {shape['next_n']:<7} {arm}")
    out += ["", *render_table(data["tuned_table"])]
    out += render_node_cache(data["node_cache"])
    layout = data["kv_cache_layout"]
    out += [""] + textwrap.wrap(
        layout["note"], 100, break_on_hyphens=False, initial_indent="layout:   ", subsequent_indent=" " * 10
    )
    if layout["block_outer"]:
        variable = f"{LAYOUT_VARIABLE}={layout['variable']}"
        out.append(f"          {variable} is set here and is block-outer: every indexer call will stay stock")
    ray = data["ray_non_carry_over"]
    out += ["", f"warning:  {ray['warning']}" if ray["warning"] else f"ray:      {ray['note']}"]
    if "model" in data:
        from vllm_flydsl_indexer.tools import reach

        out += [""] + reach.render(data["model"])
    return "\n".join(line.replace("\n", "\\n") for line in out)  # an echoed newline stays inside its line


def main(as_json: bool, strict: bool, model: tuple[str, dict | None] | None = None) -> int:
    data = report(model=model)
    if as_json:
        print(json.dumps(data, indent=2))
    else:  # echoed values (the switch, the table path, --model, the cache root) escaped and shortened
        print("\n".join(safe_line(line) for line in render(data).split("\n")))
    if not strict:
        return 0
    cache = data["node_cache"]
    broken = cache["root_problem"] or cache["unwritable"]
    if data["arm"] != "flydsl":
        why = safe_line(f"doctor --strict: the FlyDSL arm would not be active ({data['reason']})")
    elif broken and cache["in_use"] and data["tuned_table"].get("origin") != "dispatcher":
        why = safe_line(
            f"doctor --strict: this node's cache cannot be written ({broken}): every process measures "
            "its buckets again"
        )
    elif "model" in data and not data["model"]["reaches_flydsl"]:
        why = f"doctor --strict: {data['model']['label']} would stay stock ({data['model']['reason']})"
    else:
        return 0
    print(why, file=sys.stderr)
    return 1
