"""Model registry: numbered versions on disk and a ``current`` alias. No pickle anywhere.

Layout::

    <root>/0001/model.txt    LightGBM native text model (Booster.save_model)
    <root>/0001/meta.json    estimator params, feature names and order, conformal margin, metrics,
                             training-data fingerprint, library versions, created_at
    <root>/CURRENT           the current version's name (replaced atomically); rollback = point it back

Loading checks the artifact before it is served: feature names and order must equal this code's
:data:`model.features.FEATURE_NAMES` and the model file must parse; otherwise
:class:`IncompatibleArtifact` is raised and the caller keeps its last good model.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lightgbm as lgb

from model.estimator import PeakMemoryRegressor
from model.features import FEATURE_NAMES

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "data" / "models"
FORMAT_VERSION = 1


class IncompatibleArtifact(ValueError):
    """A registered model cannot be served by this code (corrupt, or other features/format)."""


@dataclass
class LoadedModel:
    version: str
    estimator: PeakMemoryRegressor
    meta: dict[str, Any]


def fingerprint(df) -> str:
    """SHA-256 over the sorted record ids and peaks: identifies the training data."""
    h = hashlib.sha256()
    for rid, peak in sorted(zip(df["record_id"], df["peak_allocated_bytes"])):
        h.update(f"{rid}:{int(peak)}\n".encode())
    return h.hexdigest()


def _finite(obj: Any) -> Any:
    """NaN/inf -> None, recursively (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class Registry:
    """Versioned model store under ``root`` (default ``data/models``)."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root else DEFAULT_ROOT

    def versions(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and p.name.isdigit())

    def current(self) -> str | None:
        f = self.root / "CURRENT"
        return f.read_text().strip() if f.exists() else None

    def register(self, est: PeakMemoryRegressor, *, metrics: dict[str, Any], data_fingerprint: str,
                 extra: dict[str, Any] | None = None) -> str:
        """Write a new numbered version (not yet current); returns its name."""
        self.root.mkdir(parents=True, exist_ok=True)
        while True:  # reserve the next number atomically: concurrent retrains get distinct versions
            name = f"{int(self.versions()[-1]) + 1 if self.versions() else 1:04d}"
            try:
                (self.root / name).mkdir()
                break
            except FileExistsError:
                continue
        tmp = self.root / name
        est.booster_.save_model(str(tmp / "model.txt"))
        import sklearn
        import torch

        meta = {
            "format_version": FORMAT_VERSION,
            "version": name,
            "created_at": datetime.now(UTC).isoformat(),
            "params": est.get_params(),
            "feature_names": list(est.feature_names_in_),
            "conformal_log_margin": est.conformal_log_margin_,
            "calibration_coverage": est.calibration_coverage_,
            "n_calibration": est.n_calibration_,
            "metrics": metrics,
            "data_fingerprint": data_fingerprint,
            "versions": {"lightgbm": lgb.__version__, "sklearn": sklearn.__version__, "torch": torch.__version__,
                         "python": platform.python_version()},
            **(extra or {}),
        }
        (tmp / "meta.json").write_text(json.dumps(_finite(meta), indent=1, default=str, allow_nan=False))
        return name

    def promote(self, version: str) -> None:
        """Point ``CURRENT`` at ``version`` atomically (also how rollback is done)."""
        if version not in self.versions():
            raise ValueError(f"unknown model version {version!r}; registered: {self.versions()}")
        tmp = self.root / ".CURRENT.tmp"
        tmp.write_text(version + "\n")
        os.replace(tmp, self.root / "CURRENT")

    def meta(self, version: str) -> dict[str, Any]:
        return json.loads((self.root / version / "meta.json").read_text())

    def load(self, version: str | None = None) -> LoadedModel:
        """Load a version (default: current) and check it can be served.

        Raises:
            FileNotFoundError: no such version / no current model.
            IncompatibleArtifact: unreadable, wrong format or different feature list.
        """
        version = version or self.current()
        if version is None:
            raise FileNotFoundError(f"no current model in {self.root}")
        d = self.root / version
        try:
            meta = json.loads((d / "meta.json").read_text())
            booster = lgb.Booster(model_file=str(d / "model.txt"))
        except FileNotFoundError:
            raise
        except Exception as err:  # lightgbm raises LightGBMError, json ValueError
            raise IncompatibleArtifact(f"model {version}: unreadable ({type(err).__name__}: {err})") from err
        if meta.get("format_version") != FORMAT_VERSION:
            raise IncompatibleArtifact(f"model {version}: format {meta.get('format_version')} != {FORMAT_VERSION}")
        if meta.get("feature_names") != FEATURE_NAMES or booster.feature_name() != FEATURE_NAMES:
            raise IncompatibleArtifact(f"model {version}: feature list differs from this code's")
        est = PeakMemoryRegressor(**meta["params"])
        est.booster_ = booster
        est.conformal_log_margin_ = float(meta["conformal_log_margin"])
        est.calibration_coverage_ = float(meta["calibration_coverage"])
        est.n_calibration_ = int(meta["n_calibration"])
        est.feature_names_in_ = list(FEATURE_NAMES)
        est.n_features_in_ = len(FEATURE_NAMES)
        return LoadedModel(version, est, meta)
