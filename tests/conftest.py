"""Makes the test helpers in this directory (e.g. tiny_models) importable from any test module."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
