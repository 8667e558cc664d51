"""Accuracy benchmark: memfit vs the analytic, DeepSpeed-model-states and accelerate baselines.

    python -m benchmarks.accuracy                              # the live store
    python -m benchmarks.accuracy --db sqlite:////tmp/x.db --files more.parquet --report-dir /tmp/acc

For each split (leave-architecture-out, small-to-large; see :mod:`model.evaluate`) every estimator is
scored on the same held-out rows: MAPE (%) and its ratio to memfit's MAPE (> 1: that many times
worse than memfit), then memfit's upper-bound coverage and its k recommendation against the measured
oracle (exact-k, OOM and over-recomputation rates, %). Memory is per device, in bytes internally.

Exit codes: 0 done, 2 bad input (no rows, unreadable files, bad --params).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from model.evaluate import SPLITS, cross_evaluate, load_rows


def _table(summary: dict) -> list[str]:
    m, o = summary["metrics"], summary["oracle"]
    lines = [f"  {'estimator':<20} {'MAPE %':>9} {'p95 %':>9} {'x memfit':>9}",
             f"  {'memfit':<20} {m['mape_pct']:>9.2f} {m['p95_rel_err_pct']:>9.2f} {1.0:>9.2f}"]
    for name, b in summary["baselines"].items():
        lines.append(f"  {name:<20} {b['mape_pct']:>9.2f} {b['p95_rel_err_pct']:>9.2f} {b['ratio_to_memfit']:>9.2f}")
    lines.append(f"  memfit upper bound: coverage {100 * m['coverage']:.1f}% (n={m['n']}), "
                 f"mean excess over measured {m['mean_upper_excess_pct']:.1f}%")
    lines.append(f"  k recommendation over {o['n_cases']} (family, capacity) cases "
                 f"({o['n_both_infeasible']} both infeasible, {o['n_families']} families): exact-k "
                 f"{100 * o['exact_k_rate']:.1f}%, OOM {100 * o['oom_rate']:.1f}%, over {100 * o['over_rate']:.1f}% "
                 f"(mean +{o['mean_extra_layers']:.1f} layers), false infeasible {100 * o['false_infeasible_rate']:.1f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", help="SQLAlchemy URL of the telemetry store (default: data/telemetry.db)")
    p.add_argument("--files", nargs="*", default=[], help=".parquet/.csv telemetry files")
    p.add_argument("--n-estimators", type=int, help="boosting rounds (default: the estimator's)")
    p.add_argument("--params", default="{}", help="JSON object of PeakMemoryRegressor parameters, e.g. "
                                                  "'{\"n_jobs\": 1}' on a busy machine")
    p.add_argument("--json", help="also write all figures to this JSON file")
    p.add_argument("--report-dir", help="also write the full report (model.report) here")
    a = p.parse_args(argv)

    from model.estimator import PeakMemoryRegressor

    try:
        params = json.loads(a.params)
        PeakMemoryRegressor(**params)
        if a.n_estimators:
            params["n_estimators"] = a.n_estimators
        df, rejected = load_rows(a.db, a.files)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if df.empty:
        print("error: no valid rows", file=sys.stderr)
        return 2
    print(f"{len(df)} valid rows of {df['model_name'].nunique()} architectures from {df.attrs['sources']} "
          f"({len(rejected)} rejected, {df.attrs['n_oom_dropped']} OOM rows dropped); params {params or 'default'}")
    results, oof = {}, None
    for split in SPLITS:
        t0 = time.perf_counter()
        pred, upper, s = cross_evaluate(df, lambda: PeakMemoryRegressor(**params), split)
        results[split] = s
        if split == "leave_architecture_out":
            oof = (pred, upper)
        print(f"\n{split}: ", end="")
        if s.get("skipped"):
            print(f"skipped ({s['skipped']})")
            continue
        print(f"{s['n_test']} held-out rows of {len(s['test_architectures'])} architectures, "
              f"{s['n_folds']} fold(s), {time.perf_counter() - t0:.1f}s")
        print("\n".join(_table(s)))
    if a.json:
        from model.report import json_safe

        with open(a.json, "w") as f:
            json.dump(json_safe(results), f, indent=1, default=str)
    if a.report_dir:
        from model.report import write_report

        paths = write_report(a.report_dir, results, df, *oof)
        print(f"\nreport: {paths['md']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
