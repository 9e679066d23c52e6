# SPDX-License-Identifier: Apache-2.0
"""Test double of ``aiter.ops.flydsl``: re-exports one FlyDSL kernel double.

``$AITER_DOUBLE_FLYDSL`` picks which API the name ``flydsl_fp8_paged_mqa_logits``
means, as different aiter revisions do: ``general`` (default; aiter PR #4221),
``general+entry`` (the general kernel with aiter's ``_gfx950`` entry beside it,
aiter f33a573e/6c1c496c),
``gfx950`` (the gfx950-specialised kernel), ``gfx950-early`` (its earlier
revision for heads 32/64 and next_n 1..2, e.g. aiter 9661da3a) and
``gfx950-padded-q`` (its revision that takes q padded to ``MAX_NN`` rows, e.g.
aiter f5b390371d), both unsupported and kept only to test that they are
refused (tests/test_gfx950_early_revision.py), ``none`` (an
aiter without it) or ``broken-import`` (an aiter/flydsl mismatch: importing
raises RuntimeError).
"""

import os

_WHICH = os.environ.get("AITER_DOUBLE_FLYDSL", "general")

if _WHICH == "general":
    from aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits import flydsl_fp8_paged_mqa_logits  # noqa: F401
elif _WHICH == "general+entry":
    from aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits import flydsl_fp8_paged_mqa_logits  # noqa: F401
    from aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_entry import (  # noqa: F401
        flydsl_fp8_paged_mqa_logits_gfx950,
    )
elif _WHICH == "gfx950":
    from aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950 import (  # noqa: F401
        flydsl_fp8_paged_mqa_logits,
        flydsl_fp8_paged_mqa_logits_gfx950,
    )
elif _WHICH == "gfx950-early":
    from aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_early import (  # noqa: F401
        flydsl_fp8_paged_mqa_logits,
        flydsl_fp8_paged_mqa_logits_gfx950,
    )
elif _WHICH == "gfx950-padded-q":
    from aiter.ops.flydsl.kernels.mqa_logits.fp8_paged_mqa_logits_gfx950_padded_q import (  # noqa: F401
        flydsl_fp8_paged_mqa_logits,
        flydsl_fp8_paged_mqa_logits_gfx950,
    )
elif _WHICH == "broken-import":
    raise RuntimeError("double: flydsl version does not match this aiter")
elif _WHICH != "none":
    raise ValueError(f"AITER_DOUBLE_FLYDSL={_WHICH!r} is not one of the revisions above")
