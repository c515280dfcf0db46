"""snapshots package."""
