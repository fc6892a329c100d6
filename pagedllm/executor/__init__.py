"""executor package."""
