"""The served model: loaded from the registry, swapped without a restart, never replaced by a bad one."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from data.store import TelemetryStore
from model.overhead import OverheadModel
from model.registry import IncompatibleArtifact, Registry
from model.terms import TermsCache
from service.recommender import Recommender
from service.tracing import BackgroundTracer

log = logging.getLogger("memfit.service")

MODEL_LOAD_FAILURES = Counter(
    "memfit_model_load_failures_total", "Model versions refused at load (checksum, parse, canary, format)"
)
MODEL_REFUSED = Gauge(
    "memfit_model_refused", "1 while the registry's current version is refused and an older (or no) model keeps serving"
)
MODEL_LOADED = Gauge("memfit_model_loaded", "1 while a model is serving")


def overhead_from(store: TelemetryStore | None) -> OverheadModel:
    """The GPU overhead learned from the CUDA telemetry in ``store`` and the shipped GPU pressure and validation
    measurements (:meth:`model.overhead.OverheadModel.fit`); from the shipped measurements alone when ``store`` is
    None. The service and the local command line both take it, so they give the same answer."""
    import pandas as pd

    if store is None:
        return OverheadModel().fit(pd.DataFrame())
    import sqlalchemy as sa

    t = store.table
    q = sa.select(
        t.c.method, t.c.device_name, t.c.peak_allocated_bytes, t.c.peak_reserved_bytes, t.c.outside_torch_bytes, t.c.oom
    ).where(t.c.method == "cuda")
    with store.engine.connect() as conn:
        rows = pd.DataFrame(conn.execute(q).mappings().all())
    return OverheadModel().fit(rows)


class ModelHolder:
    """Keeps the last good :class:`Recommender`; :meth:`refresh` follows the registry's ``CURRENT``.

    ``refresh`` is cheap when nothing changed (one ``stat``), so it runs before each request.
    A version that fails :meth:`model.registry.Registry.load`'s checks is refused: logged, counted in
    ``memfit_model_load_failures_total``, kept in ``last_error`` (shown by ``/v2/health/ready``), and
    the previous model keeps serving.
    """

    def __init__(
        self,
        registry: Registry,
        overhead: OverheadModel | None = None,
        terms: TermsCache | None = None,
        tracer: BackgroundTracer | None = None,
        streams: Any = None,
    ) -> None:
        self.registry = registry
        self.streams = streams  # allocation streams for the fit decision (Recommender's ``streams``)
        self.overhead = overhead or overhead_from(None)
        self.terms = terms if terms is not None else TermsCache()
        self.tracer = tracer
        self.recommender: Recommender | None = None
        self.last_error: str | None = None
        self.warnings: list[str] = []
        self._seen: tuple[str | None, float] | None = None
        self._lock = threading.Lock()

    def _stamp(self) -> tuple[str | None, float]:
        f = Path(self.registry.root) / "CURRENT"
        try:
            return f.read_text().strip(), f.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None, 0.0

    def refresh(self, force: bool = False) -> bool:
        """Load the current version if it changed; returns True when a new model was swapped in."""
        stamp = self._stamp()
        if not force and stamp == self._seen:
            return False
        with self._lock:
            self._seen = stamp
            version = stamp[0]
            if version is None or (self.recommender and self.recommender.version == version and not force):
                return False
            try:
                loaded = self.registry.load(version)
            except (IncompatibleArtifact, FileNotFoundError, OSError) as err:
                self.last_error = f"model {version} refused: {_no_paths(str(err), self.registry.root)}"
                log.error(self.last_error)
                MODEL_LOAD_FAILURES.inc()
                MODEL_REFUSED.set(1)
                return False
            self.recommender = Recommender(
                loaded.estimator,
                loaded.version,
                self.overhead,
                loaded.meta.get("telemetry_range", {}),
                terms=self.terms,
                margins=loaded.meta.get("bound_margins"),
                tracer=self.tracer,
                coefficients=loaded.coefficients,
                streams=self.streams,
            )
            self.last_error, self.warnings = None, loaded.warnings
            MODEL_REFUSED.set(0)
            MODEL_LOADED.set(1)
            log.info("serving model %s", loaded.version)
            return True

    def status(self) -> dict[str, object]:
        """What ``/v2/health/ready`` reports about the model."""
        return {
            "serving": self.recommender.version if self.recommender else None,
            "current": self._seen[0] if self._seen else None,
            "refused": self.last_error,
            "warnings": self.warnings,
        }


def _no_paths(text: str, root: Path) -> str:
    """Server paths do not leave the server: the registry root becomes ``<registry>``."""
    return text.replace(str(Path(root).resolve()), "<registry>").replace(str(root), "<registry>")
