# SPDX-License-Identifier: Apache-2.0
"""vLLM's KV cache layout and FlyDSL: what the user is told, in the log and by ``doctor``.

A block-outer layout (BLHNC, BLNHC, BHLNC) packs every layer's page inside each
block, so a layer's indexer cache is a strided view, which FlyDSL cannot read.
The facts about which models force one are pinned in ``test_drift.py``.
"""

from __future__ import annotations

import functools
import json

import torch

from conftest import Recorder, as_args, base_problem, router_for
from vllm_flydsl_indexer import envs, kernels
from vllm_flydsl_indexer.target import TARGET_MODULE
from vllm_flydsl_indexer.tools import doctor


def block_outer_layer_view(p, layers: int = 3, layer: int = 1) -> torch.Tensor:
    """Layer ``layer`` of a cache allocated block-outer, ``[blocks, layers, KVB, 1, index_dim]``."""
    blocks, block_size, _, index_dim = p.kv_cache.shape
    raw = torch.zeros((blocks, layers, block_size, 1, index_dim), dtype=torch.uint8)
    raw[:, layer] = p.kv_cache
    return raw[:, layer]


def test_block_outer_cache_stays_stock_and_the_log_says_why(plugin_log):
    p = base_problem()
    original = Recorder()
    router = router_for(original)
    call = functools.partial(router.call_from, TARGET_MODULE)
    view = block_outer_layer_view(p)
    assert view.shape == p.kv_cache.shape and torch.equal(view, p.kv_cache)
    for _ in range(3):
        assert call(*as_args(p, kv_cache_fp8=view), compress_ratio=1) is original.marker
    assert router.calls_taken == 0 and len(original.calls) == 3
    lines = [r.getMessage() for r in plugin_log if "stock path for this call" in r.getMessage()]
    assert len(lines) == 1, lines  # once per reason, not per call
    (line,) = lines
    # The layout and its consequence, in words a user can act on.
    for words in ("block-outer KV cache layout", "BLHNC/BLNHC", "VLLM_KV_CACHE_LAYOUT", "layer-contiguous"):
        assert words in line, line
    assert "DeepSeek-V4/V4.1" in line and "GLM-5-next" in line and "stays on the stock path" in line
    # The same data, layer-contiguous, is taken.
    call(*as_args(p), compress_ratio=1)
    assert router.calls_taken == 1


def test_doctor_explains_the_layout_and_flags_a_block_outer_setting():
    plain = doctor.report({envs.SWITCH: "1"})
    layout = plain["kv_cache_layout"]
    assert layout == {"variable": None, "block_outer": False, "note": kernels.BLOCK_OUTER_NOTE}
    text = doctor.render(plain)
    assert "layout:   FlyDSL needs a layer-contiguous indexer cache" in text
    assert "DeepSeek-V4/V4.1 and GLM-5-next" in " ".join(text.split())
    assert "is block-outer" not in text

    for value, outer in (("BLHNC", True), ("blnhc", True), ("BHLNC", True), ("LBNHC", False), ("NHD", False)):
        data = doctor.report({envs.SWITCH: "1", doctor.LAYOUT_VARIABLE: value})
        assert data["kv_cache_layout"]["block_outer"] is outer, value
        flagged = f"{doctor.LAYOUT_VARIABLE}={value} is set here and is block-outer" in doctor.render(data)
        assert flagged is outer, value


def test_doctor_layout_note_is_in_the_json(capsys):
    assert doctor.main(as_json=True, strict=False) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_cache_layout"]["note"] == kernels.BLOCK_OUTER_NOTE
