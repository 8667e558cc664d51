"""Trace never-seen configurations once, in a child process with a time limit, and cache their terms.

:class:`BackgroundTracer` is the ``tracer`` of :class:`model.curve.MemoryPredictor` in the service: when
a curve is asked for a configuration whose traced terms are missing, the request is answered on the
provisional path at once and the key is queued here. A worker thread traces the queue one key at a
time, each in a fresh spawned process (:func:`trace_in_subprocess`: fake tensors, 8B-class models in
``benchmarks/results/trace_time.txt``; that process forks once more to trace its two small models side by side,
:func:`training.phases.trace_terms`) that is killed after ``timeout_s`` — a model whose code is slow under fake
tensors must not stall the queue. The result lands in the :class:`model.terms.TermsCache`, so the next
request for that configuration is answered on the traced path. Torch never runs in the serving
process; a key is traced at most once per process, and failures are remembered with their reason
and reported in the answer.

:class:`InlineTracer` does the same synchronously, for the command line (one request, one process).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
from typing import Any

from memfit.schema import TrainingConfig
from model.terms import TermsCache

log = logging.getLogger("memfit.service")

#: a trace slower than this is abandoned (8B-class models take 7-20 s on 2 idle cores, benchmarks/results/trace_time.txt)
TRACE_TIMEOUT_S = 120.0


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when the process that spawned it is gone (SIGKILL included)."""
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="memfit-parent-watch", daemon=True).start()


def _trace_child(conn, parent_pid: int, hf_config: dict[str, Any], training_json: str) -> None:
    _exit_with_parent(parent_pid)
    # the libraries' import-time chatter (DeepSpeed's accelerator notice, transformers' warnings) must not
    # reach the user's terminal or the server's log: the outcome goes back through the pipe
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        from training.phases import trace_terms

        conn.send(("ok", trace_terms(hf_config, TrainingConfig.model_validate_json(training_json)).to_json()))
    except Exception as err:  # noqa: BLE001 - reported to the parent with its reason
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()


def trace_in_subprocess(hf_config: dict[str, Any], training: TrainingConfig,
                        timeout_s: float = TRACE_TIMEOUT_S) -> dict[str, Any]:
    """:func:`training.phases.trace_terms` in a spawned process, killed after ``timeout_s``; its JSON.

    Raises:
        RuntimeError: the trace failed (with the child's reason) or took longer than ``timeout_s``.
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_trace_child, args=(child, os.getpid(), hf_config, training.model_dump_json()),
                       daemon=True, name="memfit-trace")
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise RuntimeError(f"tracing took longer than {timeout_s:g} s")
        status, payload = parent.recv()
    except EOFError as err:
        raise RuntimeError(f"the tracing process died (exit code {proc.exitcode})") from err
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join(5)
        parent.close()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


class BackgroundTracer:
    """Trace missing terms keys one at a time in a worker thread, each in a child process.

    Attributes:
        pending: keys queued or being traced. failed: key -> reason of a failed trace (not retried).
        timeout_s: per-trace time limit.
    """

    def __init__(self, cache: TermsCache, timeout_s: float = TRACE_TIMEOUT_S) -> None:
        self.cache, self.timeout_s = cache, timeout_s
        self.pending: set[str] = set()
        self.failed: dict[str, str] = {}
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def __call__(self, key: str, hf_config: dict[str, Any], training: TrainingConfig) -> str:
        """Queue ``key`` unless known; returns what the answer should say about it."""
        with self._lock:
            if key in self.failed:
                return f"tracing it failed ({self.failed[key]}), so the learned model answers"
            if key in self.pending:
                return f"tracing is queued or running ({len(self.pending)} in the queue); ask again shortly"
            if self.cache.get(key) is not None:
                return "traced meanwhile; ask again"
            ahead = len(self.pending)
            self.pending.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="memfit-tracer", daemon=True)
                self._thread.start()
        self._queue.put((key, hf_config, training))
        each = f"usually 5-30 s, at most {self.timeout_s:g} s"
        if ahead:  # one trace at a time: the wait is the queue's, not one trace's
            return (f"queued for tracing behind {ahead} other configuration(s) ({each} each); "
                    "ask again for the traced answer")
        return f"tracing it now ({each}); ask again for the traced answer"

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                key, hf_config, training = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.cache.put(key, trace_in_subprocess(hf_config, training, self.timeout_s))
                log.info("traced terms %s", key[:12])
            except Exception as err:  # noqa: BLE001 - a config the tracer can't run stays provisional
                self.failed[key] = str(err)[:300]
                log.warning("tracing %s failed: %s", key[:12], self.failed[key])
            finally:
                with self._lock:
                    self.pending.discard(key)

    def shutdown(self) -> None:
        """Stop after the trace in progress (its child process exits with the server)."""
        self._stop.set()


class InlineTracer:
    """Trace a missing key synchronously (command line): the curve is then answered on the traced path."""

    def __init__(self, cache: TermsCache, timeout_s: float = TRACE_TIMEOUT_S, announce=None) -> None:
        self.cache, self.timeout_s, self.announce = cache, timeout_s, announce

    def __call__(self, key: str, hf_config: dict[str, Any], training: TrainingConfig) -> str:
        if self.announce is not None:
            self.announce("tracing this configuration once (usually 5-30 s) ...")
        try:
            self.cache.put(key, trace_in_subprocess(hf_config, training, self.timeout_s))
        except RuntimeError as err:
            return f"tracing it failed ({err}), so the learned model answers"
        return "traced now"
