# SPDX-License-Identifier: Apache-2.0
import sys

from vllm_flydsl_indexer.tools.cli import main

sys.exit(main())
