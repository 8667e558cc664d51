"""memfit's data: the architecture catalog, the telemetry store and the shipped telemetry dataset."""
