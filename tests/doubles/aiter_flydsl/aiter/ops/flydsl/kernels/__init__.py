# SPDX-License-Identifier: Apache-2.0
"""FlyDSL kernel doubles; absent (ImportError) when ``$AITER_DOUBLE_FLYDSL`` is ``none``."""

import os

if os.environ.get("AITER_DOUBLE_FLYDSL") == "none":
    raise ImportError("double: this aiter has no FlyDSL kernels")
