# SPDX-License-Identifier: Apache-2.0
"""The call-site audit: every call of ``rocm_fp8_paged_mqa_logits`` in the supported vLLM releases, what
it passes and where its bounds come from (``docs/vllm-audit.md`` has the audit, release by release).

The plugin holds what it decides with (:data:`~vllm_flydsl_indexer.target.MULTI_ROW`); this is the rest
of the record, which ``tests/test_drift.py`` holds each installed release to and ``doctor --model`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_flydsl_indexer.target import MULTI_ROW, TARGET_MODULE, TARGET_POSITIONAL

__all__ = ["CALL_SITES", "CallSite"]


@dataclass(frozen=True)
class CallSite:
    """One audited call of the target, and what FlyDSL may take from it."""

    module: str
    function: str
    passes: frozenset[str]  # the argument names it passes (positional ones by the target's names)
    bounds: str
    compress_ratio: str
    dcp: str
    vllm: str
    note: str = ""  # which models reach it, where narrower than the module's name says

    @property
    def multi_row(self) -> bool:
        """May FlyDSL take ``next_n > 1`` from here (with ``compress_ratio == 1`` and DCP 1)? The plugin's
        :data:`~vllm_flydsl_indexer.target.MULTI_ROW` decides."""
        return MULTI_ROW[self.module] is None


_ALL_ARGS = frozenset(TARGET_POSITIONAL)
CALL_SITES: dict[str, CallSite] = {
    site.module: site
    for site in (
        CallSite(
            module=TARGET_MODULE,
            function="rocm_aiter_sparse_attn_indexer",
            passes=_ALL_ARGS | {"compress_ratio"},
            bounds="indexer builder's decode.seq_lens: (B, 1), or native-MTP (B, next_n) one apart, "
            "floor-divided by the builder's ratio when it is > 1",
            compress_ratio="passes the indexer layer's compress_ratio (DeepSeek-V3.2, GLM-5.x: 1; "
            "GLM-5-next reaches this site only with index_kpool <= 1)",
            dcp="bounds localised per token when DCP > 1",
            vllm="0.32.0, 0.33.0, 0.34.0",
        ),
        CallSite(
            module="vllm.models.deepseek_v41.amd.ops.sparse_indexer",
            function="_decode_step",
            passes=_ALL_ARGS | {"compress_ratio"},
            bounds="same builder and decode.seq_lens as the defining module's indexer",
            compress_ratio="passes the layer's compress_ratio",
            dcp="bounds localised per token when DCP > 1",
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
            vllm="0.32.0, 0.33.0, 0.34.0",
        ),
    )
}
