#!/usr/bin/env python3
"""The split prefill's floor without its span pass: ``knob_ab`` with one more knob class, ``Probe.skip_span``, that
turns ``chunk16.launch_c16_span`` into a no-op (results garbage: the check fails by design). It bounds what a
cheaper span pass can buy, e.g.

    python bench/span_floor_probe.py --cases prefill8 --rounds 3 --variant nospan Probe.skip_span=True
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import knob_ab  # noqa: E402
from k3.ops.kda.triton import span  # noqa: E402


class Probe:
    skip_span = False


_launch = span.c16_flow.launch_c16_span


def _maybe_span(*args, **kwargs) -> None:
    if not Probe.skip_span:
        _launch(*args, **kwargs)


span.c16_flow.launch_c16_span = _maybe_span
knob_ab.CLASSES["Probe"] = Probe

if __name__ == "__main__":
    sys.exit(knob_ab.main())
