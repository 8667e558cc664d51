"""Benchmarks: predictor accuracy against published estimators, and retraining time."""
