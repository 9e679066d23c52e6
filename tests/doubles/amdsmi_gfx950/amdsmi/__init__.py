# SPDX-License-Identifier: Apache-2.0
"""Test double of ``amdsmi``: one GPU whose arch is $AMDSMI_DOUBLE_ARCH (gfx950).

Putting this folder on ``sys.path`` makes real vLLM believe it runs on ROCm
with that arch. It is a test double, never shipped.
"""

import os
from enum import IntEnum


class AmdSmiException(Exception):
    pass


class AmdSmiMemoryType(IntEnum):
    VRAM = 0


def amdsmi_init(*args, **kwargs):
    return None


def amdsmi_shut_down(*args, **kwargs):
    return None


def amdsmi_get_processor_handles():
    return ["gpu0"]


def amdsmi_get_gpu_asic_info(handle):
    arch = os.environ.get("AMDSMI_DOUBLE_ARCH", "gfx950")
    return {"target_graphics_version": arch, "market_name": f"double {arch}"}


def amdsmi_get_gpu_device_uuid(handle):
    return "00000000-0000-0000-0000-000000000000"


def amdsmi_get_gpu_memory_total(handle, kind):
    return 288 * 1024**3


def amdsmi_topo_get_link_type(a, b):
    return {"hops": 1, "type": 2}


def amdsmi_topo_get_numa_node_number(handle):
    return 0
