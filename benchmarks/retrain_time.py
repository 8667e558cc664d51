"""Retraining-time benchmark: a local ``PeakMemoryRegressor.fit`` on 100k and 1M rows.

    python -m benchmarks.retrain_time                       # 100k and 1M rows from the live store
    python -m benchmarks.retrain_time --rows 20000 --params '{"n_jobs": 1}'

The store does not hold that many measurements, so the rows are *synthesised by resampling the
measured rows with replacement* (fresh record ids); they time the pipeline, not accuracy. Reported per
size: feature building (``model.features.build_features``) seconds, the whole fit (features, the
calibration model, conformal margin and the final model) in seconds and rows per second, and peak
memory is not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.retrain_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", help="SQLAlchemy URL of the telemetry store (default: data/telemetry.db)")
    p.add_argument("--files", nargs="*", default=[], help=".parquet/.csv telemetry files")
    p.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000], help="training-set sizes")
    p.add_argument("--n-estimators", type=int, help="boosting rounds (default: the estimator's)")
    p.add_argument("--params", default="{}", help="JSON object of PeakMemoryRegressor parameters")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from model.estimator import PeakMemoryRegressor
    from model.evaluate import group_labels, load_rows
    from model.features import build_features

    try:
        params = json.loads(a.params)
        if a.n_estimators:
            params["n_estimators"] = a.n_estimators
        PeakMemoryRegressor(**params)
        df, _ = load_rows(a.db, a.files)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if df["model_name"].nunique() < 2 or any(n < 1 for n in a.rows):
        print("error: need measured rows of >= 2 architectures and --rows >= 1", file=sys.stderr)
        return 2
    est = PeakMemoryRegressor(**params)
    print(
        f"rows synthesised by resampling {len(df)} measured rows ({df['model_name'].nunique()} architectures) "
        f"with replacement: timing only, not accuracy; params {est.get_params()}"
    )
    print(f"{'rows':>10} {'features s':>11} {'fit s':>9} {'rows/s':>10}")
    rng = np.random.default_rng(a.seed)
    for n in a.rows:
        big = df.iloc[rng.integers(0, len(df), n)].reset_index(drop=True)
        big["record_id"] = [f"rs{i:09d}" for i in range(n)]
        y = big["peak_allocated_bytes"].to_numpy(dtype="float64")
        t0 = time.perf_counter()
        build_features(big)
        feat_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        PeakMemoryRegressor(**params).fit(big, y, groups=group_labels(big))
        fit_s = time.perf_counter() - t0
        print(f"{n:>10} {feat_s:>11.1f} {fit_s:>9.1f} {n / fit_s:>10.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
