"""layers package."""
