"""The served model: loaded from the registry, swapped without a restart, never replaced by a bad one."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from model.overhead import OverheadModel
from model.registry import IncompatibleArtifact, Registry
from model.terms import TermsCache
from service.recommender import Recommender
from service.tracing import BackgroundTracer

log = logging.getLogger("memfit.service")


class ModelHolder:
    """Keeps the last good :class:`Recommender`; :meth:`refresh` follows the registry's ``CURRENT``.

    ``refresh`` is cheap when nothing changed (one ``stat``), so it runs before each request.
    A version that fails to load is logged and remembered in ``last_error``; the previous model keeps
    serving.
    """

    def __init__(self, registry: Registry, overhead: OverheadModel | None = None, terms: TermsCache | None = None,
                 tracer: BackgroundTracer | None = None) -> None:
        self.registry = registry
        self.overhead = overhead or OverheadModel()
        self.terms = terms if terms is not None else TermsCache()
        self.tracer = tracer
        self.recommender: Recommender | None = None
        self.last_error: str | None = None
        self._seen: tuple[str | None, float] | None = None
        self._lock = threading.Lock()

    def _stamp(self) -> tuple[str | None, float]:
        f = Path(self.registry.root) / "CURRENT"
        try:
            return f.read_text().strip(), f.stat().st_mtime
        except FileNotFoundError:
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
                self.last_error = f"model {version} refused: {err}"
                log.error(self.last_error)
                return False
            meta = loaded.meta
            self.recommender = Recommender(loaded.estimator, loaded.version, self.overhead,
                                           meta.get("telemetry_range", {}), terms=self.terms,
                                           margins=meta.get("bound_margins"), tracer=self.tracer)
            self.last_error = None
            log.info("serving model %s", loaded.version)
            return True
