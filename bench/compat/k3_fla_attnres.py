"""pytest plugin: run fla's own AttnRes tests against k3's ``fused_attnres``.

fla's ``tests/ops/test_attnres.py`` compares ``fla.ops.attnres.fused_attnres`` with fla's ``naive_attnres``; with
this plugin loaded, the name ``fused_attnres`` that the test module imports is k3's (``k3.ops.fused_attnres``),
while the reference stays fla's own ``naive_attnres``. fla's test file is read from fla's repository for the run,
never copied here:

    PYTHONPATH=.:bench/compat python -m pytest -p k3_fla_attnres -q <fla checkout>/tests/ops/test_attnres.py

Expected exception: ``test_triton_ascend_backend_routing`` (fla's Ascend NPU backend dispatch; skipped off NPU).
"""

from __future__ import annotations

import fla.ops.attnres

import k3.ops

fla.ops.attnres.fused_attnres = k3.ops.fused_attnres
