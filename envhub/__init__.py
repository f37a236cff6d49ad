"""envhub package."""
