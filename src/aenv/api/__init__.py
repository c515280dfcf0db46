"""The E2B-compatible control plane (FastAPI): app factory, routes, models, errors, auth."""
