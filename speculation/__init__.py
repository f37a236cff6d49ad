"""speculation package."""
