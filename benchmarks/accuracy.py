"""Accuracy benchmark of the one curve (model.curve), per path, against the analytic and published baselines.

    python -m benchmarks.accuracy --files data/telemetry/telemetry.parquet
    python -m benchmarks.accuracy --db sqlite:////tmp/x.db --json out.json --report-dir /tmp/acc
    python -m benchmarks.accuracy --files data/telemetry/telemetry.parquet --jobs 2   # two folds at once

For each split (leave-architecture-out, small-to-large; :mod:`model.evaluate`), every row is answered
by :meth:`model.curve.MemoryPredictor.curve` as the service answers it (:class:`model.evaluate.CurveEstimator`:
traced path where the configuration's phase terms are shipped, provisional otherwise: learned phase
coefficients where they cover the configuration, the LightGBM ratio model elsewhere; the coefficient
model and the ratio model only see the training architectures' terms and rows),
a second time with the provisional LightGBM-ratio path forced on every row, and a third time with the
provisional path of learned phase coefficients (:mod:`model.coefficients`, composed per phase; the ratio
model where they don't cover the configuration) forced on every row. Printed per path: MAPE, p95 and max
error (%), the error of the checkpointing saving peak(k=0) − peak(k=L) (median over families, %), the
bound's coverage and mean excess (%), the k recommendation against the measured oracle, and the
provisional path against our analytic formula per precision × optimizer slice. Then (unless ``--no-reserved``) the
predicted reserved peak against the clean H200 rows (:func:`reserved_table`).

Exit codes: 0 done, 2 bad input (no rows, unreadable files, bad --params).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from model.evaluate import (
    SPLITS,
    CurveEstimator,
    baseline_predictions,
    cross_evaluate,
    load_rows,
    metrics,
    oracle_eval,
    row_paths,
    saving_errors,
)

#: the figures of a path row after n, in :data:`HEADER`'s order: (name, its printed value from :func:`_line`'s figures)
COLUMNS: tuple[tuple[str, Callable[[dict], float]], ...] = (
    ("MAPE", lambda f: f["mape_pct"]),
    ("p95", lambda f: f["p95_rel_err_pct"]),
    ("max", lambda f: f["max_rel_err_pct"]),
    ("saving", lambda f: f["saving_median_err_pct"]),
    ("cover", lambda f: 100 * f["coverage"]),
    ("excess", lambda f: f["mean_upper_excess_pct"]),
    ("exact-k", lambda f: 100 * f["oracle"]["exact_k_rate"]),
    ("OOM", lambda f: 100 * f["oracle"]["oom_rate"]),
    ("no-fit", lambda f: 100 * f["oracle"]["false_infeasible_rate"]),
)


def _line(name: str, y, pred, upper, df, sel) -> tuple[str, dict]:
    m = metrics(y[sel], pred[sel], upper[sel])
    se = saving_errors(df[sel], pred[sel]) if sel.any() else np.array([])
    o = (
        oracle_eval(df[sel], upper[sel])
        if sel.any()
        else {"exact_k_rate": np.nan, "oom_rate": np.nan, "false_infeasible_rate": np.nan, "n_cases": 0}
    )
    med = 100 * float(np.median(se)) if se.size else float("nan")
    row = (
        f"  {name:<26} {m['n']:>5} {m['mape_pct']:>8.3f} {m['p95_rel_err_pct']:>7.2f} {m['max_rel_err_pct']:>7.2f} "
        f"{med:>8.3f} {100 * m['coverage']:>7.1f} {m['mean_upper_excess_pct']:>7.2f} "
        f"{100 * o['exact_k_rate']:>7.1f} {100 * o['oom_rate']:>5.1f} {100 * o['false_infeasible_rate']:>6.1f}"
    )
    return row, {**m, "saving_median_err_pct": med, "saving_n": int(se.size), "oracle": o}


def setting_slices(df) -> dict[str, np.ndarray]:
    """Boolean row masks of the optimizer, quantization, offload, parallel, MoE and accumulation settings (columns
    missing from older files select nothing)."""

    def col(name, default):
        return df[name] if name in df.columns else np.full(len(df), default)

    def flag(name):
        return col(name, False).fillna(False).astype(bool).to_numpy() if name in df.columns else np.zeros(len(df), bool)

    optimizer = df["optimizer"].to_numpy()
    return {
        "optimizer adamw_8bit": optimizer == "adamw_8bit",
        "optimizer paged_adamw_8bit": optimizer == "paged_adamw_8bit",
        "optimizer lion": optimizer == "lion",
        "optimizer_in_backward": flag("optimizer_in_backward"),
        "quantization (QLoRA)": np.asarray(col("quantization", "none").fillna("none") != "none"),
        "offload_optimizer cpu": np.asarray(col("offload_optimizer", "none").fillna("none") == "cpu"),
        "tensor_parallel_size > 1": np.asarray(col("tensor_parallel_size", 1).fillna(1) > 1),
        "sequence_parallel": flag("sequence_parallel"),
        "MoE (num_experts set)": np.asarray(col("num_experts", np.nan).notna()),
        "MoE expert_parallel_size > 1": np.asarray(col("expert_parallel_size", 1).fillna(1) > 1),
        "gradient_accumulation_steps > 1": np.asarray(col("gradient_accumulation_steps", 1).fillna(1) > 1),
    }


HEADER = (
    f"  {'path (rows)':<26} {'n':>5} {'MAPE %':>8} {'p95 %':>7} {'max %':>7} {'saving%':>8} {'cover%':>7} "
    f"{'excess%':>7} {'exactk%':>7} {'OOM%':>5} {'noFit%':>6}"
)


def evaluate_split(
    df, split: str, make_served, make_provisional, paths, make_learned=None, n_jobs: int = 1
) -> tuple[list[str], dict]:
    """The runs of one split (folds ``n_jobs`` at once); returns printable lines and the figures."""
    y = df["peak_allocated_bytes"].to_numpy(dtype="float64")
    t0 = time.perf_counter()
    pred, upper, s = cross_evaluate(df, make_served, split, n_jobs=n_jobs)
    if s.get("skipped"):
        return [f"  skipped ({s['skipped']})"], {"skipped": s["skipped"]}
    p_pred, p_upper, _ = cross_evaluate(df, make_provisional, split, n_jobs=n_jobs)
    if make_learned is not None:
        l_pred, l_upper, _ = cross_evaluate(df, make_learned, split, n_jobs=n_jobs)
    tested = np.isfinite(pred)
    analytic = baseline_predictions(df)["analytic"]
    lines = [
        (
            f"  {int(tested.sum())} held-out rows of {len(s['test_architectures'])} architectures, "
            f"{s['n_folds']} fold(s), {time.perf_counter() - t0:.0f}s"
        ),
        HEADER,
    ]
    out: dict = {"n_test": int(tested.sum()), "test_architectures": s["test_architectures"]}
    for name, pr, up, sel in [
        ("served curve (all)", pred, upper, tested),
        ("traced path", pred, upper, tested & (paths == "traced")),
        ("served provisional rows", pred, upper, tested & (paths == "provisional")),
        ("provisional on every row", p_pred, p_upper, tested),
        *([("learned coefficients", l_pred, l_upper, tested)] if make_learned is not None else []),
        ("analytic formula", analytic, analytic, tested),
    ]:
        line, figs = _line(name, y, pr, up, df, sel)
        lines.append(line)
        out[name] = figs
    lines.append(
        "  provisional (LightGBM ratio; learned coefficients) vs analytic MAPE % per precision x optimizer slice:"
    )
    slices = {}
    for (prec, opt), g in df[tested].groupby(["precision", "optimizer"]):
        idx = g.index.to_numpy()
        mp, ma = metrics(y[idx], p_pred[idx])["mape_pct"], metrics(y[idx], analytic[idx])["mape_pct"]
        slices[f"{prec}/{opt}"] = {"provisional": mp, "analytic": ma, "n": len(idx)}
        line = (
            f"    {prec + '/' + opt:<32} n={len(idx):>5}  provisional {mp:7.2f} {'beats' if mp < ma else 'LOSES'}"
            f"  analytic {ma:7.2f}"
        )
        if make_learned is not None:
            ml = metrics(y[idx], l_pred[idx])["mape_pct"]
            slices[f"{prec}/{opt}"]["learned_coefficients"] = ml
            line += f"  learned {ml:7.2f} {'beats' if ml < ma else 'LOSES'}"
        lines.append(line)
    out["slices"] = slices
    head = "  served curve per issue-9 setting (held-out architectures; path counts traced/provisional):"
    settings = {}
    for name, sel in setting_slices(df).items():
        sel = sel & tested
        if not sel.any():
            continue
        m = metrics(y[sel], pred[sel], upper[sel])
        n_traced = int((paths[sel] == "traced").sum())
        settings[name] = {**m, "traced": n_traced}
        if head:
            lines.append(head)
            head = ""
        lines.append(
            f"    {name:<32} n={m['n']:>5}  MAPE {m['mape_pct']:6.2f}  p95 {m['p95_rel_err_pct']:6.2f}  "
            f"cover {100 * m['coverage']:5.1f}  traced/provisional {n_traced}/{m['n'] - n_traced}"
        )
    out["settings"] = settings
    out["per_architecture"] = {a: m for a, m in s["per_architecture"].items()}
    out["oof"] = (pred, upper)
    return lines, out


def reserved_table() -> dict:
    """Print issue 27's reserved-memory table (:mod:`benchmarks.allocator_reserved`: every clean H200 row's step
    replayed through :mod:`model.allocator` with PyTorch's defaults, and the smallest-cap runs) and return its
    figures: rows, rows within 2 % or 256 MiB, median and worst |error| (%)."""
    from benchmarks import allocator_reserved as ar
    from tracer.allocation import cuda_trace_policy

    t0 = time.perf_counter()
    context = cuda_trace_policy()
    rows = ar.reserved_rows(context)
    pressure = ar.pressure_rows(context)
    print("\nreserved memory:\n" + ar.render(rows, pressure, context[0], time.perf_counter() - t0), end="", flush=True)
    errors = [100 * abs(r["sim_reserved"] - r["reserved"]) / r["reserved"] for r in rows]
    return {
        "n": len(rows),
        "within_tolerance": sum(ar.within(r["sim_reserved"], r["reserved"]) for r in rows),
        "median_abs_err_pct": float(np.median(errors)) if errors else None,
        "max_abs_err_pct": max(errors, default=None),
    }


def regressor_params(params_json: str) -> dict:
    """The ``--params`` JSON object, checked by constructing :class:`model.estimator.PeakMemoryRegressor` with it.

    Raises:
        ValueError: not JSON. TypeError: not an object, or a parameter the regressor does not take.
    """
    from model.estimator import PeakMemoryRegressor

    params = json.loads(params_json)
    if not isinstance(params, dict):
        raise TypeError(f"--params must be a JSON object, got {params_json}")
    PeakMemoryRegressor(**params)
    return params


def valid_rows(db: str | None, files) -> tuple[pd.DataFrame, list[dict]]:
    """:func:`model.evaluate.load_rows`, refusing an empty result.

    Raises:
        ValueError: unreadable rows or no valid rows. FileNotFoundError: a missing file.
    """
    df, rejected = load_rows(db, files)
    if df.empty:
        raise ValueError("no valid rows")
    return df, rejected


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", help="SQLAlchemy URL of the telemetry store (default: data/telemetry.db)")
    p.add_argument("--files", nargs="*", default=[], help=".parquet/.csv telemetry files")
    p.add_argument(
        "--params",
        default="{}",
        help="JSON object of PeakMemoryRegressor parameters (provisional path), e.g. '{\"n_estimators\": 300}'",
    )
    p.add_argument("--json", help="also write all figures to this JSON file")
    p.add_argument("--split", choices=SPLITS, action="append", help="run only this split (repeatable; default all)")
    p.add_argument("--no-learned", action="store_true", help="skip the learned-coefficients run")
    p.add_argument(
        "--no-reserved",
        action="store_true",
        help="skip the reserved-memory table (benchmarks.allocator_reserved: predicted reserved peak vs the clean "
        "H200 rows' max_memory_reserved)",
    )
    p.add_argument("--report-dir", help="also write the full report (model.report) here")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="folds evaluated at once, each in a worker process (default 1; the figures do not depend on it)",
    )
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error(f"--jobs must be >= 1, got {a.jobs}")

    from model.coefficients import CoefficientModel
    from model.estimator import PeakMemoryRegressor
    from model.terms import TermsCache, shipped_entries

    try:
        params = regressor_params(a.params)
        df, rejected = valid_rows(a.db, a.files)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    terms = TermsCache()
    paths = row_paths(df, terms)
    print(
        f"{len(df)} valid rows of {df['model_name'].nunique()} architectures ({len(rejected)} rejected, "
        f"{df.attrs['n_oom_dropped']} OOM rows dropped); {len(terms)} traced term sets; "
        f"{int((paths == 'traced').sum())} rows on the traced path; provisional params {params or 'default'}"
    )

    entries = shipped_entries()

    def make_served():  # as the service answers: traced terms, else learned coefficients, else the ratio model
        return CurveEstimator(
            terms,
            lambda: PeakMemoryRegressor(**params),
            make_coefficients=CoefficientModel,
            coefficient_entries=entries,
        )

    def make_provisional():
        return CurveEstimator(terms, lambda: PeakMemoryRegressor(**params), force_path="provisional")

    def make_learned():  # coefficients of the training architectures' shipped terms only
        return CurveEstimator(
            terms,
            lambda: PeakMemoryRegressor(**params),
            force_path="provisional",
            make_coefficients=CoefficientModel,
            coefficient_entries=entries,
        )

    results, oof = {}, None
    for split in a.split or SPLITS:
        print(f"\n{split}:")
        lines, figs = evaluate_split(
            df, split, make_served, make_provisional, paths, None if a.no_learned else make_learned, n_jobs=a.jobs
        )
        print("\n".join(lines), flush=True)
        if "oof" in figs:
            pred_upper = figs.pop("oof")
            if split == "leave_architecture_out":
                oof = pred_upper
        results[split] = figs
    if not a.no_reserved:
        results["reserved"] = reserved_table()
    if a.json:
        from model.report import json_safe

        with open(a.json, "w") as f:
            json.dump(json_safe(results), f, indent=1, default=str)
    if a.report_dir and oof is not None:
        from model.report import curves_figure

        path = curves_figure(a.report_dir, df, *oof)
        print(f"\npredicted vs measured curves per held-out architecture: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
