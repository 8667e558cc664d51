"""HTTP client of the memfit service, safe to call from a training script.

    from memfit import Client
    rec = Client("http://memfit:8000").recommend(model="llama-3-8b",
                                                 training={"micro_batch_size": 2, "seq_len": 8192},
                                                 cluster={"gpu": "H100-80GB"})

Connection errors, timeouts and 5xx answers are retried (``retries`` times, exponential backoff
starting at ``backoff_s``). When the service still cannot answer and ``strict=False`` (the default),
:meth:`Client.recommend` returns a :class:`FallbackRecommendation`: the stated safe plan **checkpoint every
layer**, ``model_version="fallback"``, with the reason in ``warnings``, and logs one warning on the ``memfit``
logger. With ``strict=True`` it raises instead. An answer the service is still working on (its ``pending`` not empty:
the configuration's trace for the named GPU, or the fit decision's allocation streams, still running) is asked for
again until it is final, for up to ``final_wait_s`` seconds; one still pending then is treated as no answer (the
fallback, or :class:`NotFinal` when strict), because an interim k can be too small for the GPU (gpt2-medium amp_fp16
micro-batch 4 on a T4: interim k = 7, final k = 10). A request that is invalid (checked here before any I/O) or that
the service rejects (4xx: an unknown model, a value out of range) always raises, naming the field: it would fail the
same way on every call, and a fallback would hide the mistake behind a plan that costs a third of a forward pass.

Only httpx and pydantic are needed here.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from math import inf
from typing import Any, Self

import httpx
from pydantic import Field, ValidationError

from memfit.api import (
    FINAL_WAIT_S,
    ArchitectureIn,
    ClusterIn,
    PredictRequest,
    PredictResponse,
    Recommendation,
    RecommendRequest,
    TrainingIn,
    request_hf_config,
)
from memfit.checkpointing import FALLBACK_VERSION

log = logging.getLogger("memfit")

#: answers worth asking again: the server's errors, a request timeout (408: the service's body deadline) and
#: rate limiting (429); RFC 9110 Sec. 15.5.9 and 15.6, RFC 6585 Sec. 4
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


#: the longest pause between two asks for a final answer, seconds (the service rechecks a waiting curve every 1 s)
MAX_FINAL_POLL_S = 2.0

#: the longest ``Retry-After`` waited between two attempts, seconds (the backoff itself is capped at 4 s)
MAX_RETRY_WAIT_S = 8.0


def _retry_after_s(r: httpx.Response) -> float:
    """The seconds a 429/503's ``Retry-After`` header asks for (RFC 9110 Sec. 10.2.3, the delay-seconds form); 0 when
    absent or given as an HTTP date."""
    value = r.headers.get("retry-after", "")
    return float(value) if value.strip().isdigit() else 0.0


class ServiceError(RuntimeError):
    """The service could not give an answer (unreachable, timed out, 408/429/5xx after retries).

    Attributes:
        status_code: HTTP status when the service answered, else None.
    """

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class NotFinal(ServiceError):
    """The service's answer was still not final (its ``pending`` not empty) when the client's ``final_wait_s`` ran out.

    Attributes:
        interim: the last answer (not final). final_wait_s: the wait, seconds.
    """

    def __init__(self, message: str, interim: Recommendation, final_wait_s: float) -> None:
        super().__init__(message)
        self.interim, self.final_wait_s = interim, final_wait_s


def check_url(url: Any) -> str:
    """``url`` when it is an http(s) URL with a host and a port in [1, 65535] (if given).

    Raises:
        ValueError: naming the URL and what it must be.
    """
    try:
        parsed = httpx.URL(url) if isinstance(url, str) else None
    except httpx.InvalidURL:
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"url={url!r} must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ValueError(f"url={url!r}: port {parsed.port} must be in [1, 65535]")
    return url


#: what each item of an answer's ``pending`` means, in words (:attr:`memfit.api.Recommendation.pending`)
PENDING_WORDS = {
    "terms": "tracing this configuration with the GPU's CUDA semantics (queued, running, or waiting for room in its "
    "queue)",
    "allocation streams": "recording the step's allocation streams for the fit decision (queued or running)",
}


def working_on(rec: Recommendation) -> str:
    """What the service is still working out for ``rec`` (its ``pending``), in words; "" when final."""
    return " and ".join(PENDING_WORDS.get(p, p) for p in rec.pending)


def not_final_reason(interim: Recommendation, final_wait_s: float, knob: str = "final_wait_s") -> str:
    """Why an answer still pending after ``final_wait_s`` seconds is no answer: what the service still works out and
    what the interim answer would risk; ``knob`` names the wait to raise (the command line's ``--final-wait-s``)."""
    risk = (
        f"its interim k = {interim.k} can be too small"
        if interim.fits
        else "its interim answer: no k fits, so checkpointing every layer may not fit either"
    )
    return (
        f"the answer was not final after {final_wait_s:g} s (the service is still {working_on(interim)}; {risk}): "
        f"ask again later, or raise {knob}"
    )


class RequestRejected(ValueError):
    """The service refused the request as invalid (HTTP 4xx): a ``ValueError``, so callers that catch
    ``ValueError`` keep working.

    Attributes:
        status_code: the HTTP status (422 for invalid fields).
        errors: the service's ``errors`` list of a 422 problem+json, one ``{"field", "message", "allowed"}``
            per invalid field (``field`` dotted, e.g. ``training.seq_len``); empty when the body has none.
    """

    def __init__(self, message: str, status_code: int, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.errors = list(errors or [])


def _rejected(r: httpx.Response, what: str) -> RequestRejected:
    """:class:`RequestRejected` for a 4xx answer to ``what`` (``request`` or ``telemetry``)."""
    try:
        body = r.json()
    except ValueError:
        body = None
    errors = body.get("errors") if isinstance(body, dict) and isinstance(body.get("errors"), list) else None
    return RequestRejected(
        f"memfit service rejected the {what} (HTTP {r.status_code}): {_detail(r)}", r.status_code, errors
    )


class FallbackRecommendation(Recommendation):
    """What :meth:`Client.recommend` returns when the service cannot answer and ``strict=False``.

    The plan is **checkpoint every layer**: the most memory-saving layout activation checkpointing
    offers, at about 1/3 of a forward pass of extra compute per step. Nothing was predicted:
    ``fits`` is True only in the sense that this is the plan to run (False where the service's last, interim answer
    found no k that fits: every layer may not fit either); all byte figures are 0, and ``path`` is
    ``"fallback"`` (no curve answered: neither traced nor provisional), and so is ``fit_method`` (no fit decided).
    ``layers`` lists every layer when the layer count is known (HF config dict, explicit architecture
    or a catalog name); otherwise (an unknown name) it is empty and ``num_layers`` is 0. Every
    consumer reads a fallback as "every layer" (:class:`memfit.CheckpointPlan`): :func:`memfit.apply`,
    the DeepSpeed patch and the Megatron-Core settings need no layer count for it.
    """

    fallback: bool = True
    reason: str = Field("", description="why the service's answer is missing")


def _layer_count(model: Any) -> int:
    """Layers of the requested model: from the request itself, or the catalog entry of a name (read
    from the snapshot of ``data/architectures`` shipped with memfit, :data:`memfit.hf.CATALOG_LAYERS_PATH`); 0 when unknown."""
    from memfit.hf import NUM_LAYERS_KEYS, catalog_num_layers

    if isinstance(model, str):
        return catalog_num_layers(model) or 0
    cfg = request_hf_config(model) or {}
    return next((cfg[key] for key in NUM_LAYERS_KEYS if isinstance(cfg.get(key), int) and cfg[key] > 0), 0)


def fallback_recommendation(
    request: RecommendRequest | None, reason: str, may_not_fit: bool = False
) -> FallbackRecommendation:
    """The safe "checkpoint every layer" plan for ``request`` (None: the layer count unknown); see
    :class:`FallbackRecommendation`. ``may_not_fit``: the service's interim answer found no k that fits, so the
    warning calls the plan the most memory-saving one, not a safe one."""
    L = _layer_count(request.model) if request is not None else 0
    capacity = 0
    if request is not None:
        try:
            capacity = request.cluster.memory_bytes
        except ValueError:
            capacity = 0
    return FallbackRecommendation(
        fits=not may_not_fit,
        k=L if L else None,
        layers=list(range(L)),
        num_layers=L,
        predicted_peak_bytes=0,
        path="fallback",
        fit_method="fallback",
        upper_bound_bytes=0,
        total_upper_bytes=0,
        capacity_bytes=capacity,
        usable_bytes=0,
        curve=[],
        breakdown={},
        overhead={},
        recompute_overhead_fraction=round(1 / 3, 4) if L else 0.0,
        model_version=FALLBACK_VERSION,
        warnings=[
            f"the service gave no answer ({reason}); "
            + (
                "fallback: checkpoint every layer, the most memory it can save (it may still run out of memory; "
                if may_not_fit
                else "safe fallback: checkpoint every layer (memory fit not predicted, "
            )
            + "~33% extra forward compute)"
        ],
        reason=reason,
    )


def is_fallback(rec: Recommendation) -> bool:
    """True for the client's "checkpoint every layer" fallback (``model_version == "fallback"``)."""
    return rec.model_version == FALLBACK_VERSION


class Client:
    """Client of the memfit service.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8000`` (``http``/``https`` with a host).
        token: bearer token for write endpoints (``POST /telemetry``).
        timeout_s: per-request timeout in seconds (connect and read).
        retries: extra attempts after the first on connection errors, timeouts, 408, 429 and 5xx.
        strict: raise :class:`ServiceError` when the service cannot answer instead of returning the fallback
            (an invalid or rejected request raises either way).
        backoff_s: first backoff in seconds; doubles per retry (capped at 4 s); a longer ``Retry-After`` of a
            429/503 is waited instead, up to :data:`MAX_RETRY_WAIT_S`.
        transport: an ``httpx`` transport (tests: ``httpx.MockTransport``).
        final_wait_s: how long :meth:`recommend` asks again for an answer whose ``pending`` is not empty (0: return
            the first answer as it is, for callers that poll themselves).

    Raises:
        ValueError: ``url`` not an http(s) URL with a host; ``retries`` < 0; ``timeout_s`` <= 0;
            ``final_wait_s`` not a finite number >= 0.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 5.0,
        retries: int = 2,
        strict: bool = False,
        *,
        backoff_s: float = 0.25,
        transport: httpx.BaseTransport | None = None,
        final_wait_s: float = FINAL_WAIT_S,
    ):
        check_url(url)
        if retries < 0:
            raise ValueError(f"retries={retries} must be >= 0")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if isinstance(final_wait_s, bool) or not isinstance(final_wait_s, (int, float)) or not 0 <= final_wait_s < inf:
            raise ValueError(
                f"final_wait_s={final_wait_s!r} must be a finite number of seconds >= 0 (0: return the first answer "
                "as it is)"
            )
        self.url = url.rstrip("/")
        self.token, self.timeout_s, self.retries, self.strict = token, timeout_s, retries, strict
        self.backoff_s, self.final_wait_s = backoff_s, final_wait_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers, transport=transport)
        # a client never closed (``memfit.Client(url).recommend(...)``) closes its connections when collected
        self._close = weakref.finalize(self, self._http.close)

    def close(self) -> None:
        """Close the connection pool (idempotent; also done when the client is garbage-collected or on exit)."""
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r}, strict={self.strict})"

    # -- transport ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        """One call with retries on transport errors and the statuses of :data:`_RETRY_STATUS`.

        Raises:
            ServiceError: no 2xx/4xx answer after the retries (the last error in the message).
            RuntimeError: the client was closed.
        """
        if self._http.is_closed:
            raise RuntimeError(f"{self!r} is closed: make a new memfit.Client (or use one inside `with`)")
        last, status, asked_wait_s = "no attempt", None, 0.0
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(max(min(asked_wait_s, MAX_RETRY_WAIT_S), min(4.0, self.backoff_s * 2 ** (attempt - 1))))
            try:
                r = self._http.request(method, path, json=json)
            except httpx.TimeoutException as err:
                last, status, asked_wait_s = f"timed out after {self.timeout_s}s ({type(err).__name__})", None, 0.0
            except httpx.TransportError as err:
                last, status, asked_wait_s = f"unreachable: {type(err).__name__}: {err}", None, 0.0
            else:
                if r.status_code not in _RETRY_STATUS:
                    return r
                last, status = f"HTTP {r.status_code}: {_detail(r)}", r.status_code
                asked_wait_s = _retry_after_s(r)
            log.debug("memfit %s %s attempt %d/%d failed: %s", method, path, attempt + 1, self.retries + 1, last)
        raise ServiceError(f"{method} {self.url}{path}: {last} (after {self.retries + 1} attempts)", status_code=status)

    # -- endpoints ------------------------------------------------------------------------------
    def recommend(
        self,
        request: RecommendRequest | dict[str, Any] | None = None,
        *,
        model: str | dict[str, Any] | ArchitectureIn | None = None,
        training: TrainingIn | dict[str, Any] | None = None,
        cluster: ClusterIn | dict[str, Any] | None = None,
        headroom_fraction: float = 0.05,
        layout: str = "block",
        waiting: Callable[[Recommendation, float], None] | None = None,
    ) -> Recommendation:
        """``POST /recommend``: the smallest k that fits, its layers and the curve over k.

        Give either ``request`` or ``model`` + ``training`` + ``cluster`` (+ ``headroom_fraction``
        0..0.9, ``layout`` ``block``/``even``). Byte fields of the answer are per device.

        An answer whose ``pending`` is not empty is asked for again (pauses of 0.5 s doubling to
        :data:`MAX_FINAL_POLL_S`, the last ask at the deadline) until it is final, for up to the client's
        ``final_wait_s`` (a request under way at the deadline is finished). ``waiting(interim, seconds_left)`` is
        called before each pause (e.g. to tell the user why the answer takes longer).

        Returns:
            :class:`memfit.api.Recommendation`, final (``pending`` empty) unless ``final_wait_s`` is 0; when the
            service cannot answer (unreachable, timed out, 5xx after retries, an unreadable answer, or none final
            within ``final_wait_s``) and ``strict=False``, a :class:`FallbackRecommendation` (checkpoint every
            layer), with one warning logged.

        Raises:
            TypeError: neither ``request`` nor all of ``model``/``training``/``cluster`` given.
            pydantic.ValidationError: the request is malformed (checked before any I/O; the field named).
            RequestRejected (a ``ValueError``): the service rejected the request (4xx, with its ``detail`` and
                per-field ``errors``: an unknown model, a value out of range).
            ServiceError: only with ``strict=True``: no answer; :class:`NotFinal` (a ``ServiceError``) when none
                was final within ``final_wait_s``.
        """
        if request is None and (model is None or training is None or cluster is None):
            raise TypeError("recommend() needs request=... or model=, training= and cluster=")
        if request is None:
            request = RecommendRequest(
                model=model, training=training, cluster=cluster, headroom_fraction=headroom_fraction, layout=layout
            )
        elif not isinstance(request, RecommendRequest):
            request = RecommendRequest.model_validate(request)
        body = request.model_dump(mode="json", exclude_none=True)
        try:
            rec = self._recommend_once(body)
            deadline, pause_s = time.monotonic() + self.final_wait_s, 0.5
            while rec.pending and (left_s := deadline - time.monotonic()) > 0:
                if waiting is not None:
                    waiting(rec, left_s)
                time.sleep(min(pause_s, left_s))  # the last ask at the deadline
                pause_s = min(2 * pause_s, MAX_FINAL_POLL_S)
                rec = self._recommend_once(body)
        except ServiceError as err:
            if self.strict:
                raise
            return self._fallback(request, str(err))
        if rec.pending and self.final_wait_s > 0:
            reason = not_final_reason(rec, self.final_wait_s)
            if self.strict:
                raise NotFinal(f"POST {self.url}/recommend: {reason}", rec, self.final_wait_s)
            return self._fallback(request, reason, may_not_fit=not rec.fits)
        return rec

    @staticmethod
    def _fallback(request: RecommendRequest, reason: str, may_not_fit: bool = False) -> FallbackRecommendation:
        """:func:`fallback_recommendation`, its warning logged (``memfit: the service gave no answer (...)``)."""
        fb = fallback_recommendation(request, reason, may_not_fit)
        log.warning("memfit: %s", fb.warnings[0])
        return fb

    def _recommend_once(self, body: dict[str, Any]) -> Recommendation:
        """One ``POST /recommend`` of ``body``.

        Raises:
            RequestRejected: a 4xx answer. ServiceError: no answer after the retries, or an unreadable one.
        """
        r = self._request("POST", "/recommend", json=body)
        if r.status_code >= 400:
            raise _rejected(r, "request")
        try:
            return Recommendation.model_validate(r.json())
        except (ValueError, ValidationError) as err:
            detail = _short(err) if isinstance(err, ValidationError) else str(err)
            raise ServiceError(f"POST {self.url}/recommend: unreadable answer: {detail}", r.status_code) from err

    def predict(self, request: PredictRequest | dict[str, Any]) -> PredictResponse:
        """``POST /predict`` for fully specified configurations (k included).

        Raises:
            ServiceError: no answer after retries. RequestRejected (a ``ValueError``): the service rejected
            the request (4xx).
        """
        if not isinstance(request, PredictRequest):
            request = PredictRequest.model_validate(request)
        r = self._request("POST", "/predict", json=request.model_dump(mode="json", exclude_none=True))
        if r.status_code >= 400:
            raise _rejected(r, "request")
        return PredictResponse.model_validate(r.json())

    def send_telemetry(self, records: list[Any]) -> dict[str, Any]:
        """``POST /telemetry``: records (``TelemetryRecord`` or dicts); returns ``{stored, duplicates, rejected}``.

        Raises:
            ServiceError: no answer after retries (status_code set for 5xx).
            PermissionError: 401 (token missing or wrong). RequestRejected (a ``ValueError``): other 4xx.
        """
        body = [r.model_dump(mode="json") if hasattr(r, "model_dump") else r for r in records]
        r = self._request("POST", "/telemetry", json=body)
        if r.status_code == 401:
            raise PermissionError(f"memfit service: {_detail(r)}")
        if r.status_code >= 400:
            raise _rejected(r, "telemetry")
        return r.json()

    def models(self) -> dict[str, Any]:
        """``GET /models``: registered versions, the current one and the one serving.

        Raises:
            ServiceError: no answer after retries.
        """
        r = self._request("GET", "/models")
        r.raise_for_status()
        return r.json()


def _detail(r: httpx.Response) -> str:
    try:
        j = r.json()
        return str(j.get("detail", j))[:500] if isinstance(j, dict) else str(j)[:500]
    except ValueError:
        return r.text[:500]


def _short(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in err.errors())[:500]
