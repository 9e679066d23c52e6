# SPDX-License-Identifier: Apache-2.0
"""The call-site audit: who calls ``rocm_fp8_paged_mqa_logits``, and what FlyDSL may take from it.

FlyDSL writes row ``(b, i)`` of a ``next_n``-row call over columns ``[0, L_b -
next_n + i]``, where ``L_b`` is the last column of the caller's bounds. That
equals what the consumers read only when the caller's ``(B, next_n)`` bounds
are vLLM's native-MTP table, one apart: ``[b, j] = max(0, L_b - next_n + j +
1)``. Whether they are depends on where the caller's bounds come from, and an
argument name is no proof of it: GLM-5-next's kpool indexer passes pool-granular
(floor-divided) bounds without passing ``compress_ratio``.

So the router asks which module called it (the frame that called the patched
function, read by :mod:`vllm_flydsl_indexer.patch` at no measurable cost) and
lets ``next_n > 1`` through only from a call site audited below to pass
one-apart bounds whenever it passes ``compress_ratio == 1`` and runs without
decode context parallelism. Every other caller, including any call site a
future vLLM adds, gets ``next_n == 1`` only, which is always safe: a single row
reads ``[0, L_b)`` and FlyDSL writes exactly that. ``tests/test_drift.py`` fails
when the installed vLLM has a call site that is not in :data:`CALL_SITES`, or
when an audited call site passes other arguments than recorded here.

What was checked in vLLM 0.33.0 (and 0.32.0 where the site exists), for every
entry: the bounds builder
(``vllm/v1/attention/backends/mla/indexer.py``,
``DeepseekV32IndexerMetadataBuilder.build``): native MTP
``[b, j] = max(0, L_b - max_decode_len + j + 1)`` (clamped at 0 for padding
requests, still one apart where non-zero); the flattened path (one row per
token, ``next_n == 1``); DCP localisation after expansion (per-token, not one
apart); compression ``seq_lens //= compress_ratio`` with the builder's ratio,
which is the cache spec's ``tokens_per_state``; the draft-model update
(``update_draft_decode_metadata``: one token per request, ``next_n == 1``). And
the consumers after the call: aiter's ``indexer_top_k_decode`` and vLLM's
``top_k_per_row_decode`` read row ``r`` over ``[0, seq_lens.reshape(-1)[r])``;
DeepSeek-V4.1's candidate selection and mask use ``seq_lens.reshape(-1)``,
repeated ``next_n`` times when it holds one entry per sequence; its gfx942 hooks
(``topk.py``) do not run on gfx950; GLM-5-next's kpool top-k reads its
pool-granular ``seq_lens`` per row. Nothing fills or sanitises the logits in
between.

Re-audited in vLLM 0.34.0, which changes none of the call sites' arguments:

* The native table is the same ``max(0, L_b - max_decode_len + j + 1)``, but
  adaptive verification (``enable_adaptive_verification``) pins its width to
  ``next_n`` while q is packed to the step's longest request, so q can have
  fewer rows than the table has columns. On ROCm only the DeepSeek-V4/V4.1
  indexer backends accept adaptive verification, and they flatten (one row per
  token, ``(N, 1)`` bounds); a table wider than q's rows stays stock anyway
  (the router requires ``(B, next_n)`` for ``next_n > 1`` and one column for
  ``next_n == 1``).
* ShardQ (``sparse_mla_shard_q``) passes query positions to the prefill
  chunks only; the decode bounds are built as before. The decode-only
  expanded block table and ``_max_decode_logits_rows`` size buffers (the
  latter the same workspace the original and the router both take); they do
  not change bounds.
* The consumers: the candidate selection and mask expand one entry per
  sequence in-kernel (``ends[row // row_repeat]``) instead of
  ``repeat_interleave``: the same columns are read.
* GLM-5-next's kpool decode still passes pool-granular bounds without
  ``compress_ratio`` (``max_model_len=max_pool_len``); around the call only the
  workspace reservation and a kpool warm-up registration changed.
* DeepSeek-V4.1's AMD ops module is unchanged.

And the path that never calls it: the MXFP4 indexer (vLLM 0.33.0 and 0.34.0),
aiter's paged MXFP4 kernels, taken when the resolved ``indexer_kv_dtype`` is
``"mxfp4"``. vLLM's ROCm platform picks it for DeepSeek-V4 on CDNA4 with aiter
on (``_maybe_default_dsv4_mxfp4_indexer``, called by name from
``RocmPlatform.check_and_update_config``); a user can also ask for it.
:func:`config_objection` reads the resolved config, so the plugin can say so
when the config is built (:mod:`vllm_flydsl_indexer.patch`) and ``doctor
--model`` can say it in the same words.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from vllm_flydsl_indexer.target import TARGET_MODULE, TARGET_NAME, TARGET_POSITIONAL

__all__ = [
    "CALL_SITES",
    "CallSite",
    "DEFINING_MODULE",
    "FP8_SETTING",
    "MXFP4_DEFAULT_FUNCTION",
    "MXFP4_DEFAULT_MODULE",
    "call_site_in",
    "config_objection",
    "multi_row_objection",
    "mxfp4_reason",
]

# The module that defines the target; its own indexer calls it.
DEFINING_MODULE = TARGET_MODULE


@dataclass(frozen=True)
class CallSite:
    """One audited call of the target, and what FlyDSL may take from it."""

    module: str
    function: str
    # Argument names the call passes (positional ones by the target's names).
    passes: frozenset[str]
    bounds: str
    compress_ratio: str
    dcp: str
    # May FlyDSL take next_n > 1 from here (always with compress_ratio == 1, DCP 1)?
    multi_row: bool
    vllm: str
    # Which models reach it, where that is narrower than the module's name says.
    note: str = ""


_ALL_ARGS = frozenset(TARGET_POSITIONAL)

CALL_SITES: dict[str, CallSite] = {
    site.module: site
    for site in (
        CallSite(
            module=DEFINING_MODULE,
            function="rocm_aiter_sparse_attn_indexer",
            passes=_ALL_ARGS | {"compress_ratio"},
            bounds="indexer builder's decode.seq_lens: (B, 1), or native-MTP (B, next_n) one apart, "
            "floor-divided by the builder's ratio when it is > 1",
            compress_ratio="passes the indexer layer's compress_ratio (DeepSeek-V3.2, GLM-5.x: 1; "
            "GLM-5-next reaches this site only with index_kpool <= 1)",
            dcp="bounds localised per token when DCP > 1",
            multi_row=True,
            vllm="0.32.0, 0.33.0, 0.34.0",
        ),
        CallSite(
            module="vllm.models.deepseek_v41.amd.ops.sparse_indexer",
            function="_decode_step",
            passes=_ALL_ARGS | {"compress_ratio"},
            bounds="same builder and decode.seq_lens as the defining module's indexer",
            compress_ratio="passes the layer's compress_ratio",
            dcp="bounds localised per token when DCP > 1",
            multi_row=True,
            vllm="0.33.0, 0.34.0",
            note="DeepSeek-V4.1's layer calls it only with --monokernel on gfx942 (models/deepseek_v41/amd/"
            "rocm.py, _gfx942_monokernel); on gfx950 V4.1 reaches the target through "
            "rocm_aiter_sparse_attn_indexer",
        ),
        CallSite(
            module="vllm.models.glm5next.amd.sparse_indexer",
            function="sparse_attn_indexer_kpool",
            passes=_ALL_ARGS,
            bounds="pool-granular: the builder's ratio is tokens_per_state = index_kpool > 1, so every "
            "entry is floor-divided and MTP neighbours can be equal; max_model_len=max_pool_len",
            compress_ratio="does NOT pass it (stays 1) although its bounds are compressed",
            dcp="bounds localised per token when DCP > 1",
            multi_row=False,
            vllm="0.32.0, 0.33.0, 0.34.0",
        ),
    )
}


def multi_row_objection(caller: str | None) -> str | None:
    """Why FlyDSL may not take a ``next_n > 1`` call from ``caller``, or ``None``."""
    site = CALL_SITES.get(caller) if caller is not None else None
    if site is None:
        return (
            f"next_n > 1 from a caller this package has not audited ({caller or 'unknown'}): "
            "only next_n == 1 is always safe"
        )
    if not site.multi_row:
        return f"next_n > 1 from {caller}: its bounds are {site.bounds.split(':')[0]} ({site.compress_ratio})"
    return None


# Where vLLM resolves "auto" to the MXFP4 indexer, and the setting that keeps FP8.
MXFP4_DEFAULT_MODULE = "vllm.platforms.rocm"
MXFP4_DEFAULT_FUNCTION = "_maybe_default_dsv4_mxfp4_indexer"
FP8_SETTING = """--attention-config '{"indexer_kv_dtype": "fp8"}'"""


def mxfp4_reason(model_type: str) -> str:
    """Why a model on the MXFP4 indexer never reaches FlyDSL (the runtime WARNING and doctor's reason)."""
    return (
        f"{model_type} runs aiter's MXFP4 indexer (indexer_kv_dtype 'mxfp4', vLLM's default for it on "
        f"MI350/MI355 with aiter: {MXFP4_DEFAULT_FUNCTION}), which never calls {TARGET_NAME}; "
        f"{FP8_SETTING} selects the FP8 indexer, which does"
    )


def config_objection(vllm_config: object) -> str | None:
    """Why no call of the model ``vllm_config`` describes reaches the target, or ``None``.

    Reads attributes only, with defaults, so any object is accepted.
    """
    attention = getattr(vllm_config, "attention_config", None)
    if getattr(attention, "indexer_kv_dtype", None) != "mxfp4":
        return None
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    return mxfp4_reason(str(getattr(hf_config, "model_type", None) or "this model"))


_CALL_SITE = compile(
    "def call_site(fn, args, kwargs):\n    return fn(*args, **kwargs)\n",
    "<vllm-flydsl-indexer call site>",
    "exec",
)


def call_site_in(module: ModuleType) -> Callable[[Callable, tuple, dict], object]:
    """A function living in ``module`` (its globals are the module's) that calls what it is given.

    ``call_site_in(m)(fn, args, kwargs)`` calls ``fn`` exactly as code in ``m``
    would, so the patch sees ``m`` as the caller. For ``check`` and tests; it
    adds no name to ``m``.
    """
    namespace: dict[str, object] = {}
    exec(_CALL_SITE, vars(module), namespace)  # noqa: S102 - a fixed one-line function
    return namespace["call_site"]  # type: ignore[return-value]
