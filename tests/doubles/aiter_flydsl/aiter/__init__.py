# SPDX-License-Identifier: Apache-2.0
"""Test double of aiter: the two paged MQA logits kernels, built on the reference.

* ``aiter.ops.triton.pa_mqa_logits.deepgemm_fp8_paged_mqa_logits``: Gluon's
  write contract (values, ``-inf`` past the causal bound up to the length or
  the block-rounded length).
* ``aiter.ops.flydsl.flydsl_fp8_paged_mqa_logits``: FlyDSL's write contract and
  every assert of aiter PR #4221's wrapper.

Both record their calls in ``aiter.CALLS`` so tests can see which arm ran.
Never shipped; the package only routes to the real kernels.
"""

CALLS: list[tuple[str, dict]] = []
