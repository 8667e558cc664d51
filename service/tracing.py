"""Trace never-seen configurations once, in a child process with a time limit, and cache their terms.

:class:`BackgroundTracer` is the ``tracer`` of :class:`model.curve.MemoryPredictor` in the service: when
a curve is asked for a configuration whose traced terms are missing, the request is answered on the
provisional path at once and the key is queued here. A worker thread traces the queue one key at a
time in one spawned tracing process that imports PyTorch once and stays (:class:`TracingProcess`: fake
tensors, 8B-class models in ``benchmarks/results/trace_time.txt``; it forks once more per trace to trace the two
small models side by side, :func:`tracer.phases.trace_terms`). A trace past ``timeout_s`` kills that process —
a model whose code is slow under fake tensors must not stall the queue — and the next trace starts a new one.
The result lands in the :class:`model.terms.TermsCache`, so the next request for that configuration is
answered on the traced path. Torch never runs in the serving
process; a key is traced at most once per process, and failures are remembered with their reason
and reported in the answer.

:class:`InlineTracer` does the same synchronously, for the command line (one request, one process).
"""

from __future__ import annotations

import contextvars
import json
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memfit.schema import TrainingConfig
from model.terms import TermsCache

if TYPE_CHECKING:
    from tracer.stream_source import Refusal

log = logging.getLogger("memfit.service")

#: the client a request comes from (its peer address; set per request by :class:`service.limits.BodyLimitMiddleware`):
#: whose share of the trace queue a never-seen configuration takes. None outside a request.
CLIENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("memfit_client", default=None)

#: a trace slower than this is abandoned (8B-class models: 5-18 s on 2 idle cores, benchmarks/results/trace_time.txt)
TRACE_TIMEOUT_S = 120.0


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when the process that spawned it is gone (SIGKILL included)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="memfit-parent-watch", daemon=True).start()


#: a tracing process is started afresh after this many traces: PyTorch's fake-tensor dispatch cache and the imported
#: modeling code stay in it between traces (what makes the next trace faster), and must not grow without bound
TRACES_PER_PROCESS = 32


def _serve_traces(conn, parent_pid: int) -> None:
    """The tracing process: import the tracer once, then answer one configuration per message until the pipe
    closes. Messages are JSON both ways (``[hf_config, training_json]`` in; ``["ok", terms]`` or
    ``["error", reason]`` out)."""
    _exit_with_parent(parent_pid)
    # background work: the serving process's requests get the CPU first (a trace or this process's start-up
    # running beside them took the cores a /recommend answer needs)
    os.nice(10)
    # the libraries' import-time chatter (DeepSpeed's accelerator notice, transformers' warnings) must not
    # reach the user's terminal or the server's log: the outcome goes back through the pipe
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    from tracer.phases import trace_terms

    conn.send_bytes(json.dumps(["ready", os.getpid()]).encode())
    while True:
        try:
            message = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if message[0] == STREAMS:
            conn.send_bytes(json.dumps(_record_streams(*message[1:])).encode())
            continue
        hf_config, training_json, *generation = message
        try:
            training = TrainingConfig.model_validate_json(training_json)
            reply = ["ok", trace_terms(hf_config, training, generation=(generation or [None])[0]).to_json()]
        except Exception as err:  # noqa: BLE001 - reported to the parent with its reason
            reply = ["error", f"{type(err).__name__}: {err}"]
        conn.send_bytes(json.dumps(reply).encode())


#: first element of a message asking the tracing process for the allocation streams of the fit decision
STREAMS = "streams"


def _record_streams(hf_config: dict[str, Any], training_json: str, num_layers: int, k: int, generation: str) -> list:
    """In the tracing process: record what the fit decision needs for the full model's stream at ``k`` on a GPU of
    ``generation`` (:func:`tracer.stream_source.record_for_fit`: the templates near ``k``, or the full model's
    stream where no template composes it); ``["ok", ks]`` (the k whose streams are now at hand) or
    ``["error", reason]``."""
    from tracer.stream_source import record_for_fit

    try:
        training = TrainingConfig.model_validate_json(training_json)
        return ["ok", record_for_fit(hf_config, training, num_layers, k, generation)]
    except Exception as err:  # noqa: BLE001 - reported to the parent with its reason
        return ["error", f"{type(err).__name__}: {err}"]


class TracingProcess:
    """A spawned process that imports PyTorch and the tracer once and then traces configurations one at a time
    (:func:`tracer.phases.trace_terms`). Spawning and importing cost seconds (``benchmarks/results/trace_time.txt``:
    the one-off imports), so the service keeps one for all its traces. A trace past its time limit or a crash
    kills the process; the next trace starts a fresh one, as does every :data:`TRACES_PER_PROCESS`-th.
    """

    def __init__(self) -> None:
        self._proc: Any = None
        self._conn: Any = None
        self._traces = 0

    @property
    def pid(self) -> int | None:
        """The tracing process's id; None when none is running."""
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    def start(self, timeout_s: float = TRACE_TIMEOUT_S) -> None:
        """Start the tracing process unless one is running, and wait until it has imported the tracer.

        Raises:
            RuntimeError: the process did not become ready within ``timeout_s`` (it is killed) or died.
        """
        if self._proc is not None and self._proc.is_alive() and self._traces < TRACES_PER_PROCESS:
            return
        self.close()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve_traces, args=(child, os.getpid()), daemon=True, name="memfit-trace")
        proc.start()
        child.close()
        self._proc, self._conn, self._traces = proc, parent, 0
        self._receive(timeout_s, "starting the tracing process")

    def _receive(self, timeout_s: float, what: str) -> list:
        try:
            if not self._conn.poll(max(timeout_s, 0.0)):
                self.close()
                raise RuntimeError(f"{what} took longer than {timeout_s:g} s")
            return json.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as err:
            code = self._proc.exitcode if self._proc is not None else None
            self.close()
            raise RuntimeError(f"the tracing process died (exit code {code})") from err

    def trace(
        self,
        hf_config: dict[str, Any],
        training: TrainingConfig,
        timeout_s: float = TRACE_TIMEOUT_S,
        generation: str | None = None,
    ) -> dict[str, Any]:
        """:func:`tracer.phases.trace_terms` of one configuration in the tracing process; its JSON. Starting the
        process (when none is running) counts towards ``timeout_s``. ``generation``: trace with that GPU generation's
        CUDA semantics (``trace_terms``' argument).

        Raises:
            RuntimeError: the trace failed (with the process's reason), took longer than ``timeout_s`` (the
                process is killed), or the process died.
        """
        return self._ask([hf_config, training.model_dump_json(), generation], timeout_s, "tracing")

    def streams(
        self,
        hf_config: dict[str, Any],
        training: TrainingConfig,
        num_layers: int,
        k: int,
        generation: str,
        timeout_s: float,
    ) -> list[int]:
        """Record the allocation streams the fit decision needs at ``k`` on a GPU of ``generation`` in the tracing
        process (:func:`tracer.stream_source.record_for_fit`); the k they cover.

        Raises:
            RuntimeError: as :meth:`trace`.
        """
        return self._ask(
            [STREAMS, hf_config, training.model_dump_json(), num_layers, k, generation],
            timeout_s,
            "recording allocation streams",
        )

    def _ask(self, message: list, timeout_s: float, what: str) -> Any:
        """Send one message (starting the process when none runs; that counts towards ``timeout_s``) and return
        the payload of its ``["ok", payload]`` reply.

        Raises:
            RuntimeError: an ``["error", reason]`` reply, no reply within ``timeout_s`` (the process is killed),
                or the process died.
        """
        deadline = time.monotonic() + timeout_s
        self.start(timeout_s)
        self._traces += 1
        try:
            self._conn.send_bytes(json.dumps(message).encode())
        except OSError as err:
            self.close()
            raise RuntimeError("the tracing process died") from err
        status, payload = self._receive(deadline - time.monotonic(), what)
        if status != "ok":
            raise RuntimeError(payload)
        return payload

    def close(self) -> None:
        """End the tracing process (killed if it is tracing)."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def trace_in_subprocess(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    timeout_s: float = TRACE_TIMEOUT_S,
    generation: str | None = None,
) -> dict[str, Any]:
    """:func:`tracer.phases.trace_terms` in a spawned process of its own, killed after ``timeout_s``; its JSON
    (:class:`TracingProcess`, used once).

    Raises:
        RuntimeError: the trace failed (with the child's reason) or took longer than ``timeout_s``.
    """
    process = TracingProcess()
    try:
        return process.trace(hf_config, training, timeout_s, generation)
    finally:
        process.close()


def _generation(key: str, hf_config: dict[str, Any], training: TrainingConfig) -> str | None:
    """The GPU generation ``key`` was made with (:func:`model.terms.key_generation` of the request being answered):
    the trace must follow that generation's CUDA semantics for the terms to belong under ``key``."""
    from model.terms import key_generation, terms_key

    gen = key_generation(hf_config, training)
    return gen if gen is not None and terms_key(hf_config, training, gen) == key else None


class BackgroundTracer:
    """Trace missing terms keys one at a time in a worker thread, in one :class:`TracingProcess`.

    The queue is bounded: at most ``max_pending`` keys wait or run, at most ``max_per_client`` of them asked by one
    client (:data:`CLIENT`; each trace costs 20-40 s of CPU, ``benchmarks/results/trace_time.txt``). A key beyond
    either bound is not queued: the answer stays provisional and says "tracing deferred"; it is kept in
    ``deferred`` so the service's curve cache asks again (:class:`service.recommender.CurveCache`), and the next
    request for it after the queue has room queues it.

    Attributes:
        pending: keys queued or being traced. failed: key -> reason of a failed trace (not retried).
        deferred: keys refused a place in the queue (the newest 4096). timeout_s: per-trace time limit.
        runner: ``(hf_config, training, timeout_s) -> terms JSON``; default: the worker's :class:`TracingProcess`.
    """

    def __init__(
        self,
        cache: TermsCache,
        timeout_s: float = TRACE_TIMEOUT_S,
        max_pending: int = 8,
        max_per_client: int = 2,
        runner: Callable[..., dict[str, Any]] | None = None,
    ) -> None:
        self.cache, self.timeout_s = cache, timeout_s
        self.max_pending, self.max_per_client, self.runner = max_pending, max_per_client, runner
        self.pending: set[str] = set()
        self.failed: dict[str, str] = {}
        self.deferred: OrderedDict[str, None] = OrderedDict()
        self._owner: dict[str, str | None] = {}
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
            client = CLIENT.get()
            full = self._queue_full(client)
            if full is not None:
                self.deferred[key] = None
                self.deferred.move_to_end(key)
                while len(self.deferred) > 4096:
                    self.deferred.popitem(last=False)
                return f"tracing deferred: {full}, so the learned model answers; ask again later for a traced answer"
            self.deferred.pop(key, None)
            ahead = len(self.pending)
            self._admit(key, client)
        self._queue.put((key, hf_config, training, _generation(key, hf_config, training)))
        each = f"usually 5-30 s, at most {self.timeout_s:g} s"
        if ahead:  # one trace at a time: the wait is the queue's, not one trace's
            return (
                f"queued for tracing behind {ahead} other configuration(s) ({each} each); "
                "ask again for the traced answer"
            )
        return f"tracing it now ({each}); ask again for the traced answer"

    def streams(
        self,
        hf_config: dict[str, Any],
        training: TrainingConfig,
        num_layers: int,
        k: int,
        path: str,
        generation: str,
    ) -> Refusal | None:
        """Queue the recording of the allocation streams the fit decision needs at ``k`` on a GPU of ``generation``
        (:meth:`TracingProcess.streams`; ``path``: the missing template's or full stream's file, the queue's key),
        sharing the queue's bounds with the traces; None when queued now or before. Beyond the bounds it is not
        queued: a :class:`tracer.stream_source.Refusal` for now (the fit decision stays on the measured allowance
        and asks again); one that failed is not queued again: a final refusal with its reason
        (:func:`tracer.stream_source.stream_source` then stops asking for this configuration)."""
        from tracer.stream_source import Refusal

        key = f"{STREAMS}:{path}"
        with self._lock:
            if key in self.failed:
                return Refusal(self.failed[key], final=True)
            if key in self.pending:
                return None
            client = CLIENT.get()
            full = self._queue_full(client)
            if full is not None:
                return Refusal(full, final=False)
            self._admit(key, client)
        self._queue.put((key, hf_config, training, (num_layers, k, generation)))
        return None

    def start(self) -> None:
        """Start the worker and its tracing process now (the service's warm-up), so that the first never-seen
        configuration does not wait for the process to spawn and import PyTorch."""
        with self._lock:
            self._start_worker(start_now=True)

    def _queue_full(self, client: str | None) -> str | None:
        """Under the lock: which bound of the queue a new entry from ``client`` would pass, or None."""
        if len(self.pending) >= self.max_pending:
            n = len(self.pending)
            return f"{_entries(self.pending)} {'is' if n == 1 else 'are'} queued (at most {self.max_pending})"
        mine = [key for key, owner in self._owner.items() if owner == client]
        if len(mine) >= self.max_per_client:
            return f"this client has {_entries(mine)} queued (at most {self.max_per_client})"
        return None

    def _admit(self, key: str, client: str | None) -> None:
        """Under the lock: count ``key`` as queued by ``client`` and make sure the worker runs."""
        self.pending.add(key)
        self._owner[key] = client
        self._start_worker()

    def _start_worker(self, start_now: bool = False) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, args=(start_now,), name="memfit-tracer", daemon=True)
            self._thread.start()

    def _work(self, start_now: bool = False) -> None:
        process = TracingProcess()
        try:
            if start_now and self.runner is None:
                try:
                    process.start(self.timeout_s)
                except RuntimeError as err:  # the first trace starts one again
                    log.warning("starting the tracing process failed: %s", err)
            self._trace_queue(process)
        finally:
            process.close()

    def _trace_queue(self, process: TracingProcess) -> None:
        while not self._stop.is_set():
            try:
                key, hf_config, training, extra = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            run = self.runner or process.trace
            try:
                if key.startswith(f"{STREAMS}:"):
                    # extra: (num_layers, k, generation)
                    ks = process.streams(hf_config, training, *extra, self.timeout_s)
                    log.info("recorded allocation streams for k = %s (%s)", ks, key[len(STREAMS) + 1 :])
                    continue
                gen = {"generation": extra} if extra else {}  # extra: the GPU generation of the terms key
                self.cache.put(key, run(hf_config, training, self.timeout_s, **gen))
                log.info("traced terms %s", key[:12])
            except Exception as err:  # noqa: BLE001 - a config the tracer can't run stays provisional
                self.failed[key] = str(err)[:300]
                log.warning("tracing %s failed: %s", key[:12], self.failed[key])
            finally:
                with self._lock:
                    self.pending.discard(key)
                    self._owner.pop(key, None)

    def shutdown(self) -> None:
        """Stop after the trace in progress; the worker thread then ends the tracing process (which also ends
        with the server)."""
        self._stop.set()


def _entries(keys) -> str:
    """The queue entries ``keys`` in words: traces and allocation-stream recordings (keys ``streams:...``), which
    share the queue's bounds (one new configuration can ask for both)."""
    recordings = sum(str(key).startswith(f"{STREAMS}:") for key in keys)
    traces = len(keys) - recordings
    parts = [f"{traces} trace{'' if traces == 1 else 's'}"] if traces else []
    if recordings:
        parts.append(f"{recordings} allocation-stream recording{'' if recordings == 1 else 's'}")
    return " and ".join(parts)


class InlineTracer:
    """Trace a missing key synchronously (command line): the curve is then answered on the traced path."""

    def __init__(self, cache: TermsCache, timeout_s: float = TRACE_TIMEOUT_S, announce=None) -> None:
        self.cache, self.timeout_s, self.announce = cache, timeout_s, announce

    def __call__(self, key: str, hf_config: dict[str, Any], training: TrainingConfig) -> str:
        if self.announce is not None:
            self.announce(
                "tracing this configuration once (usually 10-40 s on two busy cores: a process starts, "
                "imports PyTorch and traces four small models) ..."
            )
        try:
            gen = _generation(key, hf_config, training)
            self.cache.put(key, trace_in_subprocess(hf_config, training, self.timeout_s, gen))
        except RuntimeError as err:
            return f"tracing it failed ({err}), so the learned model answers"
        return "traced now"
