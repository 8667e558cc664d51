"""Retrain the peak-memory predictor from telemetry, evaluate it, register it and promote it if it is no worse.

    python -m training.retrain                                  # live store, default registry
    python -m training.retrain --db sqlite:////tmp/x.db --files more.parquet --registry /tmp/models
    python -m training.retrain --engine dask --dask-address tcp://scheduler:8786
    python -m training.retrain --dry-run --report-dir /tmp/report   # evaluate and report only

Steps (progress lines on stderr, one JSON summary line on stdout at the end):

1. load + validate rows (:func:`model.evaluate.load_rows`: schema-checked, de-duplicated, OOM rows dropped);
2. evaluate leave-architecture-out and small-to-large (:func:`model.evaluate.cross_evaluate`, local);
3. hold out the deterministic gate set: rows with ``int(sha256(record_id), 16) % 10 == 0``;
4. train the final model on the other rows (groups = ``model_name``), locally or on a Dask cluster
   (``lightgbm.dask.DaskLGBMRegressor`` with the same LightGBM parameters; its booster then goes
   through ``PeakMemoryRegressor.fit(..., booster=)`` for calibration, so the artifact is the same),
   and the learned phase coefficients (:class:`model.coefficients.CoefficientModel`) on the shipped traced
   terms (``--coefficients``, default on): the provisional path of the configurations they cover. Each
   path's bound margin is calibrated by split conformal on held-out architectures
   (:meth:`model.evaluate.CurveEstimator.fit`);
5. register it (:class:`model.registry.Registry`) and write the report into ``<version>/report``;
6. compare with the current model on the gate rows and promote when :func:`promotion_decision` allows.
   A current model that cannot be loaded (:class:`model.registry.IncompatibleArtifact`) counts as
   absent, and this is reported.

Exit codes: 0 promoted (or dry run done), 3 registered but not promoted, 2 bad input or too few
rows, 1 unexpected error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_NOT_PROMOTED = 0, 1, 2, 3
#: promotion: new gate MAPE <= current * MAPE_TOLERANCE, and new coverage >= min(current, COVERAGE_FLOOR) - slack
MAPE_TOLERANCE = 1.02
COVERAGE_FLOOR = 0.95
COVERAGE_SLACK = 0.01
#: the final model's calibration holds out architectures (leave-architecture-out evaluation needs 3)
MIN_ARCHITECTURES = 2


class BadInput(ValueError):
    """Input that cannot be trained on (exit code 2)."""


def promotion_decision(new: dict[str, Any], current: dict[str, Any] | None) -> tuple[bool, str]:
    """Whether a new model may replace the current one, judged on the gate rows.

    Args:
        new, current: :func:`model.evaluate.metrics` of each model on the same gate rows
            (``mape_pct``, ``coverage``, ``n``); ``current=None`` when there is no usable current model.

    Returns:
        ``(promote, reason)``. Promote when there is no current model, or when
        ``new MAPE <= current MAPE * 1.02`` and ``new coverage >= min(current coverage, 0.95) - 0.01``.
    """
    if current is None:
        return True, "no usable current model"
    if not new.get("n"):
        return False, "gate set is empty: cannot compare with the current model"
    m_new, m_cur = float(new["mape_pct"]), float(current["mape_pct"])
    c_new, c_cur = float(new["coverage"]), float(current["coverage"])
    need_cov = min(c_cur, COVERAGE_FLOOR) - COVERAGE_SLACK
    problems = []
    if not m_new <= m_cur * MAPE_TOLERANCE:
        problems.append(f"gate MAPE {m_new:.3f}% > current {m_cur:.3f}% x {MAPE_TOLERANCE}")
    if not c_new >= need_cov:
        problems.append(f"gate coverage {c_new:.3f} < min(current {c_cur:.3f}, {COVERAGE_FLOOR}) - {COVERAGE_SLACK}")
    if problems:
        return False, "; ".join(problems)
    return True, (f"gate MAPE {m_new:.3f}% vs current {m_cur:.3f}%, coverage {c_new:.3f} vs {c_cur:.3f}")


def train_booster_dask(X: pd.DataFrame, y: np.ndarray, est, address: str, log: Callable[[str], None] = print):
    """Train the LightGBM booster on a Dask cluster with ``est.lgb_params()`` and ``est.n_estimators``.

    Args:
        X: flat telemetry rows; y: measured peak bytes, shape ``(n,)``.
        est: a :class:`model.estimator.PeakMemoryRegressor` (its parameters are used).
        address: Dask scheduler address (``tcp://host:8786``).

    Returns:
        ``lightgbm.Booster`` fitted on the log-ratio target ``log(y) - log_analytic_peak``.
    """
    import dask.dataframe as dd
    from distributed import Client
    from lightgbm.dask import DaskLGBMRegressor

    from model.features import build_features

    feats = build_features(X).reset_index(drop=True)
    target = pd.Series(np.log(np.asarray(y, dtype="float64")) - feats["log_analytic_peak"].to_numpy(), name="target")
    try:
        client = Client(address, timeout=30)
    except (OSError, TimeoutError) as err:
        raise BadInput(f"cannot reach the Dask scheduler at {address}: {err}") from err
    with client:
        n_workers = max(1, len(client.scheduler_info()["workers"]))
        parts = max(1, min(n_workers, len(feats) // 20 or 1))
        log(f"dask: {n_workers} worker(s), {parts} partition(s), {len(feats)} rows")
        dX = dd.from_pandas(feats, npartitions=parts, sort=False)
        dy = dd.from_pandas(target, npartitions=parts, sort=False)
        params = {k: v for k, v in est.lgb_params().items() if k != "num_threads"}  # dask: worker threads
        model = DaskLGBMRegressor(client=client, n_estimators=est.n_estimators, **params)
        with warnings.catch_warnings():  # lightgbm.dask sets threads from the workers and says so
            warnings.filterwarnings("ignore", message="Parameter (n_jobs|num_threads) will be ignored")
            model.fit(dX, dy)
        return model.booster_


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.retrain", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--db",
        help="SQLAlchemy URL of the telemetry store (default: the service's, <MEMFIT_DATA_DIR>/telemetry.db or "
        "$MEMFIT_DB_URL; read when given or when no --files are)",
    )
    p.add_argument("--files", nargs="*", default=[], help=".parquet/.csv/.jsonl telemetry files")
    p.add_argument(
        "--registry",
        help="model registry root (default: the service's, <MEMFIT_DATA_DIR>/models or $MEMFIT_REGISTRY_DIR)",
    )
    p.add_argument(
        "--report-dir", help="report folder (default <registry>/<version>/report; a temp folder with --dry-run)"
    )
    p.add_argument("--engine", choices=["local", "dask"], default="local", help="where the final model trains")
    p.add_argument("--dask-address", help="Dask scheduler address (required with --engine dask)")
    p.add_argument("--n-estimators", type=int, help="boosting rounds (default: the estimator's)")
    p.add_argument("--params", default="{}", help="JSON object of other PeakMemoryRegressor parameters")
    p.add_argument(
        "--coefficients",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also fit, evaluate and register the learned phase coefficients of the provisional path "
        "(model.coefficients; default on)",
    )
    p.add_argument(
        "--coefficient-estimators", type=int, help="boosting rounds per coefficient (default: the CoefficientModel's)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="evaluation folds run at once, each in a worker process (default 1; the evaluation does not depend on it)",
    )
    p.add_argument("--dry-run", action="store_true", help="evaluate and report, register nothing")
    p.add_argument("--min-rows", type=int, default=100, help="fewest valid rows to train on (default 100)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _estimator_params(a: argparse.Namespace) -> dict[str, Any]:
    from model.estimator import PeakMemoryRegressor

    try:
        params = json.loads(a.params)
    except json.JSONDecodeError as err:
        raise BadInput(f"--params is not JSON: {err}") from err
    if not isinstance(params, dict):
        raise BadInput("--params must be a JSON object")
    unknown = set(params) - set(PeakMemoryRegressor().get_params())
    if unknown:
        raise BadInput(
            f"--params: unknown parameters {sorted(unknown)}; allowed: {sorted(PeakMemoryRegressor().get_params())}"
        )
    if a.n_estimators is not None:
        if a.n_estimators < 1:
            raise BadInput("--n-estimators must be >= 1")
        params["n_estimators"] = a.n_estimators
    return params


def _load_current(registry, gate_df: pd.DataFrame, log: Callable[[str], None], terms=None) -> dict[str, Any]:
    """The current model's identity and gate metrics (through the same curve as the new one), or why it
    counts as absent."""
    from model.curve import PROVISIONAL
    from model.evaluate import CurveEstimator, metrics
    from model.registry import IncompatibleArtifact
    from model.terms import TermsCache

    out: dict[str, Any] = {"version": registry.current(), "status": "absent", "metrics": None}
    if out["version"] is None:
        return out
    try:
        cur = registry.load()
        if len(gate_df):
            y = gate_df["peak_allocated_bytes"].to_numpy(dtype="float64")
            ce = CurveEstimator(terms if terms is not None else TermsCache())
            ce.provisional_ = cur.estimator
            ce.coefficients_ = cur.coefficients
            ce.margins_ = {
                PROVISIONAL: float(np.expm1(cur.estimator.conformal_log_margin_)),
                **cur.meta.get("bound_margins", {}),
            }
            out["metrics"] = metrics(y, *ce.predict_both(gate_df))
        else:
            out["metrics"] = metrics([], [], [])
        out["status"] = "loaded"
    except (IncompatibleArtifact, FileNotFoundError) as err:
        out["status"] = f"unusable, treated as absent: {type(err).__name__}: {err}"
        log(f"current model {out['version']} is {out['status']}")
    except Exception as err:  # noqa: BLE001 - loads but cannot predict: as unusable as a corrupt file
        out["status"] = f"unusable, treated as absent: predicting failed: {type(err).__name__}: {err}"
        log(f"current model {out['version']} is {out['status']}")
    return out


def run(a: argparse.Namespace, log: Callable[[str], None], summary: dict[str, Any]) -> int:
    """The retraining steps (see the module docstring); fills ``summary``; returns the exit code."""
    from model.estimator import PeakMemoryRegressor
    from model.evaluate import SPLITS, CurveEstimator, cross_evaluate, gate_mask, group_labels, load_rows, metrics
    from model.registry import Registry, fingerprint
    from model.report import json_safe, write_report
    from model.terms import TermsCache

    if a.engine == "dask" and not a.dask_address:
        raise BadInput("--engine dask needs --dask-address")
    if a.min_rows < 1:
        raise BadInput("--min-rows must be >= 1")
    if a.jobs < 1:
        raise BadInput(f"--jobs must be >= 1, got {a.jobs}")
    params = _estimator_params(a)
    registry = Registry(a.registry)

    log("[1/6] loading and validating telemetry")
    try:
        df, rejected = load_rows(a.db, a.files)
    except (FileNotFoundError, ValueError) as err:
        raise BadInput(str(err)) from err
    at = df.attrs
    summary.update(rows=len(df), rejected=len(rejected), oom_dropped=at["n_oom_dropped"], duplicates=at["n_duplicates"])
    log(
        f"      {at['n_input']} input rows from {at['sources']}: {len(df)} valid, {len(rejected)} rejected, "
        f"{at['n_oom_dropped']} OOM (censored) dropped, {at['n_duplicates']} duplicates"
    )
    for r in rejected[:5]:
        log(f"      rejected {r['record_id']}: {r['reason'][:200]}")
    if len(df) < a.min_rows:
        hint = (
            "; the store is empty until telemetry arrives (POST /telemetry) or the shipped rows are loaded "
            "(scripts/main.sh): pass --files data/telemetry/telemetry.parquet to train on those"
            if not a.files and at["n_input"] == 0
            else ""
        )
        raise BadInput(f"{len(df)} valid rows < --min-rows {a.min_rows}{hint}")
    groups = group_labels(df)
    if len(set(groups)) < MIN_ARCHITECTURES:
        raise BadInput(
            f"rows of {len(set(groups))} architecture(s); need >= {MIN_ARCHITECTURES} "
            "(calibration holds out architectures)"
        )

    make_coefficients = entries = None
    if a.coefficients:
        from model.coefficients import CoefficientModel
        from model.terms import shipped_entries

        if a.coefficient_estimators is not None and a.coefficient_estimators < 1:
            raise BadInput("--coefficient-estimators must be >= 1")
        coef_params = {} if a.coefficient_estimators is None else {"n_estimators": a.coefficient_estimators}
        entries = shipped_entries()

        def make_coefficients():
            return CoefficientModel(**coef_params)

    def make_curve():  # the curve as served: traced terms, else learned coefficients, else the ratio model
        return CurveEstimator(
            terms,
            lambda: PeakMemoryRegressor(**params),
            make_coefficients=make_coefficients,
            coefficient_entries=entries,
        )

    log(
        f"[2/6] evaluating the curve ({', '.join(SPLITS)}) with {params or 'default parameters'}"
        f"{', learned coefficients' if a.coefficients else ''}"
    )
    terms = TermsCache()
    results: dict[str, Any] = {}
    oof: tuple[np.ndarray, np.ndarray] | None = None
    for split in SPLITS:
        pred, upper, s = cross_evaluate(df, make_curve, split, progress=lambda m: log(f"      {m}"), n_jobs=a.jobs)
        results[split] = s
        if split == "leave_architecture_out":
            oof = (pred, upper)
        m = s["metrics"]
        log(
            f"      {split}: "
            + (
                f"skipped ({s['skipped']})"
                if s.get("skipped")
                else f"MAPE {m['mape_pct']:.2f}%, coverage {m['coverage']:.3f}, "
                f"exact-k {s['oracle']['exact_k_rate']:.3f}, OOM {s['oracle']['oom_rate']:.3f}"
            )
        )
    summary["lao_mape_pct"] = results["leave_architecture_out"]["metrics"]["mape_pct"]
    summary["lao_coverage"] = results["leave_architecture_out"]["metrics"]["coverage"]
    summary["s2l_mape_pct"] = results["small_to_large"]["metrics"]["mape_pct"]

    gate = gate_mask(df["record_id"])
    train_df, gate_df = df[~gate].reset_index(drop=True), df[gate].reset_index(drop=True)
    summary["gate_rows"] = int(gate.sum())
    log(f"[3/6] gate set: {len(gate_df)} rows held out, {len(train_df)} to train on")
    if len(set(group_labels(train_df))) < 2:
        raise BadInput("training rows (gate excluded) cover fewer than 2 architectures")

    log(f"[4/6] training the final model ({a.engine} engine)")
    t0 = time.perf_counter()
    est = PeakMemoryRegressor(**params)
    y_train = train_df["peak_allocated_bytes"].to_numpy(dtype="float64")
    booster = train_booster_dask(train_df, y_train, est, a.dask_address, log) if a.engine == "dask" else None
    est.fit(train_df, y_train, groups=group_labels(train_df), booster=booster)
    train_s = time.perf_counter() - t0
    log(
        f"      trained on {len(train_df)} rows in {train_s:.1f}s; conformal log margin "
        f"{est.conformal_log_margin_:.4f} (x{np.exp(est.conformal_log_margin_):.3f})"
    )

    curve_est = make_curve().fit(train_df, y_train, groups=group_labels(train_df), provisional=est)
    coefficients = None
    if a.coefficients:  # served: fitted on every shipped terms entry (traced terms, not telemetry: no gate rows)
        t0 = time.perf_counter()
        coefficients = make_coefficients().fit(entries)
        curve_est.coefficients_ = coefficients
        log(
            f"      learned coefficients: {sum(len(b) for b in coefficients.boosters_.values())} boosters "
            f"({len(coefficients.boosters_)} targets x {len(coefficients.objectives)} objectives) on {coefficients.n_entries_} "
            f"traced terms entries in {time.perf_counter() - t0:.1f}s"
        )
    log(f"      bound margins per path: {curve_est.margins_}")

    log("[5/6] comparing with the current model on the gate rows")
    y_gate = gate_df["peak_allocated_bytes"].to_numpy(dtype="float64")
    new_gate = metrics(y_gate, *curve_est.predict_both(gate_df)) if len(gate_df) else metrics([], [], [])
    current = _load_current(registry, gate_df, log, terms)
    promote, reason = promotion_decision(new_gate, current["metrics"] if current["status"] == "loaded" else None)
    log(
        f"      new gate MAPE {new_gate['mape_pct']:.3f}% coverage {new_gate['coverage']:.3f}; current "
        f"{current['version'] or 'none'} ({current['status']}); "
        f"{'promote' if promote else 'keep current'}: {reason}"
    )
    summary.update(
        current=current["version"],
        current_status=current["status"],
        gate_mape_pct=new_gate["mape_pct"],
        gate_coverage=new_gate["coverage"],
        promote=promote,
        reason=reason,
    )

    results["data"] = {
        "input_rows": at["n_input"],
        "valid_rows": len(df),
        "rejected": len(rejected),
        "oom_dropped": at["n_oom_dropped"],
        "duplicates": at["n_duplicates"],
        "architectures": len(set(groups)),
        "sources": at["sources"],
        "data_fingerprint": fingerprint(train_df),
    }
    results["gate"] = {
        "rows": len(gate_df),
        "new": new_gate,
        "current_version": current["version"],
        "current_status": current["status"],
        "current": current["metrics"],
    }
    results["training"] = {
        "engine": a.engine,
        "rows": len(train_df),
        "seconds": round(train_s, 2),
        "params": est.get_params(),
        "conformal_log_margin": est.conformal_log_margin_,
        "calibration_coverage": est.calibration_coverage_,
    }

    if a.dry_run:
        results["promotion"] = {"dry_run": True, "would_promote": promote, "reason": reason}
        report_dir = Path(a.report_dir) if a.report_dir else Path(tempfile.mkdtemp(prefix="memfit-report-"))
        log(f"[6/6] dry run: nothing registered; writing the report to {report_dir}")
        write_report(report_dir, results, df, *oof)
        summary.update(status="dry_run", report_dir=str(report_dir))
        return EXIT_OK

    version = registry.register(
        est,
        data_fingerprint=fingerprint(train_df),
        metrics=json_safe(
            {
                s: {k: results[s][k] for k in ("metrics", "oracle", "baselines", "skipped") if k in results[s]}
                for s in SPLITS
            }
            | {"gate": new_gate}
        ),
        extra={
            "training": {
                "engine": a.engine,
                "rows": len(train_df),
                "gate_rows": len(gate_df),
                "architectures": sorted(set(group_labels(train_df))),
                "sources": at["sources"],
            },
            # the service warns when a request goes beyond what the telemetry covered
            "telemetry_range": {
                f"max_{c}": float(train_df[c].max()) for c in ("total_params", "seq_len", "micro_batch_size")
            },
            # relative bound margin per curve path (model.curve), calibrated on held-out architectures
            "bound_margins": curve_est.margins_,
        },
        coefficients=coefficients,
    )
    summary["version"] = version
    results["promotion"] = {"version": version, "promoted": promote, "reason": reason, "previous": current["version"]}
    report_dir = Path(a.report_dir) if a.report_dir else registry.root / version / "report"
    log(f"[6/6] registered {version}; writing the report to {report_dir}")
    write_report(report_dir, results, df, *oof)
    summary["report_dir"] = str(report_dir)
    if promote:
        from model.registry import IncompatibleArtifact

        try:  # promotion re-checks the written artifact: checksum, child-process parse, canary floor
            registry.promote(version)
        except IncompatibleArtifact as err:
            log(f"      refused at promotion: {err}")
            summary.update(status="not_promoted", refused=str(err))
            return EXIT_NOT_PROMOTED
        log(f"      promoted {version} (was {current['version'] or 'none'})")
        summary["status"] = "promoted"
        return EXIT_OK
    log(f"      not promoted; current stays {current['version']}")
    summary["status"] = "not_promoted"
    return EXIT_NOT_PROMOTED


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (see the module docstring)."""
    t0 = time.perf_counter()
    try:
        a = _parser().parse_args(argv)
    except SystemExit as e:  # argparse: 2 on bad arguments, 0 on --help
        return int(e.code or 0)
    log = (lambda _m: None) if a.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    if a.registry is None or (a.db is None and not a.files):  # the service's store and registry (service.settings)
        from pydantic import ValidationError

        from service.settings import Settings

        try:
            settings = Settings()
        except ValidationError as err:
            print(f"error: MEMFIT_* settings: {err.errors()[0]['loc']}: {err.errors()[0]['msg']}", file=sys.stderr)
            return EXIT_BAD_INPUT
        a.registry = a.registry or str(settings.registry_dir)
        if a.db is None and not a.files:
            a.db = settings.db_url
    summary: dict[str, Any] = {"status": None, "engine": a.engine, "dry_run": a.dry_run, "registry": a.registry}
    try:
        code = run(a, log, summary)
    except BadInput as err:
        print(f"error: {err}", file=sys.stderr)
        summary.update(status="bad_input", error=str(err))
        code = EXIT_BAD_INPUT
    except Exception as err:  # noqa: BLE001 - reported, never swallowed: exit 1 with the traceback
        traceback.print_exc()
        summary.update(status="error", error=f"{type(err).__name__}: {err}")
        code = EXIT_ERROR
    summary.update(exit_code=code, seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps(_jsonable(summary)), flush=True)
    return code


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in d.items()}


if __name__ == "__main__":
    sys.exit(main())
