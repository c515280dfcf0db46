"""images package."""
