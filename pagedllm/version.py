"""pagedllm's version, in a module of its own so that the server can report it without importing the package's API."""
from __future__ import annotations

__version__ = "0.1.0"
