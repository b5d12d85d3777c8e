"""Kernel tier: Triton kernels run under the Triton interpreter on CPU.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` decorator runs (Triton picks the
interpreter at decoration time), so it is set here, at conftest import, before the test modules
import ``loraplane.worker.kernels.*``. Nothing imported earlier by pytest may import the
Triton kernel modules; ``loraplane.worker.kernels`` itself loads them lazily. ``setdefault``
lets a GPU run opt out with ``TRITON_INTERPRET=0``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
