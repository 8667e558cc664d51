"""Model registry: numbered versions on disk and a ``current`` alias. No pickle anywhere.

Layout::

    <root>/0001/model.txt    LightGBM native text model (Booster.save_model)
    <root>/0001/meta.json    estimator params, feature names and order, conformal margin, metrics,
                             training-data fingerprint, library versions, created_at
    <root>/0001/coefficients/  optional: the learned phase coefficients of the provisional path
                             (:class:`model.coefficients.CoefficientModel`: LightGBM text boosters + JSON)
    <root>/CURRENT           the current version's name (replaced atomically); rollback = point it back

Loading checks the artifact before it is served, so a damaged file can never take the process down:

1. the SHA-256 of ``model.txt`` (``meta["artifact_sha256"]``, written at registration) must match the
   bytes read, before LightGBM parses one of them;
2. those bytes are parsed, and the canary configurations (:data:`CANARY`) predicted, in a child
   process first: a parser crash (LightGBM segfaults on some truncated files) kills the child only;
3. the canary predictions must reproduce the ones stored at registration (relative tolerance
   :data:`CANARY_RTOL`) and never fall below the model-state floor (weights + gradients + optimizer
   states, :func:`model.analytic.model_state_bytes`), which no real training step goes under;
4. feature names and order must equal this code's :data:`model.features.FEATURE_NAMES`.

A version with learned coefficients has every file of ``coefficients/`` checksummed in
``meta["artifact_sha256"]`` too; they must match before LightGBM parses them, and the composed curve of each
canary configuration must reproduce the one stored at registration (``meta["coefficient_canary"]``).

Any failure raises :class:`IncompatibleArtifact`; the caller keeps serving its last good model.
Versions registered before checksums existed (no ``artifact_sha256``) still go through steps 2-4.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightgbm as lgb

    from model.estimator import PeakMemoryRegressor

# lightgbm (with scikit-learn and SciPy, ~2.5 s) and the feature code are imported where they are used: the command
# line starts the canary child (Registry.start_check) before it imports them, so the two imports overlap

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = REPO_ROOT / "data" / "models"
FORMAT_VERSION = 1
MODEL_FILE = "model.txt"
#: Fixed canary configurations: (catalog model, micro_batch_size, seq_len, sharding, data_parallel_size).
CANARY: tuple[tuple[str, int, int, str, int], ...] = (
    ("llama-3-8b", 1, 2048, "none", 1),
    ("gpt2", 4, 1024, "none", 1),
    ("qwen2.5-0.5b", 2, 4096, "zero3", 8),
)
CANARY_RTOL = 1e-3
#: seconds the child process may take to parse and run the canary
CHILD_TIMEOUT_S = 120


class IncompatibleArtifact(ValueError):
    """A registered model cannot be served by this code (corrupt, or other features/format)."""


COEFFICIENTS_DIR = "coefficients"


@dataclass
class LoadedModel:
    version: str
    estimator: PeakMemoryRegressor
    meta: dict[str, Any]
    warnings: list[str]
    #: the version's :class:`model.coefficients.CoefficientModel`, None when it has none
    coefficients: Any = None


def coefficient_canary(coefficients: Any) -> dict[str, dict[str, int]]:
    """The learned-coefficients curve's raw composed peak bytes at k = 0 and k = L of each :data:`CANARY`
    configuration it covers (``{"<model>/mb<m>/s<seq>/<sharding>/dp<n>": {"k0_bytes", "kall_bytes"}}``)."""
    from memfit.schema import TrainingConfig
    from model.compose import compose
    from model.job import resolve

    out = {}
    for name, mb, seq, sharding, dp in CANARY:
        job = resolve(name, TrainingConfig(micro_batch_size=mb, seq_len=seq, sharding=sharding, data_parallel_size=dp))
        spec, training, hf = job.spec, job.training, job.hf_config
        if not coefficients.covers(spec, training, hf):
            continue
        raw = compose(coefficients.predict_coef(spec, training, hf), spec.num_layers, mb, seq).peak_bytes
        out[f"{name}/mb{mb}/s{seq}/{sharding}/dp{dp}"] = {"k0_bytes": int(raw[0]), "kall_bytes": int(raw[-1])}
    return out


def _load_coefficients(d: Path, meta: dict[str, Any]) -> Any:
    """The version's coefficient model after its files' checksums and canary are checked (None without one).

    Raises:
        IncompatibleArtifact: a file is missing or changed, or the canary is not reproduced.
    """
    import lightgbm as lgb

    from model.coefficients import CoefficientModel

    if not meta.get("coefficients"):
        return None
    sums = meta.get("artifact_sha256") or {}
    files = {k: v for k, v in sums.items() if k.startswith(COEFFICIENTS_DIR + "/")}
    if not files:
        raise IncompatibleArtifact("coefficients: no checksums registered")
    for rel, want in files.items():
        try:
            got = sha256_hex((d / rel).read_bytes())
        except OSError as err:
            raise IncompatibleArtifact(f"{rel}: unreadable ({type(err).__name__})") from err
        if got != want:
            raise IncompatibleArtifact(f"{rel} sha256 {got[:12]}... does not match the registered {want[:12]}...")
    try:
        coefficients = CoefficientModel.load(d / COEFFICIENTS_DIR)
    except (OSError, ValueError, lgb.basic.LightGBMError) as err:
        raise IncompatibleArtifact(f"coefficients: {err}") from err
    stored = meta.get("coefficient_canary") or {}
    for key, got in coefficient_canary(coefficients).items():
        for k in ("k0_bytes", "kall_bytes"):
            want = (stored.get(key) or {}).get(k)
            if want is None or abs(got[k] - want) > CANARY_RTOL * max(abs(want), 1):
                raise IncompatibleArtifact(
                    f"coefficients canary {key}: {k}={got[k]} does not reproduce the stored "
                    f"{want} (relative tolerance {CANARY_RTOL})"
                )
    return coefficients


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _estimator(booster: lgb.Booster, meta: dict[str, Any]) -> PeakMemoryRegressor:
    from model.estimator import PeakMemoryRegressor
    from model.features import FEATURE_NAMES

    est = PeakMemoryRegressor(**meta["params"])
    est.booster_ = booster
    est.conformal_log_margin_ = float(meta.get("conformal_log_margin", 0.0))
    est.calibration_coverage_ = float(meta.get("calibration_coverage", 0.0))
    est.n_calibration_ = int(meta.get("n_calibration", 0))
    est.feature_names_in_ = list(FEATURE_NAMES)
    est.n_features_in_ = len(FEATURE_NAMES)
    return est


def canary_predictions(est: PeakMemoryRegressor) -> dict[str, dict[str, int]]:
    """The estimator's raw predicted peak bytes (before any floor or envelope a curve adds) at k = 0 and
    k = L for each :data:`CANARY` configuration, with the model-state floor
    (:func:`model.analytic.model_state_bytes`) of each.

    Returns:
        ``{"<model>/mb<m>/s<seq>/<sharding>/dp<n>": {"k0_bytes", "kall_bytes", "floor_bytes"}}``.
    """
    import numpy as np

    from memfit.schema import TrainingConfig
    from model.features import curve_matrix
    from model.job import resolve

    out = {}
    for name, mb, seq, sharding, dp in CANARY:
        job = resolve(name, TrainingConfig(micro_batch_size=mb, seq_len=seq, sharding=sharding, data_parallel_size=dp))
        base, ratio = est.predict_matrix(curve_matrix(job.spec, job.training))
        raw = np.exp(base + ratio)
        out[f"{name}/mb{mb}/s{seq}/{sharding}/dp{dp}"] = {
            "k0_bytes": int(raw[0]),
            "kall_bytes": int(raw[-1]),
            "floor_bytes": int(job.states.total_bytes),
        }
    return out


def check_canary(got: dict[str, dict[str, int]], stored: dict[str, dict[str, int]] | None) -> None:
    """Raise :class:`IncompatibleArtifact` when a canary prediction is under its model-state floor or
    differs from the stored one by more than :data:`CANARY_RTOL` (``stored=None``: floor only)."""
    for key, g in got.items():
        for k in ("k0_bytes", "kall_bytes"):
            if g[k] < g["floor_bytes"]:
                raise IncompatibleArtifact(
                    f"canary {key}: {k}={g[k]} is below the model-state floor "
                    f"{g['floor_bytes']} (weights + gradients + optimizer states)"
                )
            if stored is not None:
                want = (stored.get(key) or {}).get(k)
                if want is None or abs(g[k] - want) > CANARY_RTOL * max(abs(want), 1):
                    raise IncompatibleArtifact(
                        f"canary {key}: {k}={g[k]} does not reproduce the stored {want} "
                        f"(relative tolerance {CANARY_RTOL})"
                    )


def _parse_in_child(model_text: bytes, meta: dict[str, Any]) -> Callable[[], dict[str, dict[str, int]]]:
    """Start parsing ``model_text`` and running the canary in a child process; returns a function that waits for
    the child and returns its canary predictions. The caller works meanwhile (:meth:`Registry.load` checks and
    parses the coefficient files), so the child's imports and parsing (~4 s on 2 cores) do not add to them.

    Raises (the returned function):
        IncompatibleArtifact: the child crashed (e.g. a LightGBM segfault), timed out or refused.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    payload = json.dumps({"params": meta.get("params", {})}).encode() + b"\n" + model_text
    result: list[Any] = []

    def run() -> None:  # the child's I/O in a thread: subprocess.run's own pipes, timeout and kill
        try:
            result.append(
                subprocess.run(
                    [sys.executable, "-m", "model.registry"],
                    input=payload,
                    capture_output=True,
                    check=False,
                    timeout=CHILD_TIMEOUT_S,
                    env=env,
                    cwd=str(REPO_ROOT),
                )
            )
        except (subprocess.TimeoutExpired, OSError) as err:
            result.append(err)

    thread = threading.Thread(target=run, name="memfit-model-canary", daemon=True)
    thread.start()

    def wait() -> dict[str, dict[str, int]]:
        thread.join()
        done = result[0]
        if isinstance(done, subprocess.TimeoutExpired):
            raise IncompatibleArtifact(f"parsing took over {CHILD_TIMEOUT_S} s") from done
        if isinstance(done, OSError):
            raise done
        if done.returncode != 0:
            why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
            last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise IncompatibleArtifact(f"the model file does not parse ({why}) {last[0][:300]}".rstrip())
        return json.loads(done.stdout)

    return wait


def _child_main() -> int:
    """Child side of :func:`_parse_in_child`: stdin = JSON header line + model text; stdout = canary JSON."""
    import lightgbm as lgb

    from model.features import FEATURE_NAMES

    data = sys.stdin.buffer.read()
    header, _, text = data.partition(b"\n")
    meta = json.loads(header)
    booster = lgb.Booster(model_str=text.decode())
    if booster.feature_name() != FEATURE_NAMES:
        print("feature list differs from this code's", file=sys.stderr)
        return 2
    print(json.dumps(canary_predictions(_estimator(booster, meta))))
    return 0


#: SHA-256 digests of model files this process has already validated in a child (parsing is
#: deterministic: the same bytes need not be re-checked)
_validated: dict[str, dict[str, dict[str, int]]] = {}
#: children started ahead of :meth:`Registry.load` (:meth:`Registry.start_check`) by model file digest: their waiters
_pending: dict[str, Callable[[], dict[str, dict[str, int]]]] = {}


def fingerprint(df) -> str:
    """SHA-256 over the sorted record ids and peaks: identifies the training data."""
    h = hashlib.sha256()
    for rid, peak in sorted(zip(df["record_id"], df["peak_allocated_bytes"])):
        h.update(f"{rid}:{int(peak)}\n".encode())
    return h.hexdigest()


def _finite(obj: Any) -> Any:
    """NaN/inf -> None, recursively (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
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

    def register(
        self,
        est: PeakMemoryRegressor,
        *,
        metrics: dict[str, Any],
        data_fingerprint: str,
        extra: dict[str, Any] | None = None,
        coefficients: Any = None,
    ) -> str:
        """Write a new numbered version (not yet current); returns its name.

        ``coefficients``: a fitted :class:`model.coefficients.CoefficientModel` served for the provisional
        configurations it covers, written to ``<version>/coefficients/`` (text boosters + JSON), or None."""
        self.root.mkdir(parents=True, exist_ok=True)
        while True:  # reserve the next number atomically: concurrent retrains get distinct versions
            name = f"{int(self.versions()[-1]) + 1 if self.versions() else 1:04d}"
            try:
                (self.root / name).mkdir()
                break
            except FileExistsError:
                continue
        tmp = self.root / name
        est.booster_.save_model(str(tmp / MODEL_FILE))
        digest = sha256_hex((tmp / MODEL_FILE).read_bytes())
        sums = {MODEL_FILE: digest}
        coef_meta = None
        if coefficients is not None:
            coefficients.save(tmp / COEFFICIENTS_DIR)
            files = sorted((tmp / COEFFICIENTS_DIR).iterdir())
            sums.update({f"{COEFFICIENTS_DIR}/{f.name}": sha256_hex(f.read_bytes()) for f in files})
            coef_meta = {
                "dir": COEFFICIENTS_DIR,
                "n_entries": coefficients.n_entries_,
                "targets": len(coefficients.boosters_),
                "objectives": list(coefficients.objectives),
                "boosters": sum(len(b) for b in coefficients.boosters_.values()),
                "size_bytes": sum(f.stat().st_size for f in files),
            }
        import lightgbm as lgb
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
            "artifact_sha256": sums,
            "canary": canary_predictions(est),
            "coefficients": coef_meta,
            **({"coefficient_canary": coefficient_canary(coefficients)} if coefficients is not None else {}),
            "versions": {
                "lightgbm": lgb.__version__,
                "sklearn": sklearn.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            **(extra or {}),
        }
        (tmp / "meta.json").write_text(json.dumps(_finite(meta), indent=1, default=str, allow_nan=False))
        return name

    def promote(self, version: str) -> None:
        """Point ``CURRENT`` at ``version`` atomically (also how rollback is done).

        Raises:
            ValueError: unknown version. IncompatibleArtifact: the version fails :meth:`load`'s checks.
        """
        if version not in self.versions():
            raise ValueError(f"unknown model version {version!r}; registered: {self.versions()}")
        self.load(version)
        tmp = self.root / ".CURRENT.tmp"
        tmp.write_text(version + "\n")
        os.replace(tmp, self.root / "CURRENT")

    def meta(self, version: str) -> dict[str, Any]:
        return json.loads((self.root / version / "meta.json").read_text())

    def start_check(self, version: str | None = None) -> None:
        """Start :meth:`load`'s canary child for ``version`` (default: current) now, before lightgbm and the feature
        code are imported here: the child's imports and parse (~3-4 s) run while the caller imports and prepares,
        and :meth:`load` waits for that child instead of starting one (the same check, the same verdict). Never
        raises: a version that cannot be read or fails its checksum is left to :meth:`load`, which says why."""
        try:
            d = self.root / (version or self.current() or "")
            meta = json.loads((d / "meta.json").read_text())
            text = (d / MODEL_FILE).read_bytes()
            digest = sha256_hex(text)
            if (meta.get("artifact_sha256") or {}).get(MODEL_FILE, digest) != digest:
                return
        except (OSError, ValueError, AttributeError, TypeError):  # unreadable, not JSON, not a dict: load() says
            return
        if digest not in _validated and digest not in _pending:
            _pending[digest] = _parse_in_child(text, meta)

    def load(self, version: str | None = None) -> LoadedModel:
        """Load a version (default: current) and check it can be served (see the module docstring).

        Raises:
            FileNotFoundError: no such version / no current model.
            IncompatibleArtifact: checksum mismatch, unparsable file (even one that crashes the
                parser), canary not reproduced or under the model-state floor, other format or features.
        """
        import lightgbm as lgb

        from model.features import FEATURE_NAMES

        version = version or self.current()
        if version is None:
            raise FileNotFoundError(f"no current model in {self.root}")
        d = self.root / version
        try:
            meta = json.loads((d / "meta.json").read_text())
            text = (d / MODEL_FILE).read_bytes()
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as err:
            raise IncompatibleArtifact(f"model {version}: unreadable ({type(err).__name__})") from err
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            got = meta.get("format_version") if isinstance(meta, dict) else None
            raise IncompatibleArtifact(f"model {version}: format {got} != {FORMAT_VERSION}")
        if meta.get("feature_names") != FEATURE_NAMES:
            raise IncompatibleArtifact(f"model {version}: feature list differs from this code's")
        warnings = []
        digest = sha256_hex(text)
        want = (meta.get("artifact_sha256") or {}).get(MODEL_FILE)
        if want is None:
            warnings.append(f"model {version} has no artifact checksum (registered before checksums)")
        elif want != digest:
            raise IncompatibleArtifact(
                f"model {version}: {MODEL_FILE} sha256 {digest[:12]}... does not match "
                f"the registered {str(want)[:12]}... (file changed after registration)"
            )
        # the child parses model.txt while this process checks and parses the coefficient files; the child's verdict
        # is still taken first, and model.txt parsed here only after it
        # a child started by start_check for these bytes is waited for, not started again
        wait = (
            (lambda: _validated[digest])
            if digest in _validated
            else (_pending.pop(digest, None) or _parse_in_child(text, meta))
        )
        try:
            coefficients, coefficients_error = _load_coefficients(d, meta), None
        except IncompatibleArtifact as err:
            coefficients, coefficients_error = None, err
        try:
            _validated[digest] = wait()
            check_canary(_validated[digest], meta.get("canary"))
        except IncompatibleArtifact as err:
            _validated.pop(digest, None)
            raise IncompatibleArtifact(f"model {version}: {err}") from err
        if meta.get("canary") is None:
            warnings.append(f"model {version} has no stored canary; checked against the model-state floor only")
        booster = lgb.Booster(model_str=text.decode())  # the same bytes parsed cleanly in the child
        if coefficients_error is not None:
            raise IncompatibleArtifact(f"model {version}: {coefficients_error}") from coefficients_error
        return LoadedModel(version, _estimator(booster, meta), meta, warnings, coefficients)


if __name__ == "__main__":
    sys.exit(_child_main())
