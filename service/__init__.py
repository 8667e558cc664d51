"""memfit's HTTP service (FastAPI)."""
