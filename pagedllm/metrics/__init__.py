"""Serving metrics: the StatLogger hooks and their Prometheus implementation (imported lazily)."""
