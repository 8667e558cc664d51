"""Trace never-seen configurations once, in a background process, and cache their terms.

:class:`BackgroundTracer` is the ``tracer`` of :class:`model.curve.MemoryPredictor`: when a curve is
asked for a configuration whose traced terms are missing, the request is answered on the provisional
path at once and the key is queued here. One spawned worker process runs
:func:`training.phases.trace_terms` (fake tensors; about 5 s for an 8B-class model on 2 cores) and
the result lands in the :class:`model.terms.TermsCache`, so the next request for that configuration
is answered on the traced path. Torch never runs in the serving process, and a key is traced at most
once per process (failures are remembered with their reason).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from memfit.schema import TrainingConfig
from model.terms import TermsCache

log = logging.getLogger("memfit.service")


def _trace(hf_config: dict[str, Any], training_json: str) -> dict[str, Any]:
    from training.phases import trace_terms

    return trace_terms(hf_config, TrainingConfig.model_validate_json(training_json)).to_json()


class BackgroundTracer:
    """Queue traces of missing terms keys in one worker process.

    Attributes:
        pending: keys being traced now. failed: key -> reason of a failed trace (not retried).
    """

    def __init__(self, cache: TermsCache) -> None:
        self.cache = cache
        self.pending: set[str] = set()
        self.failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, key: str, hf_config: dict[str, Any], training: TrainingConfig) -> None:
        with self._lock:
            if key in self.pending or key in self.failed or self.cache.get(key) is not None:
                return
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            self.pending.add(key)
        fut = self._pool.submit(_trace, hf_config, training.model_dump_json())
        fut.add_done_callback(lambda f, k=key: self._done(k, f))

    def _done(self, key: str, fut: Future) -> None:
        with self._lock:
            self.pending.discard(key)
        try:
            self.cache.put(key, fut.result())
            log.info("traced terms %s", key[:12])
        except Exception as err:  # noqa: BLE001 - a config the tracer can't run stays provisional
            self.failed[key] = f"{type(err).__name__}: {err}"
            log.warning("tracing %s failed: %s", key[:12], self.failed[key])

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
