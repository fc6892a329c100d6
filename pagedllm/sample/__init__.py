"""sample package."""
