# SPDX-License-Identifier: Apache-2.0
"""The tools around the plugin: ``doctor``, ``check``, ``bench`` and ``tune``, and their harness.

The command line (:mod:`.cli`, :mod:`.cli_args`), the stock and patched paths
they run (:mod:`.paths`, :mod:`.arms`, vLLM's gfx950 mirror), the cases, the
pure-torch reference contracts and the measurement helpers. The plugin that
vLLM loads (the package above) never imports this subpackage.
"""
