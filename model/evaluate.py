"""Evaluation of the peak-memory predictor: data loading, error metrics, the k-recommendation oracle,
cross-validation by architecture and by size, and the published-tool baselines.

Every memory figure is in bytes per device (capacities are given in GiB, 2**30 bytes). Relative
errors are ``|pred - true| / true``; ``*_pct`` keys are percentages, ``coverage`` is a fraction.

Splits (:func:`cross_evaluate`):

* ``leave_architecture_out``: ``sklearn.model_selection.GroupKFold`` with 5 folds over ``model_name``;
  every row is predicted by a model that never saw its architecture.
* ``small_to_large``: train on models with ``total_params <= 13.5e9``, predict the bigger ones.

Baselines on the same held-out rows (:func:`baseline_predictions`):

* ``analytic``: our own analytic peak (:func:`model.analytic.analytic_estimate`, feature
  ``analytic_peak_bytes``) with no learned correction;
* ``deepspeed_states``: model states only (weights + gradients + optimizer states, ZeRO-sharded), what
  DeepSpeed's ``estimate_zero*_model_states_mem_needs`` reports — no activations;
* ``accelerate_weights``: ``accelerate estimate-memory``'s "Training using Adam" column — 4 x the
  weights' bytes in the training dtype (total parameters x 4 B in fp32/autocast, x 2 B in bf16),
  unaware of sharding, activations and the optimizer actually used.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from pydantic import ValidationError
from sklearn.metrics import mean_absolute_percentage_error
from sklearn.model_selection import GroupKFold

from memfit.schema import GIB, Precision, Sharding, Source, TelemetryRecord
from model.analytic import model_state_bytes
from model.job import Job, resolve

#: flat columns identifying a configuration family: everything but k (the checkpointed-layer count)
FAMILY_COLUMNS: list[str] = [
    "model_name",
    "micro_batch_size",
    "seq_len",
    "precision",
    "optimizer",
    "sharding",
    "data_parallel_size",
    "attention",
    "finetune",
    "lora_rank",
    "frozen_layers",
    "checkpoint_impl",
    "method",
    # optimizer, quantization, offload and parallel settings (absent from older rows; a family differs in any)
    "optimizer_in_backward",
    "quantization",
    "offload_optimizer",
    "offload_parameters",
    "tensor_parallel_size",
    "sequence_parallel",
    "pipeline_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
    "moe_imbalance_factor",
    "gradient_accumulation_steps",
    "pipeline_stage",
]
#: capacities (GiB) of common accelerators: V100/T4 16, A10/L4/4090 24, A100 40/80, A6000/L40S 48, H100 80,
#: H100 NVL 94/96, H200 141
CAPACITIES_GIB: tuple[float, ...] = (16, 24, 40, 48, 80, 96, 141)
SPLITS = ("leave_architecture_out", "small_to_large")
#: total_params limit of the small_to_large split's training side
SMALL_MAX_PARAMS = 13.5e9
BASELINES = ("analytic", "deepspeed_states", "accelerate_weights")
_ADAM_WEIGHT_BYTES = {
    Precision.FP32: 4,
    Precision.AMP_FP16: 4,
    Precision.AMP_BF16: 4,
    Precision.BF16: 2,
    Precision.BF16_FP32_MASTER: 2,
}


# -- data -------------------------------------------------------------------------------------------
def as_measured(record: TelemetryRecord) -> TelemetryRecord:
    """``record`` with the sharding it was measured with. The collector (``tracer/collect.py``) runs ``zero2`` as
    FSDP2 ``fully_shard(reshard_after_forward=False)``, which is ``fsdp_shard_grad_op`` now that ``zero2`` means
    DeepSpeed's stage 2 (:mod:`model.deepspeed_zero`), so a collector record labelled ``zero2`` is read as
    ``fsdp_shard_grad_op``; the stored telemetry keeps its labels (nothing is rewritten), and users' jobs keep theirs.
    """
    if record.training.sharding is Sharding.ZERO2 and record.measurement.source is Source.COLLECTOR:
        training = record.training.model_copy(update={"sharding": Sharding.FSDP_SHARD_GRAD_OP})
        return record.model_copy(update={"training": training})
    return record


def load_rows(
    db_url: str | None = None, files: Iterable[str] = (), *, use_store: bool | None = None
) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """Validated, de-duplicated, uncensored telemetry rows from a store and/or Parquet/CSV files.

    Args:
        db_url: SQLAlchemy URL of a :class:`data.store.TelemetryStore` (None: the default store).
        files: ``.parquet``/``.csv`` files written by ``TelemetryStore.export`` (same flat columns).
        use_store: read the store; default: when ``db_url`` is given or no files are.

    Every row goes through :meth:`TelemetryRecord.from_row` and :func:`as_measured`; invalid ones, ones with a non-positive
    peak (cannot be fitted in log space) and ones whose ``record_id`` was already seen with other
    content are rejected with a reason. Rows measured as out of memory (``oom``) are right-censored —
    the true peak is unknown — and are dropped and counted. Exact duplicates (same id and content;
    store first, then files in order) are counted once.

    Returns:
        ``(df, rejected)``: ``df`` has the flat :meth:`TelemetryRecord.to_row` columns, a fresh
        ``RangeIndex`` and ``df.attrs`` = ``{"n_input", "n_rejected", "n_oom_dropped",
        "n_duplicates", "sources"}``; ``rejected`` is a list of ``{"record_id", "reason", "source"}``.

    Raises:
        FileNotFoundError / ValueError: a file is missing or not ``.parquet``/``.csv``; ``db_url`` names a SQLite
            file that does not exist (reading would create an empty store there).
    """
    from data.store import TelemetryStore, read_rows, sqlite_file

    files = [str(f) for f in files]
    if use_store is None:
        use_store = db_url is not None or not files
    sources: list[tuple[str, list[dict[str, Any]]]] = []
    if use_store:
        path = sqlite_file(db_url) if db_url is not None else None
        if path is not None and not path.exists():  # reading would create an empty store there
            raise FileNotFoundError(f"no telemetry store at {path} (--db {db_url})")
        store = TelemetryStore(db_url)
        sdf = store.dataframe().drop(columns=["content_hash"], errors="ignore")
        sdf = sdf.astype(object).where(sdf.notna(), None)
        sources.append((store.url, sdf.to_dict("records")))
    for f in files:
        from pathlib import Path

        if not Path(f).is_file():
            raise FileNotFoundError(f"telemetry file not found: {f}")
        sources.append((f, read_rows(f)))

    rows: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    n_input = n_oom = n_dup = 0
    for source, raw in sources:
        for row in raw:
            n_input += 1
            rid = row.get("record_id")
            try:
                rec = as_measured(TelemetryRecord.from_row(row))
            except (ValidationError, ValueError, TypeError) as err:
                rejected.append({"record_id": rid, "reason": _reason(err), "source": source})
                continue
            h = rec.content_hash()
            if rec.record_id in seen:
                if seen[rec.record_id] == h:
                    n_dup += 1
                else:
                    rejected.append(
                        {
                            "record_id": rec.record_id,
                            "source": source,
                            "reason": "record_id already seen with different content",
                        }
                    )
                continue
            seen[rec.record_id] = h
            if rec.measurement.oom:
                n_oom += 1
                continue
            if rec.measurement.peak_allocated_bytes <= 0:
                rejected.append(
                    {"record_id": rec.record_id, "source": source, "reason": "peak_allocated_bytes must be > 0 to fit"}
                )
                continue
            rows.append(rec.to_row())
    df = pd.DataFrame(rows)
    df.attrs.update(
        {
            "n_input": n_input,
            "n_rejected": len(rejected),
            "n_oom_dropped": n_oom,
            "n_duplicates": n_dup,
            "sources": [s for s, _ in sources],
        }
    )
    return df, rejected


def _reason(err: Exception) -> str:
    if isinstance(err, ValidationError):
        return "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'record'}: {e['msg']}" for e in err.errors())
    return f"{type(err).__name__}: {err}"


def group_labels(df: pd.DataFrame) -> np.ndarray:
    """Architecture label per row for grouped splits: ``model_name``, or, when missing (user jobs),
    ``architecture:layers x hidden``."""
    fallback = df["architecture"].astype(str) + ":" + df["num_layers"].astype(str) + "x" + df["hidden_size"].astype(str)
    if "model_name" not in df.columns:
        return fallback.to_numpy(dtype=object)
    return df["model_name"].where(df["model_name"].notna(), fallback).astype(str).to_numpy(dtype=object)


def gate_mask(record_ids: Iterable[str]) -> np.ndarray:
    """Deterministic hold-out: True where ``int(sha256(record_id), 16) % 10 == 0`` (about 10 % of rows)."""
    return np.array([int(hashlib.sha256(str(r).encode()).hexdigest(), 16) % 10 == 0 for r in record_ids], dtype=bool)


# -- metrics ----------------------------------------------------------------------------------------
def metrics(y_true, y_pred, y_upper=None) -> dict[str, float]:
    """Relative-error summary of predicted peaks.

    Args:
        y_true, y_pred: measured and predicted peak bytes, shape ``(n,)``; ``y_true > 0``.
        y_upper: predicted upper bounds (bytes), optional.

    Returns:
        ``mape_pct`` (mean absolute percentage error, sklearn's), ``p95_rel_err_pct``,
        ``max_rel_err_pct``, ``coverage`` (share of rows with ``y_true <= y_upper``; NaN without
        bounds), ``mean_upper_excess_pct`` (mean of ``y_upper / y_true - 1``, the bound's slack) and
        ``n``. All NaN with ``n = 0``.
    """
    t = np.asarray(y_true, dtype="float64")
    p = np.asarray(y_pred, dtype="float64")
    if t.shape != p.shape:
        raise ValueError(f"y_true shape {t.shape} != y_pred shape {p.shape}")
    nan = float("nan")
    out = {
        "mape_pct": nan,
        "p95_rel_err_pct": nan,
        "max_rel_err_pct": nan,
        "coverage": nan,
        "mean_upper_excess_pct": nan,
        "n": int(t.size),
    }
    if t.size == 0:
        return out
    if (t <= 0).any():
        raise ValueError("y_true must be positive bytes")
    rel = np.abs(p - t) / t
    out["mape_pct"] = 100 * float(mean_absolute_percentage_error(t, p))
    out["p95_rel_err_pct"] = 100 * float(np.quantile(rel, 0.95))
    out["max_rel_err_pct"] = 100 * float(rel.max())
    if y_upper is not None:
        u = np.asarray(y_upper, dtype="float64")
        if u.shape != t.shape:
            raise ValueError(f"y_upper shape {u.shape} != y_true shape {t.shape}")
        out["coverage"] = float(np.mean(t <= u))
        out["mean_upper_excess_pct"] = 100 * float(np.mean(u / t - 1))
    return out


def oracle_eval(df: pd.DataFrame, upper_pred, capacities_gib: Sequence[float] = CAPACITIES_GIB) -> dict[str, Any]:
    """Score the k recommendation (fewest checkpointed layers that fit) against the measured oracle.

    For each configuration family (:data:`FAMILY_COLUMNS`) and device capacity ``C`` (GiB):
    oracle k = smallest measured k with ``peak_allocated_bytes <= C``; recommended k = smallest
    measured k with ``upper_pred <= C``. Only allocated tensor bytes are compared with ``C`` (no CUDA
    context or allocator slack). Cases where neither exists are counted apart (``n_both_infeasible``)
    and excluded; the rest are the ``n_cases``.

    Returns:
        ``exact_k_rate`` (rec == oracle), ``oom_rate`` (rec < oracle, or rec exists where nothing fits),
        ``over_rate`` (rec > oracle: more recomputation than needed), ``false_infeasible_rate``
        (no rec where the oracle fits), ``mean_extra_layers`` (mean rec - oracle over the over cases;
        0 when none), ``n_cases``, ``n_both_infeasible``, ``n_families``, ``capacities_gib`` and
        ``per_capacity`` (the same rates per capacity). Rates are fractions, NaN with no cases.
    """
    upper = np.asarray(upper_pred, dtype="float64")
    if upper.shape != (len(df),):
        raise ValueError(f"upper_pred must have shape ({len(df)},), got {upper.shape}")
    data = pd.DataFrame(
        {
            "k": df["num_checkpointed_layers"].to_numpy(),
            "peak": df["peak_allocated_bytes"].to_numpy(dtype="float64"),
            "upper": upper,
        }
    )
    cols = [c for c in FAMILY_COLUMNS if c in df.columns]
    data["family"] = (
        df.reset_index(drop=True).groupby(cols, dropna=False, sort=False).ngroup().to_numpy() if cols and len(df) else 0
    )
    data = data[np.isfinite(data["upper"])]
    cases: list[dict[str, Any]] = []
    for _fam, g in data.groupby("family", sort=False):
        g = g.sort_values("k")
        ks, peak, up = g["k"].to_numpy(), g["peak"].to_numpy(), g["upper"].to_numpy()
        for cap in capacities_gib:
            limit = cap * GIB
            fit_o, fit_r = ks[peak <= limit], ks[up <= limit]
            cases.append(
                {
                    "cap": cap,
                    "oracle": int(fit_o.min()) if fit_o.size else None,
                    "rec": int(fit_r.min()) if fit_r.size else None,
                }
            )
    out = _oracle_summary(cases)
    out["n_families"] = int(data["family"].nunique())
    out["capacities_gib"] = list(capacities_gib)
    out["per_capacity"] = {str(c): _oracle_summary([x for x in cases if x["cap"] == c]) for c in capacities_gib}
    return out


def _oracle_summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    both_none = sum(1 for c in cases if c["oracle"] is None and c["rec"] is None)
    live = [c for c in cases if not (c["oracle"] is None and c["rec"] is None)]
    n = len(live)
    exact = sum(1 for c in live if c["rec"] == c["oracle"])
    oom = sum(1 for c in live if c["rec"] is not None and (c["oracle"] is None or c["rec"] < c["oracle"]))
    over = [
        c["rec"] - c["oracle"]
        for c in live
        if c["rec"] is not None and c["oracle"] is not None and c["rec"] > c["oracle"]
    ]
    false_inf = sum(1 for c in live if c["rec"] is None)
    rate = (lambda x: x / n) if n else (lambda x: float("nan"))
    return {
        "exact_k_rate": rate(exact),
        "oom_rate": rate(oom),
        "over_rate": rate(len(over)),
        "false_infeasible_rate": rate(false_inf),
        "mean_extra_layers": float(np.mean(over)) if over else 0.0,
        "n_cases": n,
        "n_both_infeasible": both_none,
    }


# -- baselines --------------------------------------------------------------------------------------
def baseline_predictions(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """Peak bytes per row as each baseline (see the module docstring) would state it, shape ``(n,)``."""
    from model.features import build_features, row_specs

    feats = build_features(df)
    states, accel = [], []
    for row in df.to_dict("records"):
        spec, training = row_specs({k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))})
        states.append(model_state_bytes(spec, training).total_bytes)
        accel.append(4 * spec.total_params * _ADAM_WEIGHT_BYTES[Precision(training.precision)])
    return {
        "analytic": feats["analytic_peak_bytes"].to_numpy(dtype="float64"),
        "deepspeed_states": np.asarray(states, dtype="float64"),
        "accelerate_weights": np.asarray(accel, dtype="float64"),
    }


def compare_baselines(df: pd.DataFrame, memfit_mape_pct: float) -> dict[str, dict[str, float]]:
    """MAPE (%) of each baseline on ``df`` and its ratio to memfit's MAPE (how many times worse)."""
    y = df["peak_allocated_bytes"].to_numpy(dtype="float64")
    out = {}
    for name, pred in baseline_predictions(df).items() if len(df) else ():
        m = metrics(y, pred)
        out[name] = {
            "mape_pct": m["mape_pct"],
            "p95_rel_err_pct": m["p95_rel_err_pct"],
            "ratio_to_memfit": m["mape_pct"] / memfit_mape_pct if memfit_mape_pct > 0 else float("nan"),
        }
    return out


# -- cross-validation -------------------------------------------------------------------------------
def split_indices(df: pd.DataFrame, split: str, n_folds: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) positional index pairs of a split (see the module docstring).

    Raises:
        ValueError: unknown split, fewer than 2 architectures, or an empty side.
    """
    if split == "leave_architecture_out":
        groups = group_labels(df)
        n_arch = len(set(groups))
        if n_arch < 3:  # each fold trains on >= 2, so the estimator can hold one out for calibration
            raise ValueError(f"leave_architecture_out needs rows of at least 3 architectures, have {n_arch}")
        k = min(n_folds, n_arch)
        return [(tr, te) for tr, te in GroupKFold(n_splits=k).split(df, groups=groups)]
    if split == "small_to_large":
        small = df["total_params"].to_numpy(dtype="float64") <= SMALL_MAX_PARAMS
        tr, te = np.flatnonzero(small), np.flatnonzero(~small)
        if not tr.size or not te.size:
            raise ValueError(
                f"small_to_large needs models on both sides of {SMALL_MAX_PARAMS:.3g} parameters "
                f"(have {tr.size} small rows, {te.size} large)"
            )
        if len(set(group_labels(df.iloc[tr]))) < 2:
            raise ValueError("small_to_large needs at least 2 small architectures to train and calibrate on")
        return [(tr, te)]
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _fit_predict_fold(
    make_estimator: Callable[[], Any],
    X_train: pd.DataFrame,
    y_train: np.ndarray,
    groups_train: np.ndarray,
    X_test: pd.DataFrame,
) -> tuple[np.ndarray, np.ndarray]:
    """One fold of :func:`cross_evaluate`: (point, upper bound) in bytes for ``X_test``, shape (len(X_test),) each."""
    est = make_estimator()
    est.fit(X_train, y_train, groups=groups_train)
    if hasattr(est, "predict_both"):  # one pass over the curves instead of two
        return est.predict_both(X_test)
    return est.predict(X_test), est.predict_upper(X_test)


def cross_evaluate(
    df: pd.DataFrame,
    make_estimator: Callable[[], Any],
    split: str,
    capacities_gib: Sequence[float] = CAPACITIES_GIB,
    progress: Callable[[str], None] | None = None,
    n_jobs: int = 1,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Out-of-sample predictions of a split and their scores.

    Args:
        df: validated rows (:func:`load_rows`), fresh index.
        make_estimator: returns an unfitted estimator with ``fit(X, y, groups=)``, ``predict`` and
            ``predict_upper`` in bytes (e.g. ``lambda: PeakMemoryRegressor(n_estimators=300)``), or
            ``predict_both`` returning both.
        split: ``leave_architecture_out`` or ``small_to_large``.
        progress: called with a line per fold, in fold order.
        n_jobs: folds fitted and predicted at once, each in a worker process (``joblib.Parallel`` with its loky
            backend, which sends ``make_estimator`` with cloudpickle); 1 runs them here. The predictions do not
            depend on it (every estimator here is seeded and single-threaded).

    Raises:
        ValueError: ``split`` is not one of :data:`SPLITS`, or ``n_jobs`` < 1.

    Returns:
        ``(pred, upper, summary)``: bytes aligned to ``df`` (NaN on rows never tested — the small
        side of ``small_to_large``) and ``{"split", "n_folds", "n_test", "test_architectures",
        "metrics": metrics(), "oracle": oracle_eval(), "baselines": compare_baselines(),
        "per_architecture": {name: metrics()}}``. A split that cannot be formed returns NaN arrays and
        ``summary["skipped"]`` with the reason.
    """
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")
    pred = np.full(len(df), np.nan)
    upper = np.full(len(df), np.nan)
    try:
        folds = split_indices(df, split)
    except ValueError as err:
        if split not in SPLITS:
            raise
        return pred, upper, {"split": split, "skipped": str(err), "metrics": metrics([], []), "n_test": 0}
    y = df["peak_allocated_bytes"].to_numpy(dtype="float64")
    groups = group_labels(df)
    tasks = [(make_estimator, df.iloc[tr], y[tr], groups[tr], df.iloc[te]) for tr, te in folds]
    if n_jobs == 1 or len(folds) == 1:
        answers = (_fit_predict_fold(*t) for t in tasks)
    else:
        from joblib import Parallel, delayed

        answers = Parallel(n_jobs=min(n_jobs, len(folds)), return_as="generator")(
            delayed(_fit_predict_fold)(*t) for t in tasks
        )
    for i, ((_tr, te), (p, u)) in enumerate(zip(folds, answers)):
        pred[te], upper[te] = p, u
        if progress:
            m = metrics(y[te], pred[te], upper[te])
            progress(
                f"{split} fold {i + 1}/{len(folds)}: test {sorted(set(groups[te]))} "
                f"MAPE {m['mape_pct']:.2f}% coverage {m['coverage']:.3f}"
            )
    tested = np.isfinite(pred)
    sub = df[tested]
    m = metrics(y[tested], pred[tested], upper[tested])
    per_arch = {}
    for name in sorted(set(groups[tested])):
        sel = tested & (groups == name)
        per_arch[name] = metrics(y[sel], pred[sel], upper[sel])
    summary = {
        "split": split,
        "n_folds": len(folds),
        "n_test": int(tested.sum()),
        "test_architectures": sorted(set(groups[tested])),
        "metrics": m,
        "oracle": oracle_eval(sub, upper[tested], capacities_gib),
        "baselines": compare_baselines(sub, m["mape_pct"]),
        "per_architecture": per_arch,
    }
    return pred, upper, summary


# -- the one curve as an estimator --------------------------------------------------------------------
def row_configuration(row: dict[str, Any]) -> Job:
    """The :class:`model.job.Job` of one flat telemetry row (:func:`model.features.row_specs`): the row's spec as
    measured, its training with k = 0, and the HF config of its ``model_name`` (:func:`model.job.resolve_architecture`
    of a :class:`ModelSpec`; None for a model neither the catalog nor the reduced MoE models hold)."""
    from memfit.schema import ModelSpec, TrainingConfig
    from model.features import row_specs

    spec, training = row_specs({k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))})
    # validated copies: Parquet hands integer columns with gaps back as floats (lora_rank 16.0), and the
    # traced-terms key must see the same values a request gives
    return resolve(
        ModelSpec.model_validate(dict(spec)), TrainingConfig.model_validate({**dict(training), "checkpoint_layers": []})
    )


#: architecture folds of the learned-coefficient path's cross-conformal margin (:meth:`CurveEstimator.fit`)
CROSS_CONFORMAL_FOLDS = 3


class CurveEstimator:
    """:meth:`model.curve.MemoryPredictor.curve` wrapped for :func:`cross_evaluate` (fit / predict / predict_upper).

    ``fit`` trains the provisional path's :class:`model.estimator.PeakMemoryRegressor` (unless
    ``force_path == "traced"``) and calibrates each path's relative bound margin by split-conformal
    on held-out architectures of the training rows (``alpha`` miscoverage). ``predict`` composes one
    curve per configuration family and reads each row's k off it, so every row is answered by the
    same function the service answers with.

    Args:
        terms: :class:`model.terms.TermsCache` of traced terms.
        make_provisional: returns an unfitted provisional estimator.
        force_path: None (traced when terms exist), ``"provisional"`` (never traced) or ``"traced"``.
        alpha: bound miscoverage (0.05: 95 % coverage).

    Attributes (after fit): ``margins_`` (margin group -> relative margin), ``coefficients_`` (the fitted
    coefficient model or None), ``path_`` (per row of the last ``predict``: its margin group, ``traced``,
    ``traced_sharded``, ``provisional`` or ``provisional_coefficients``).
    """

    def __init__(
        self,
        terms,
        make_provisional: Callable[[], Any] | None = None,
        force_path: str | None = None,
        alpha: float = 0.05,
        random_state: int = 0,
        make_coefficients: Callable[[], Any] | None = None,
        coefficient_entries: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self.terms, self.make_provisional, self.force_path = terms, make_provisional, force_path
        self.alpha, self.random_state = alpha, random_state
        self.make_coefficients, self.coefficient_entries = make_coefficients, coefficient_entries

    def _predictor(self, estimator, margins, coefficients=None, force_path=None):
        from model.curve import MemoryPredictor
        from model.terms import TermsCache

        force_path = force_path or self.force_path
        terms = TermsCache(shipped_dir=None) if force_path == "provisional" else self.terms
        return MemoryPredictor(estimator, terms, margins, coefficients=coefficients)

    def _curves(self, predictor, X: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """(point, bound, margin group) per row of ``X``: one curve per configuration family.

        A row of one pipeline stage (``pipeline_stage`` given, ``pipeline_parallel_size`` > 1) is that stage's
        peak, so it is answered by the stage's composed peak at k (:attr:`model.parallel.ParallelCurve.
        stage_peak_bytes`) with the curve's relative margin, not by the bottleneck stage's the answer gives.
        """
        from model.curve import margin_group, upper_bytes

        cols = [c for c in FAMILY_COLUMNS if c in X.columns]
        X = X.reset_index(drop=True)
        pred = np.full(len(X), np.nan)
        upper = np.full(len(X), np.nan)
        group = [""] * len(X)
        for _key, g in X.groupby(cols, dropna=False, sort=False):
            job = row_configuration(g.iloc[0].to_dict())
            c = predictor.curve(job.spec, job.training, job.hf_config)
            mg = c.margin_group or margin_group(c.path, job.training.sharding, c.learned_coefficients)
            stage = g.iloc[0].get("pipeline_stage")
            per_stage = c.pipeline is not None and len(c.pipeline.stages) > 1 and not pd.isna(stage)
            for i, k in zip(g.index, g["num_checkpointed_layers"].astype(int)):
                if per_stage:
                    p = int(c.pipeline.stage_peak_bytes[k, int(stage)])
                    pred[i], upper[i], group[i] = p, upper_bytes(p, predictor.margins[mg]), mg
                else:
                    pred[i], upper[i], group[i] = c.points[k].predicted_bytes, c.points[k].upper_bytes, mg
        return pred, upper, group

    def fit(self, X: pd.DataFrame, y, groups=None, provisional=None) -> CurveEstimator:
        """Fit the provisional estimators (or take ``provisional``, already fitted) and calibrate the margins.

        With ``make_coefficients``, a :class:`model.coefficients.CoefficientModel` is fitted on the
        ``coefficient_entries`` of the training architectures (``groups``); its margin groups are calibrated
        cross-conformally: every training row answered as if untraced, by a coefficient model fitted without its
        architecture (:data:`CROSS_CONFORMAL_FOLDS` folds).
        """
        from sklearn.model_selection import GroupShuffleSplit

        from model.curve import (
            DEFAULT_MARGINS,
            MARGIN_FLOORS,
            PROVISIONAL,
        )

        y = np.asarray(y, dtype="float64")
        groups = np.asarray(groups) if groups is not None else group_labels(X)
        self.provisional_ = provisional
        self.coefficients_ = None
        margins = dict(DEFAULT_MARGINS)
        if provisional is None and self.force_path != "traced" and self.make_provisional is not None:
            self.provisional_ = self.make_provisional().fit(X, y, groups=groups)
        if self.provisional_ is not None:
            margins[PROVISIONAL] = float(np.expm1(self.provisional_.conformal_log_margin_))
        # traced margin: conformal quantile of relative residuals on held-out architectures
        split = GroupShuffleSplit(n_splits=1, test_size=0.3, random_state=self.random_state)
        _tr, cal = next(split.split(X, y, groups))
        Xc = X.iloc[cal]
        coef_cal = None
        if self.make_coefficients is not None and self.force_path != "traced":
            train_names = set(groups.tolist())
            entries = [e for e in self._entries() if e["model_name"] in train_names]
            cal_names = set(groups[cal].tolist())
            kept = [e for e in entries if e["model_name"] not in cal_names]
            coef_cal = self.make_coefficients().fit(kept) if kept else None
            self.coefficients_ = self.make_coefficients().fit(entries) if entries else None
        pred, _u, group = self._curves(self._predictor(self.provisional_, margins, coef_cal), Xc)
        groups_cal = np.asarray(group)
        for g, floor in MARGIN_FLOORS.items():  # traced groups: conformal quantile, never below the floor
            mask = groups_cal == g
            if mask.any():
                margins[g] = max(floor, self._quantile(y[cal][mask] / pred[mask] - 1))
        if coef_cal is not None:  # learned coefficients: held-out architectures answered untraced
            resid = self._coefficient_residuals(X, y, groups, entries, margins)
            for g, r in resid.items():
                if r.size:
                    margins[g] = max(0.0, self._quantile(r))
        self.margins_ = margins
        return self

    def _coefficient_residuals(
        self,
        X: pd.DataFrame,
        y: np.ndarray,
        groups: np.ndarray,
        entries: Sequence[dict[str, Any]],
        margins: dict[str, float],
    ) -> dict[str, np.ndarray]:
        """Relative residuals ``y / pred − 1`` of the learned-coefficient path per margin group, every training row
        answered by a coefficient model fitted without its architecture (cross-conformal over
        :data:`CROSS_CONFORMAL_FOLDS` architecture folds; Vovk 2015, "Cross-conformal predictors", Ann. Math.
        Artif. Intell. 74): every architecture calibrates the margin, where one split of ~40 would leave it to a
        handful. One margin per group: 95.4 % coverage, 8.6 % mean excess on the benchmark's held-out rows; the
        split and the refinements measured and left out are in ``benchmarks/results/design_choices.md``."""
        from sklearn.model_selection import GroupKFold

        from model.curve import PROVISIONAL_COEFFICIENTS, PROVISIONAL_COEFFICIENTS_SHARDED

        out: dict[str, list[np.ndarray]] = {PROVISIONAL_COEFFICIENTS: [], PROVISIONAL_COEFFICIENTS_SHARDED: []}
        n_splits = min(CROSS_CONFORMAL_FOLDS, len(set(groups.tolist())))
        if n_splits < 2:
            return {g: np.empty(0) for g in out}
        folds = GroupKFold(n_splits=n_splits, shuffle=True, random_state=self.random_state)
        for _tr, cal in folds.split(X, y, groups):
            names = set(groups[cal].tolist())
            kept = [e for e in entries if e["model_name"] not in names]
            if not kept:
                continue
            coef = self.make_coefficients().fit(kept)
            pred, _u, group = self._curves(
                self._predictor(self.provisional_, margins, coef, "provisional"), X.iloc[cal]
            )
            group = np.asarray(group)
            for g, r in out.items():
                mask = (group == g) & np.isfinite(pred)
                r.append(y[cal][mask] / pred[mask] - 1)
        return {g: np.concatenate(r) if r else np.empty(0) for g, r in out.items()}

    def _entries(self) -> Sequence[dict[str, Any]]:
        if self.coefficient_entries is None:
            from model.terms import shipped_entries

            self.coefficient_entries = shipped_entries()
        return self.coefficient_entries

    def _quantile(self, resid: np.ndarray) -> float:
        """Split-conformal ``ceil((n+1)(1-alpha))/n`` quantile of relative residuals."""
        n = resid.size
        level = min(1.0, np.ceil((n + 1) * (1 - self.alpha)) / n)
        return float(np.quantile(resid, level, method="higher"))

    def predict_both(self, X: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        # coefficients_ is absent when a caller sets provisional_ and margins_ itself (training.retrain)
        coefficients = getattr(self, "coefficients_", None)
        pred, upper, self.path_ = self._curves(self._predictor(self.provisional_, self.margins_, coefficients), X)
        return pred, upper

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        return self.predict_both(X)[0]

    def predict_upper(self, X: pd.DataFrame) -> np.ndarray:
        return self.predict_both(X)[1]


def saving_errors(df: pd.DataFrame, pred) -> np.ndarray:
    """Relative error of the predicted checkpointing saving, peak(k=0) − peak(k=L), per family that has
    both ends measured and a measured saving of at least 1 MiB (shape (n_families,))."""
    d = df.assign(_pred=np.asarray(pred, dtype="float64")).reset_index(drop=True)
    cols = [c for c in FAMILY_COLUMNS if c in d.columns]
    out = []
    for _key, g in d.groupby(cols, dropna=False, sort=False):
        L = int(g["num_layers"].iloc[0])
        lo, hi = g[g["num_checkpointed_layers"] == 0], g[g["num_checkpointed_layers"] == L]
        if lo.empty or hi.empty or not np.isfinite(lo["_pred"].iloc[0]) or not np.isfinite(hi["_pred"].iloc[0]):
            continue
        true = float(lo["peak_allocated_bytes"].iloc[0] - hi["peak_allocated_bytes"].iloc[0])
        if true < (1 << 20):
            continue
        out.append(abs(float(lo["_pred"].iloc[0] - hi["_pred"].iloc[0]) - true) / true)
    return np.asarray(out)


def row_paths(df: pd.DataFrame, terms) -> np.ndarray:
    """``traced`` where the row's configuration has traced terms in ``terms``, else ``provisional``. A ZeRO-1
    row is ``traced`` where its unsharded base is (:mod:`model.zero1` composes its curve from the base's terms), a
    frozen fine-tune composed from its full fine-tune base (:mod:`model.frozen`) where that base is."""
    from memfit.schema import Sharding
    from model.terms import base_terms_key, not_traceable_reason, terms_key
    from model.zero1 import base_training, not_composable_reason

    cols = [c for c in FAMILY_COLUMNS if c in df.columns]
    d = df.reset_index(drop=True)
    out = np.full(len(d), "provisional", dtype=object)
    for _key, g in d.groupby(cols, dropna=False, sort=False):
        job = row_configuration(g.iloc[0].to_dict())
        spec, training, hf = job.spec, job.training, job.hf_config
        if (
            training.sharding is Sharding.ZERO1
            and not_composable_reason(training) is None
            and not_traceable_reason(spec, base_training(training)) is None
        ):  # as model.zero1.Zero1Derivation
            training = base_training(training)
        traced = hf is not None and not_traceable_reason(spec, training) is None and terms.get(terms_key(hf, training))
        if traced or ((key := base_terms_key(spec, training, hf)) is not None and terms.get(key)):
            out[g.index] = "traced"
    return out
