"""One router per resource: recommend (reads), telemetry (writes), admin (models, health)."""
