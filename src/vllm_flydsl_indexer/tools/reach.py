# SPDX-License-Identifier: Apache-2.0
"""``doctor --model``: does a model's indexer reach FlyDSL on the installed vLLM and aiter?

Asked of vLLM wherever it answers without a GPU: the KV cache layout its
indexer backends resolve (``supported_kv_cache_layouts`` and
``get_supported_kv_cache_layouts``), which model types default to the MXFP4
indexer (the source of ``platforms/rocm.py``'s
``_maybe_default_dsv4_mxfp4_indexer``: importing that module asks an AMD GPU
for its arch), and whether stock sends a ``compress_ratio`` to its own C4A
route (the target's ``_indexer_k_is_c4a_block_flat``). What vLLM cannot say
without building the model (which backends and which call site a model uses,
its indexer shapes and ratios) is :data:`MODELS`, pinned by ``tests/test_reach.py`` against the
installed vLLM. No torch or vLLM import at module level: the CLI validates
``--model`` with :func:`resolve` before any work.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from vllm_flydsl_indexer.target import TARGET_MODULE, TARGET_NAME
from vllm_flydsl_indexer.tools import files
from vllm_flydsl_indexer.tools.audit import CALL_SITES
from vllm_flydsl_indexer.tools.models import BY_NAME, REPORT_BLOCK_SIZES, REPORT_NEXT_NS, takes_shape

__all__ = [
    "BLOCK_OUTER",
    "HUB_MODEL_IDS",
    "LAYER_CONTIGUOUS",
    "MODELS",
    "PINNED_MXFP4_MODELS",
    "PINNED_RELEASES",
    "ModelError",
    "ModelReach",
    "ROCM_SPARSE_MLA",
    "SHAPE_FIELDS",
    "SHAPE_MODEL_TYPES",
    "V32_INDEXER",
    "accepted",
    "assess",
    "c4a_objection",
    "mxfp4_default_models",
    "render",
    "resolve",
    "resolved_layout",
    "shape_of",
]

# The path that never calls the target: aiter's MXFP4 indexer, which vLLM resolves "auto" to for
# DeepSeek-V4 on CDNA4 with aiter (vLLM 0.33.0 and later), and the setting that keeps FP8. The plugin no
# longer watches vLLM's config for it at run time: ``doctor --model`` says it (issue 43).
MXFP4_DEFAULT_MODULE = "vllm.platforms.rocm"
MXFP4_DEFAULT_FUNCTION = "_maybe_default_dsv4_mxfp4_indexer"
FP8_SETTING = """--attention-config '{"indexer_kv_dtype": "fp8"}'"""


def mxfp4_reason(model_type: str) -> str:
    """Why a model on the MXFP4 indexer never reaches FlyDSL (doctor's reason)."""
    return (
        f"{model_type} runs aiter's MXFP4 indexer (indexer_kv_dtype 'mxfp4', vLLM's default for it on "
        f"MI350/MI355 with aiter: {MXFP4_DEFAULT_FUNCTION}), which never calls {TARGET_NAME}; "
        f"{FP8_SETTING} selects the FP8 indexer, which does"
    )


if TYPE_CHECKING:
    from vllm_flydsl_indexer.gates import Decision

_MLA = "vllm.v1.attention.backends.mla"
ROCM_SPARSE_MLA = f"{_MLA}.rocm_aiter_mla_sparse:ROCMAiterMLASparseBackend"
V32_INDEXER = f"{_MLA}.indexer:DeepseekV32IndexerBackend"
# vLLM's KvCacheLayout names: layer-contiguous, and block-outer (a strided kv_cache for the indexer).
LAYER_CONTIGUOUS, BLOCK_OUTER = "LBNHC", "BLHNC"
# The model types vLLM 0.33.0 and 0.34.0 default to the MXFP4 indexer (0.32.x: none); what doctor
# answers without a vLLM to read it from. tests/test_files.py pins both against the installed vLLM.
PINNED_MXFP4_MODELS = frozenset({"deepseek_v4"})
PINNED_RELEASES = "vLLM 0.33.0 and 0.34.0"


@dataclass(frozen=True)
class ModelReach:
    """What vLLM decides only when it builds the model: pinned per ``model_type``."""

    model_type: str
    label: str
    architecture: str
    # ``module:Class`` of the attention backends whose layouts decide the indexer cache's.
    backends: tuple[str, ...]
    # The module that calls the patched function for it (a key of callers.CALL_SITES).
    call_site: str
    # The compress_ratio values that call passes (GLM-5-next passes none: 1).
    compress_ratios: tuple[int, ...]
    heads: int
    head_dim: int
    # Indexer cache rows per block (KVBlockSize) of the call.
    block_sizes: tuple[int, ...]
    # The KV cache layout vLLM 0.33.0 and 0.34.0 resolve for ``backends``: doctor's answer without a vLLM.
    layout: str
    note: str = ""


MODELS: dict[str, ModelReach] = {
    m.model_type: m
    for m in (
        ModelReach(
            "deepseek_v32",
            "DeepSeek-V3.2",
            "DeepseekV32ForCausalLM",
            (ROCM_SPARSE_MLA, V32_INDEXER),
            TARGET_MODULE,
            (1,),
            BY_NAME["deepseek-v3.2"].heads,
            BY_NAME["deepseek-v3.2"].head_dim,
            REPORT_BLOCK_SIZES,
            LAYER_CONTIGUOUS,
        ),
        ModelReach(
            "glm_moe_dsa",
            "GLM-5.x",
            "GlmMoeDsaForCausalLM",
            (ROCM_SPARSE_MLA, V32_INDEXER),
            TARGET_MODULE,
            (1,),
            BY_NAME["glm-5"].heads,
            BY_NAME["glm-5"].head_dim,
            REPORT_BLOCK_SIZES,
            LAYER_CONTIGUOUS,
        ),
        ModelReach(
            "deepseek_v4",
            "DeepSeek-V4",
            "DeepseekV4ForCausalLM",
            (f"{_MLA}.indexer:DeepseekV4IndexerBackend",),
            TARGET_MODULE,
            (4,),
            64,
            128,
            (64,),  # the backend's 256-token blocks at ratio 4
            BLOCK_OUTER,
            note="only its compress-ratio-4 (C4A) layers have an indexer",
        ),
        ModelReach(
            "deepseek_v41",
            "DeepSeek-V4.1",
            "DeepseekV41ForCausalLM",
            (f"{_MLA}.indexer:DeepseekV41IndexerBackend",),
            # On gfx950 its FP8 indexer is vLLM's, through rocm_aiter_sparse_attn_indexer: its AMD ops
            # module (deepseek_v41.amd.ops.sparse_indexer) calls the target only with --monokernel on gfx942.
            TARGET_MODULE,
            (1, 2),
            BY_NAME["glm-5"].heads,
            BY_NAME["glm-5"].head_dim,
            (64, 32),  # the backend's 64-token blocks on gfx950 (capability family 90) at ratio 1 and 2
            BLOCK_OUTER,
        ),
        ModelReach(
            "glm5_next",
            "GLM-5-next",
            "Glm5NextForCausalLM",
            (f"{_MLA}.indexer:Glm5NextIndexerBackend", f"{_MLA}.indexer:KpoolTailBackend"),
            "vllm.models.glm5next.amd.sparse_indexer",
            (1,),
            64,
            128,
            (64, 32),  # vLLM's paged-MQA page sizes, in pool entries
            BLOCK_OUTER,
            note="its bounds are pooled by index_kpool > 1 although it passes no compress_ratio",
        ),
    )
}


class ModelError(ValueError):
    """``--model`` names neither a known model type nor a directory with a readable config.json."""


# check --model's shape names (tools/models.py), accepted by doctor --model as the model each names first.
SHAPE_MODEL_TYPES = {"deepseek-v3.2": "deepseek_v32", "glm-5": "glm_moe_dsa"}


# Hugging Face model ids taken without their config.json in the local cache (no download, ever): each
# stands for its model type, its shape from this package's model table.
HUB_MODEL_IDS = {"deepseek-ai/DeepSeek-V3.2": "deepseek_v32", "deepseek-ai/DeepSeek-V3.2-Exp": "deepseek_v32"}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def accepted() -> str:
    return (
        f"a Hugging Face model directory with a config.json, a model id whose config.json is in the local "
        f"Hugging Face cache (or one of {', '.join(HUB_MODEL_IDS)}), or one of {', '.join(MODELS)} "
        f"(or {', '.join(SHAPE_MODEL_TYPES)})"
    )


def _cached_config_file(model_id: str) -> Path | None:
    """The config.json of ``model_id`` in the local Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``), read
    without the network, or ``None``; never raises."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # noqa: BLE001 - no huggingface_hub, or an id it refuses: not cached
        return None
    return Path(found) if isinstance(found, str) else None


# The config.json fields doctor reads besides model_type, each a positive integer when present.
SHAPE_FIELDS = ("index_n_heads", "index_head_dim")
# Larger than any indexer's heads or head_dim by far; a bigger value is a broken config.
SHAPE_FIELD_LIMIT = 1 << 16


def _config_problem(config: object) -> str | None:
    """What in a parsed config.json is not what doctor reads (the field, and what is accepted)."""
    if not isinstance(config, dict):
        return f"is {type(config).__name__}, not a JSON object"
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODELS:
        return f"field model_type is {model_type!r}; accepted: one of {', '.join(MODELS)}"
    for name in SHAPE_FIELDS:
        value = config.get(name)
        if value is not None and (
            type(value) is not int or not 0 < value <= SHAPE_FIELD_LIMIT  # bool, float, NaN, 1e400: no
        ):
            return f"field {name} is {value!r}; accepted: an integer in [1, {SHAPE_FIELD_LIMIT}], or absent"
    return None


def resolve(arg: str) -> tuple[str, dict[str, Any] | None]:
    """``(model_type, config)`` of ``--model``: a model directory, a Hugging Face model id (its config.json
    from the local cache; else one of :data:`HUB_MODEL_IDS`, config ``None``), a bare model type (config
    ``None``), or one of ``check --model``'s shape names (the model type it names first)."""
    if not arg.strip():  # Path("") is the current directory: never read it by accident
        raise ModelError(f"--model {arg}: is empty; expected {accepted()}")
    path = Path(arg)
    try:
        is_dir = path.is_dir()
    except (OSError, ValueError) as e:  # a name too long for a path, a parent that cannot be entered
        if arg not in MODELS and arg not in SHAPE_MODEL_TYPES:
            why = getattr(e, "strerror", None) or e
            raise ModelError(
                f"--model {arg}: cannot be looked up as a path ({why}); expected {accepted()}"
            ) from None
        is_dir = False
    hub_config = None if is_dir or not HUB_ID.fullmatch(arg) else _cached_config_file(arg)
    if is_dir or hub_config is not None:
        config_file = hub_config or path / "config.json"
        try:
            config = json.loads(files.read_text(str(config_file)))
        except RecursionError:
            raise ModelError(
                f"--model {arg}: {config_file} is JSON nested too deeply to read; expected {accepted()}"
            ) from None
        except (OSError, ValueError) as e:
            raise ModelError(
                f"--model {arg}: no readable config.json ({type(e).__name__}: {e}); expected {accepted()}"
            ) from None
        problem = _config_problem(config)
        if problem is not None:
            raise ModelError(f"--model {arg}: {config_file} {problem}")
        return config["model_type"], config
    model_type = SHAPE_MODEL_TYPES.get(arg, HUB_MODEL_IDS.get(arg, arg))
    if model_type not in MODELS:
        what = "a known model type"
        if HUB_ID.fullmatch(arg):
            what += ", nor a Hugging Face model id with its config.json in the local cache"
        raise ModelError(f"--model {arg}: not a directory or {what}; expected {accepted()}")
    return model_type, None


def _vllm_file(module: str) -> Path | None:
    """The source file of vLLM's ``module`` (found without importing it), or ``None``; never raises."""
    try:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.origin:
            return None
        path = Path(spec.origin).parent.joinpath(*module.split(".")[1:])
        return next((c for c in (path.with_suffix(".py"), path / "__init__.py") if c.is_file()), None)
    except Exception:  # noqa: BLE001 - no vLLM, one without a spec, a finder that raises, an unreadable tree
        return None


def mxfp4_default_models() -> frozenset[str] | None:
    """Model types vLLM's ROCm platform switches to the MXFP4 indexer; ``None`` if unreadable.

    Read from the source of ``_maybe_default_dsv4_mxfp4_indexer`` (empty where
    the installed vLLM has no such default, as 0.32.0): the string its
    ``model_type`` is compared with.
    """
    path = _vllm_file(MXFP4_DEFAULT_MODULE)
    if path is None:
        return None
    tree = ast.parse(path.read_text())
    fn = next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == MXFP4_DEFAULT_FUNCTION), None
    )
    if fn is None:
        return frozenset()
    found = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare) and "model_type" in ast.unparse(node.left):
            found |= {c.value for c in node.comparators if isinstance(c, ast.Constant)}
    return frozenset(found)


def vllm_import_problem() -> str | None:
    """Why ``import vllm`` fails here (``ImportError: ...``, or anything it raises), or ``None``.

    ``None`` too where no vLLM is installed: :func:`assess` tells that case apart by ``_vllm_file``.
    """
    if _vllm_file("vllm") is None:
        return None
    try:
        importlib.import_module("vllm")
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a broken vLLM is doctor's answer, not its crash
        return f"{type(e).__name__}: {e}"
    return None


def _probe(what: str, fn, *args) -> tuple[Any, str | None]:
    """``(fn(*args), None)``, or ``(None, "what: why")`` whatever ``fn`` raises: doctor never raises."""
    try:
        return fn(*args), None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - doctor reports, never crashes
        return None, f"{what} unknown ({type(e).__name__}: {e})"


def _backend(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def resolved_layout(backends: tuple[str, ...]) -> tuple[str, bool]:
    """The KV cache layout vLLM resolves for ``backends`` and whether it is layer-contiguous."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    layout = get_supported_kv_cache_layouts([_backend(b) for b in backends])[0]
    return layout.name, bool(layout.is_layer_compact)


def c4a_objection(compress_ratio: int, block_size: int) -> str | None:
    """The router's reason when stock sends this ``compress_ratio`` to vLLM's own C4A route on gfx950."""
    import vllm  # noqa: F401 - the target module imports cleanly only after vllm itself

    from vllm_flydsl_indexer.target import TARGET_MODULE
    from vllm_flydsl_indexer.tools.paths import vllm_gluon_objection

    module = importlib.import_module(TARGET_MODULE)
    flat = getattr(module, "_indexer_k_is_c4a_block_flat", None)
    if flat is None:  # a vLLM without the C4A route
        return None
    gfx950 = SimpleNamespace(
        _ON_GFX950=True,
        _ON_GFX942=False,
        _indexer_k_is_c4a_block_flat=flat,
        paged_mqa_logits_module=lambda: object(),
        current_workspace_manager=lambda: None,
        _per_sequence_context_lens=lambda lens: lens,
    )
    aiter_on = SimpleNamespace(is_enabled=lambda: True, is_rdna_aiter_enabled=lambda: False)
    reason = vllm_gluon_objection(gfx950, aiter_on, compress_ratio, block_size)  # type: ignore[arg-type]
    return None if reason is None else f"stock does not use aiter's Gluon kernel here: {reason}"


def shape_of(config: dict[str, Any] | None, model: ModelReach) -> tuple[int, int, str]:
    """``(heads, head_dim, where from)``: each field config.json gives, the package's model table for
    the other; the third item says which part came from where."""
    given = {name: config.get(name) for name in SHAPE_FIELDS} if config is not None else {}
    heads = given.get("index_n_heads") or model.heads
    head_dim = given.get("index_head_dim") or model.head_dim
    read = [name for name in SHAPE_FIELDS if given.get(name)]
    if len(read) == len(SHAPE_FIELDS):
        return int(heads), int(head_dim), "config.json"
    if not read:
        return model.heads, model.head_dim, "this package's model table"
    (field_read,) = read
    (other,) = [name for name in SHAPE_FIELDS if name != field_read]
    return (
        int(heads),
        int(head_dim),
        f"{field_read} from config.json, {other} from this package's model table",
    )


def assess(model_type: str, config: dict[str, Any] | None, decision: Decision) -> dict[str, Any]:
    """The ``model`` section of doctor's report: path, layout, call site, shapes, verdict."""
    from vllm_flydsl_indexer.kernels import BLOCK_OUTER_NOTE, KernelVariant

    model = MODELS[model_type]
    reasons: list[str] = []
    broken = vllm_import_problem()
    has_vllm = _vllm_file("vllm") is not None and broken is None
    # Without a (working) vLLM: this package's pinned answers, and one line saying which parts they are.
    not_read = (
        [] if has_vllm else ["the MXFP4 default", "the KV cache layout", "the C4A route", "the call site"]
    )
    unknown: list[str] = []  # probes of a working vLLM that raised: each said, none fatal
    if has_vllm:
        mxfp4, problem = _probe("the MXFP4 default", mxfp4_default_models)
        unknown += [problem] if problem else []
    else:
        mxfp4 = PINNED_MXFP4_MODELS
    pinned = "" if has_vllm else f", pinned for {PINNED_RELEASES}"
    if mxfp4 is not None and model_type in mxfp4:
        path = (
            f"MXFP4 (vLLM's default on CDNA4 with aiter: platforms/rocm.py {MXFP4_DEFAULT_FUNCTION}{pinned})"
        )
        reasons.append(mxfp4_reason(model_type))
    elif mxfp4 is None:
        path = "unknown (vLLM's platforms/rocm.py unreadable)"
    else:
        path = f"FP8 (indexer_kv_dtype 'auto' resolves to fp8{pinned})"
    layout, contiguous = model.layout, model.layout == LAYER_CONTIGUOUS
    if has_vllm:
        resolved, problem = _probe("the KV cache layout", resolved_layout, model.backends)
        if resolved is None:
            layout, contiguous = f"unknown ({problem})", True
            unknown.append(str(problem))
        else:
            layout, contiguous = resolved
    backends = ", ".join(b.split(":")[1] for b in model.backends)
    for ratio in model.compress_ratios if has_vllm else ():
        c4a, problem = _probe("the C4A route", c4a_objection, ratio, max(model.block_sizes))
        unknown += [problem] if problem else []
        if c4a is not None:
            reasons.append(c4a)
    if not contiguous:
        reasons.append(
            f"vLLM resolves the block-outer KV cache layout {layout} for {backends}: kv_cache is strided, "
            f"so this layer stays on the stock path. {BLOCK_OUTER_NOTE}"
        )
    site = CALL_SITES.get(model.call_site)
    if has_vllm and _vllm_file(model.call_site) is None:
        reasons.append(f"the installed vLLM has no {model.call_site}: {model.label} does not call it")
    heads, head_dim, shape_source = shape_of(config, model)
    variant = decision.variant
    contract = (
        f"the found kernel {variant.name}" if variant else "the general FlyDSL contract (no kernel found)"
    )
    shapes = []
    for block_size in model.block_sizes:
        for next_n in REPORT_NEXT_NS:
            general = KernelVariant("general", print, "", "")  # the general FlyDSL contract
            takes = takes_shape(variant or general, heads, head_dim, block_size, next_n)
            # callers.window_rule: next_n > 1 only from an audited multi-row site, at compress_ratio 1.
            if next_n > 1 and (site is None or not site.multi_row or 1 not in model.compress_ratios):
                takes = False
            shapes.append({"kv_block_size": block_size, "next_n": next_n, "flydsl": takes})
    if not any(s["flydsl"] for s in shapes if s["next_n"] == 1):
        reasons.append(f"{contract} does not take heads={heads}, head_dim={head_dim} at any KVBlockSize")
    allows = not reasons
    if allows and not decision.active:
        reasons.append(f"this machine: {decision.reason}")
    return {
        "model_type": model_type,
        "label": model.label,
        "architecture": model.architecture,
        "indexer_path": path,
        "fp8_setting": FP8_SETTING,
        "backends": [b.split(":")[1] for b in model.backends],
        "kv_cache_layout": layout,
        "layer_contiguous": contiguous,
        "call_site": model.call_site if site is not None else f"{model.call_site} (not audited)",
        "compress_ratio": list(model.compress_ratios),
        "note": model.note,
        "heads": heads,
        "head_dim": head_dim,
        "shape_source": shape_source,
        "contract": contract,
        "shapes": shapes,
        "allows_flydsl": allows,
        "reaches_flydsl": allows and decision.active,
        "reason": reasons[0] if reasons else None,
        "reasons": reasons,
        "not_read_from_vllm": not_read,
        "vllm_import_error": broken,
        "unknown": unknown,
    }


def render(data: dict[str, Any]) -> list[str]:
    """doctor's text lines for the ``model`` section."""
    takes = ", ".join(
        f"KVB={s['kv_block_size']} next_n={s['next_n']}: {'FlyDSL' if s['flydsl'] else 'stock'}"
        for s in data["shapes"]
    )
    verdict = "reaches FlyDSL" if data["reaches_flydsl"] else "stays stock"
    out = [
        f"model:    {data['label']} ({data['model_type']}, {data['architecture']})",
        f"  indexer path:   {data['indexer_path']}",
        f"  cache layout:   {data['kv_cache_layout']} "
        f"({'layer-contiguous' if data['layer_contiguous'] else 'block-outer: strided'}; "
        f"from {', '.join(data['backends'])})",
        f"  call site:      {data['call_site']}, compress_ratio "
        f"{'/'.join(map(str, data['compress_ratio']))}" + (f" ({data['note']})" if data["note"] else ""),
        f"  shapes:         heads={data['heads']} head_dim={data['head_dim']} ({data['shape_source']}) "
        f"under {data['contract']}: {takes}",
        f"  verdict:        {verdict}" + (f": {data['reason']}" if data["reason"] else ""),
    ]
    out += [f"  then:           {r}" for r in data["reasons"][1:]]
    out += [f"  not read:       {u}" for u in data.get("unknown", ())]
    if data["not_read_from_vllm"]:
        parts = ", ".join(data["not_read_from_vllm"])
        if data.get("vllm_import_error"):
            head = f"  vLLM broken:    import vllm raises {data['vllm_import_error']}, so {parts}"
        else:
            head = f"  no vLLM here:   {parts}"
        answers = f"this package's answers for {PINNED_RELEASES} are shown"
        out.append(f"{head} could not be read from a vLLM; {answers}")
    return out
