"""Makes the test helpers in this directory (e.g. tiny_models) importable from any test module, runs the Triton
kernels in Triton's interpreter on machines without a GPU, and gives each test worker one thread on small machines."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Before anything imports triton: @triton.jit (triton.language's own helpers included) picks
    # interpreter or compiler when it decorates, so the choice must hold for the whole session.
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("PYTEST_XDIST_WORKER") and os.cpu_count() and os.cpu_count() <= 2:
    # Tests spread over as many worker processes as cores: one thread each, not two per core.
    torch.set_num_threads(1)
