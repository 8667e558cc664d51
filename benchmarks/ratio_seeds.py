"""The LightGBM ratio path forced on every row, over calibration seeds: how much of its figures is the seed.

    python -m benchmarks.ratio_seeds --files data/telemetry/telemetry.parquet
    python -m benchmarks.ratio_seeds --files data/telemetry/telemetry.parquet --seeds 0 1 2 3 4 \\
        --params '{"reg_lambda": 5.0}' --split small_to_large

For each seed, :class:`model.estimator.PeakMemoryRegressor` (``random_state`` = the seed, other parameters from
``--params``) is fitted and calibrated per fold and every held-out row is answered on the provisional path
(:class:`model.evaluate.CurveEstimator` with ``force_path="provisional"``), as the "provisional on every row" line of
``python -m benchmarks.accuracy`` does; that line is the seed-0 run here. The seed picks the 20 % of training
architectures that calibrate the conformal bound (and LightGBM's seed), so cover, excess, exact-k, OOM and no-fit move
with it while the point figures (MAPE, p95, max, saving) stay unless the trees are randomised. Printed: one line per
split and seed, in :data:`benchmarks.accuracy.HEADER`'s columns, then the minimum and maximum over the seeds.

Exit codes: 0 done, 2 bad input (no rows, unreadable files, bad --params or --seeds).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks.accuracy import COLUMNS, HEADER, _line, regressor_params, valid_rows
from model.evaluate import SPLITS, CurveEstimator, cross_evaluate


def seed_lines(df, split: str, seeds: list[int], params: dict, n_jobs: int) -> list[str]:
    """One printable line per seed of ``split`` (forced ratio path), then the spread over the seeds."""
    from model.estimator import PeakMemoryRegressor
    from model.terms import TermsCache

    terms = TermsCache()
    y = df["peak_allocated_bytes"].to_numpy(dtype="float64")
    lines, figures = [], []
    for seed in seeds:
        t0 = time.perf_counter()

        def make(seed=seed):
            return CurveEstimator(
                terms, lambda: PeakMemoryRegressor(**{**params, "random_state": seed}), force_path="provisional"
            )

        pred, upper, summary = cross_evaluate(df, make, split, n_jobs=n_jobs)
        if summary.get("skipped"):
            return [f"  skipped ({summary['skipped']})"]
        line, figs = _line(f"seed {seed}", y, pred, upper, df, np.isfinite(pred))
        lines.append(f"{line}  {time.perf_counter() - t0:.0f}s")
        figures.append(figs)
    if len(figures) > 1:
        spread = {f"{name} %": [get(f) for f in figures] for name, get in COLUMNS}
        lines.append("  over the seeds: " + "; ".join(f"{k} {min(v):.2f}-{max(v):.2f}" for k, v in spread.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ratio_seeds", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", help="SQLAlchemy URL of the telemetry store (default: data/telemetry.db)")
    p.add_argument("--files", nargs="*", default=[], help=".parquet/.csv telemetry files")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="calibration seeds (default 0 1 2)")
    p.add_argument("--params", default="{}", help="JSON object of other PeakMemoryRegressor parameters")
    p.add_argument("--split", choices=SPLITS, action="append", help="run only this split (repeatable; default all)")
    p.add_argument(
        "--jobs", type=int, default=1, help="folds evaluated at once (default 1; figures do not depend on it)"
    )
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error(f"--jobs must be >= 1, got {a.jobs}")
    if any(s < 0 for s in a.seeds):
        p.error(f"--seeds must be >= 0, got {a.seeds}")

    try:
        params = regressor_params(a.params)
        if "random_state" in params:
            raise ValueError("--params must not set random_state (--seeds sets it)")
        df, _rejected = valid_rows(a.db, a.files)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(df)} rows of {df['model_name'].nunique()} architectures; ratio-model params {params or 'default'}")
    for split in a.split or SPLITS:
        print(f"\n{split} (provisional LightGBM ratio path on every row):\n{HEADER}", flush=True)
        print("\n".join(seed_lines(df, split, a.seeds, params, a.jobs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
