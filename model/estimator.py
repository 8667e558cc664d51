"""The peak-memory predictor: LightGBM on the log-ratio of measured peak to the analytic estimate.

``PeakMemoryRegressor`` follows scikit-learn's estimator contract (constructor stores parameters
only; ``fit`` learns attributes ending in ``_``; ``get_params``/``set_params`` from ``BaseEstimator``),
so ``GroupKFold``, ``cross_validate`` and ``permutation_importance`` work on it.

Target: ``log(peak / analytic_peak)``. The analytic term (``model.analytic``) carries the physics
and scales to sizes the data never saw; the trees learn the residual, which is bounded, so
extrapolation degrades gracefully instead of saturating at the largest peak seen.

Upper bound: split-conformal calibration (Vovk et al. 2005; Lei et al. 2018, "Distribution-Free
Predictive Inference for Regression", JASA, Sec. 2.2) on the residuals of held-out *groups*
(architectures), so the bound's coverage holds for unseen architectures: the
``ceil((n+1)(1-alpha))/n`` empirical quantile of the calibration residuals is added in log space.
The calibrating groups are one draw of ``random_state``; with a few dozen architectures the bound's held-out
coverage moves with that draw (``python -m benchmarks.ratio_seeds`` prints it per seed).
"""

from __future__ import annotations

import math

import lightgbm as lgb
import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.model_selection import GroupShuffleSplit
from sklearn.utils.validation import check_is_fitted

from model.features import FEATURE_NAMES, MONOTONE, accumulation_mask, build_features

_LOG_ANALYTIC = FEATURE_NAMES.index("log_analytic_peak")


class PeakMemoryRegressor(RegressorMixin, BaseEstimator):
    """Predict a training step's peak allocated bytes per device from configuration alone.

    Args:
        n_estimators, learning_rate, num_leaves, min_child_samples, reg_lambda: LightGBM parameters.
        monotone: apply :data:`model.features.MONOTONE` constraints.
        alpha: miscoverage of the upper bound (0.05 -> 95 % bound).
        calibration_fraction: share of groups held out for conformal calibration.
        random_state: seed for the calibration split and LightGBM.
        n_jobs: LightGBM threads (1 by default: on small data more threads mostly wait on each other).

    ``X`` is a DataFrame of flat telemetry rows (``TelemetryRecord.to_row`` columns); ``y`` is the
    measured peak in bytes (shape ``(n,)``). ``fit(X, y, groups=...)`` takes group labels (e.g.
    ``model_name``) for the calibration split; without them rows are split at random.

    Attributes (after fit): ``booster_`` (``lightgbm.Booster``), ``feature_names_in_``,
    ``n_features_in_``, ``conformal_log_margin_``, ``calibration_coverage_``, ``n_calibration_``.
    """

    def __init__(
        self,
        n_estimators: int = 600,
        learning_rate: float = 0.05,
        num_leaves: int = 63,
        min_child_samples: int = 10,
        reg_lambda: float = 1.0,
        monotone: bool = True,
        alpha: float = 0.05,
        calibration_fraction: float = 0.2,
        random_state: int = 0,
        n_jobs: int = 1,
    ):
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.num_leaves = num_leaves
        self.min_child_samples = min_child_samples
        self.reg_lambda = reg_lambda
        self.monotone = monotone
        self.alpha = alpha
        self.calibration_fraction = calibration_fraction
        self.random_state = random_state
        self.n_jobs = n_jobs

    # -- helpers --------------------------------------------------------------------------------
    def lgb_params(self) -> dict:
        """LightGBM parameters (also used by the Dask engine, so both train the same model)."""
        params = {
            "objective": "regression",
            "learning_rate": self.learning_rate,
            "num_leaves": self.num_leaves,
            "min_child_samples": self.min_child_samples,
            "lambda_l2": self.reg_lambda,
            "verbose": -1,
            "seed": self.random_state,
            "num_threads": self.n_jobs,
            "deterministic": True,
            "force_row_wise": True,
        }
        if self.monotone:
            params["monotone_constraints"] = [MONOTONE.get(c, 0) for c in FEATURE_NAMES]
            params["monotone_constraints_method"] = "advanced"
        return params

    @staticmethod
    def _xy(X: pd.DataFrame, y=None):
        feats = build_features(X)
        if y is None:
            return feats, None
        y = np.asarray(y, dtype="float64")
        if y.shape != (len(feats),) or (y <= 0).any():
            raise ValueError(f"y must be positive peak bytes of shape ({len(feats)},); got shape {y.shape}")
        # the learned ratio is that of a step of one micro-batch: under gradient accumulation the curve adds
        # the whole gradient buffer to it (model.curve), so a measured accumulating row teaches y - gradients
        y = y - accumulation_mask(X) * feats["gradients_bytes"].to_numpy()
        return feats, np.log(np.maximum(y, 1.0)) - feats["log_analytic_peak"].to_numpy()

    # -- estimator API --------------------------------------------------------------------------
    def fit(self, X: pd.DataFrame, y, groups=None, booster: lgb.Booster | None = None):
        """Fit trees on a training share and calibrate the bound on held-out groups, then refit on all.

        ``booster``: a booster trained elsewhere on the same features/target (the Dask engine);
        when given, only the calibration runs.
        """
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if not 0 < self.calibration_fraction < 1:
            raise ValueError(f"calibration_fraction must be in (0, 1), got {self.calibration_fraction}")
        feats, target = self._xy(X, y)
        groups = np.asarray(groups) if groups is not None else np.arange(len(feats))
        split = GroupShuffleSplit(n_splits=1, test_size=self.calibration_fraction, random_state=self.random_state)
        tr, cal = next(split.split(feats, target, groups))
        calib = self._train(feats.iloc[tr], target[tr])
        resid = target[cal] - calib.predict(feats.iloc[cal])
        n = len(resid)
        level = min(1.0, math.ceil((n + 1) * (1 - self.alpha)) / n)
        self.conformal_log_margin_ = float(np.quantile(resid, level, method="higher"))
        self.calibration_coverage_ = float(np.mean(resid <= self.conformal_log_margin_))
        self.n_calibration_ = int(n)
        self.booster_ = booster if booster is not None else self._train(feats, target)
        self.feature_names_in_ = np.asarray(FEATURE_NAMES, dtype=object)
        self.n_features_in_ = len(FEATURE_NAMES)
        return self

    def _train(self, feats: pd.DataFrame, target: np.ndarray) -> lgb.Booster:
        ds = lgb.Dataset(
            feats,
            label=target,
            categorical_feature=[c for c in feats if str(feats[c].dtype) == "category"],
            free_raw_data=True,
        )
        return lgb.train(self.lgb_params(), ds, num_boost_round=self.n_estimators)

    def predict_log_ratio(self, X: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        """(log analytic peak, predicted log-ratio) per row; one booster call for all rows."""
        check_is_fitted(self, "booster_")
        feats = build_features(X)
        return feats["log_analytic_peak"].to_numpy(), self.booster_.predict(feats)

    def predict_matrix(self, M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fast path: (log analytic peak, predicted log-ratio) for a ready feature matrix in
        :data:`FEATURE_NAMES` order (e.g. :func:`model.features.curve_matrix`), one booster call."""
        check_is_fitted(self, "booster_")
        return M[:, _LOG_ANALYTIC], self.booster_.predict(M, num_threads=1)

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        """Predicted peak allocated bytes per device, shape ``(n,)``."""
        base, ratio = self.predict_log_ratio(X)
        return np.exp(base + ratio)

    def predict_upper(self, X: pd.DataFrame) -> np.ndarray:
        """Calibrated upper bound (1 - alpha coverage on unseen groups), bytes, shape ``(n,)``."""
        base, ratio = self.predict_log_ratio(X)
        return np.exp(base + ratio + self.conformal_log_margin_)
