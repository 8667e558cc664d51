"""Report a user job's measured peak memory back to the service, so the predictor learns from it.

After the first N training steps, :func:`report_peak` reads the peak (CUDA:
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of the current device, method ``cuda``;
CPU: only a value measured by the caller and passed in as ``peak_allocated_bytes``, method
``cpu_tracker`` — process RSS is not a tensor peak, so without a value the report is skipped) and
sends it with the model, the configuration and the applied checkpoint layers as one
:class:`memfit.schema.TelemetryRecord` (``source=user_job``) to ``POST /telemetry``.

When the service is unreachable the record is appended to a JSONL spool (default
``~/.cache/memfit/spool.jsonl``, or ``$MEMFIT_SPOOL``); :func:`flush_spool` sends it later.
Nothing here raises into the training loop: every failure is logged once and returned as a status.

``MemfitReporterCallback`` (HF ``Trainer``) lives in :mod:`memfit.integrations.hf` (``memfit.MemfitReporterCallback``).
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from memfit.api import RecommendRequest, request_hf_config
from memfit.client import Client, RequestRejected, ServiceError
from memfit.errors import invalid_from_validation
from memfit.schema import (
    DEFAULT_LORA_RANK,
    CheckpointImpl,
    ClusterSpec,
    FineTune,
    Measurement,
    Method,
    ModelSpec,
    Source,
    TelemetryRecord,
    TrainingConfig,
    default_data_parallel_size,
)

log = logging.getLogger("memfit")
_logged: set[str] = set()


def default_spool_path() -> Path:
    """``$MEMFIT_SPOOL`` or ``~/.cache/memfit/spool.jsonl``."""
    return Path(os.environ.get("MEMFIT_SPOOL") or "~/.cache/memfit/spool.jsonl").expanduser()


def _log_once(key: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


@dataclass
class ReportResult:
    """Outcome of :func:`report_peak`.

    Attributes:
        status: ``sent``, ``duplicate``, ``spooled``, ``quarantined`` (kept apart by the service, never trained on),
            ``rejected``, ``skipped`` or ``error``.
        record: the record built (None when skipped before building, or on error).
        detail: the service's answer or the reason.
    """

    status: str
    record: TelemetryRecord | None = None
    detail: str = ""


def _client(client_or_url: Client | str, token: str | None) -> Client:
    return client_or_url if isinstance(client_or_url, Client) else Client(client_or_url, token=token)


def _versions() -> dict[str, str | None]:
    out = {}
    for name in ("torch", "transformers", "deepspeed"):
        mod = sys.modules.get(name)
        out[f"{name}_version"] = getattr(mod, "__version__", None) if mod is not None else None
    return out


def _model_spec(model: Any, request: RecommendRequest, model_name: str | None) -> ModelSpec:
    from memfit.describe import detect_architecture, hf_config_dict, parameter_counts
    from memfit.hf import spec_fields_from_hf_config

    arch = request.model
    if isinstance(arch, str):
        model_name = model_name or arch
        arch = hf_config_dict(model) or detect_architecture(model)
    cfg = request_hf_config(arch)
    total, trainable = parameter_counts(model)
    return ModelSpec(
        **spec_fields_from_hf_config(cfg), model_name=model_name, total_params=total, trainable_params=trainable
    )


def _lora_targets(model: Any) -> list[str] | None:
    cfgs = getattr(model, "peft_config", None)
    if not isinstance(cfgs, dict) or not cfgs:
        return None
    targets = getattr(next(iter(cfgs.values())), "target_modules", None)
    return sorted(targets) if isinstance(targets, (set, list, tuple)) else None


def build_record(
    model: Any,
    plan: Any,
    request: RecommendRequest,
    *,
    peak_allocated_bytes: int,
    method: Method,
    peak_reserved_bytes: int | None = None,
    step_time_s: float | None = None,
    device_name: str = "cpu",
    device_memory_bytes: int | None = None,
    model_name: str | None = None,
    pipeline_stage: int | None = None,
) -> TelemetryRecord:
    """The :class:`TelemetryRecord` of a user job (``source=user_job``).

    Args:
        model: the live model (architecture from its HF config or modules; counts from its parameters).
        plan: :class:`memfit.checkpointing.AppliedCheckpointing` (layers and recomputed count), a
            :class:`memfit.api.Recommendation` or :class:`memfit.checkpointing.CheckpointPlan` (the layers
            :func:`memfit.apply` checkpoints for it: every layer for the fallback or "nothing fits"), a list of
            layer indices, or None (read from the live model's layers).
        request: the job's configuration (:func:`memfit.describe`).
        peak_allocated_bytes / peak_reserved_bytes: measured peak per device, bytes.
        pipeline_stage: the measured device's pipeline stage (0-based; pipeline parallel jobs, whose stages peak
            differently); default: Megatron's pipeline rank where ``megatron.core`` runs initialised, else None.
        device_memory_bytes: total memory of the device; default the request's capacity.

    Raises:
        InvalidConfiguration (a ValueError): the pieces do not form a valid record (one line naming the field).
        ValueError: no plan and the model's layers do not show which are checkpointed; a layer index out of range.
    """
    t = request.training
    gpus = request.cluster.gpu_count
    dp = default_data_parallel_size(
        gpus, t.tensor_parallel_size, t.pipeline_parallel_size, t.context_parallel_size, t.data_parallel_size
    )
    spec = _model_spec(model, request, model_name or getattr(plan, "model_name", None))
    layers = _checkpointed(model, plan, spec.num_layers)
    fields = t.model_dump(exclude={"trainable_params", "data_parallel_size"})
    fields["quantization"] = t.resolved_quantization()
    if t.finetune is FineTune.LORA:
        fields["lora_rank"] = t.lora_rank or DEFAULT_LORA_RANK
        fields["lora_target_modules"] = _lora_targets(model)
    if getattr(plan, "use_reentrant", None) is not None:
        fields["checkpoint_impl"] = CheckpointImpl.REENTRANT if plan.use_reentrant else CheckpointImpl.NON_REENTRANT
    try:  # one line naming the field (report_peak returns it as the result's detail), not pydantic's dump
        training = TrainingConfig(**fields, data_parallel_size=dp, checkpoint_layers=layers)
        cluster = ClusterSpec(
            device_name=device_name,
            device_memory_bytes=device_memory_bytes or request.cluster.memory_bytes,
            gpu_count=gpus,
            **_versions(),
        )
        recomputed = getattr(plan, "recomputed", None)
        measurement = Measurement(
            peak_allocated_bytes=int(peak_allocated_bytes),
            method=method,
            source=Source.USER_JOB,
            peak_reserved_bytes=peak_reserved_bytes if method is Method.CUDA else None,
            step_time_s=step_time_s,
            recomputed_layers=len(recomputed) if recomputed is not None else None,
            pipeline_stage=pipeline_stage if pipeline_stage is not None else _megatron_pipeline_rank(t),
        )
        return TelemetryRecord(model=spec, training=training, cluster=cluster, measurement=measurement)
    except ValidationError as err:
        raise invalid_from_validation(err) from None


def _megatron_pipeline_rank(training: TrainingConfig) -> int | None:
    """This process's pipeline stage from ``megatron.core.parallel_state`` where the job is pipelined and Megatron's
    model parallel groups are initialised (``get_pipeline_model_parallel_rank``), else None. Megatron is not
    imported here: only a job that already runs it has the groups."""
    core = sys.modules.get("megatron.core.parallel_state")
    if training.pipeline_parallel_size < 2 or core is None or not core.model_parallel_is_initialized():
        return None
    return int(core.get_pipeline_model_parallel_rank())


def _checkpointed(model: Any, plan: Any, num_layers: int) -> list[int]:
    """The layers a report says were checkpointed: the applied plan's, a plan's or recommendation's as
    :func:`memfit.apply` carries it out (every layer for the client's fallback or a "nothing fits" answer), else
    (no plan) what the live model's layers show (:func:`memfit.checkpointing.checkpointed_layers`).

    Raises:
        ValueError: no plan and the model's layers do not show which are checkpointed; an index out of range.
    """
    from memfit.checkpointing import AppliedCheckpointing, CheckpointPlan, checkpointed_layers

    if isinstance(plan, AppliedCheckpointing):
        return list(plan.layer_indices)
    if plan is None:
        found = checkpointed_layers(model)
        if found is None:
            raise ValueError(
                "plan: none given, and the model's layers do not show which are checkpointed (no per-layer "
                "gradient_checkpointing flags or checkpoint wrappers): pass what memfit.apply returned, or the "
                "checkpointed layer indices"
            )
        return found
    return CheckpointPlan.from_recommendation(plan, num_layers=num_layers).indices(num_layers)


def _measure_cuda() -> dict[str, Any] | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(dev)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(dev)),
        "method": Method.CUDA,
        "device_name": props.name,
        "device_memory_bytes": int(props.total_memory),
    }


def _append_lines(path: Path, text: str) -> None:
    """Append ``text`` (whole lines, newline-terminated) to ``path``, first ending a torn last line (a crash mid-write)
    so that the new lines are read on their own and only the torn fragment is quarantined."""
    with path.open("a+b") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(text.encode("utf-8"))


def spool(record: TelemetryRecord, path: str | Path | None = None) -> Path:
    """Append one record to the JSONL spool; returns its path.

    Raises:
        OSError: the spool cannot be written.
    """
    p = Path(path) if path is not None else default_spool_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    _append_lines(p, record.model_dump_json() + "\n")
    return p


def send_or_spool(client: Client, record: TelemetryRecord, spool_path: str | Path | None = None) -> ReportResult:
    """POST one record. Never raises, and never drops the record without the service's verdict on it: it is spooled
    (:func:`flush_spool` sends it later) unless the service stored it, already had it, quarantined it (kept apart,
    its reason in the result) or refused it as invalid (HTTP 422, or its ``rejected`` list). An unreachable
    service, a refused token, any other 4xx (a wrong URL path: 404; 413), an answer that is not the ingest
    answer (a proxy's HTML page) or one that names no verdict for the record: spooled."""
    try:
        ans = client.send_telemetry([record])
    except RequestRejected as err:
        if err.status_code == 422:
            _log_once("rejected", "memfit: telemetry rejected by the service: %s", err)
            return ReportResult("rejected", record, str(err))
        return _spool_one(record, spool_path, str(err))
    except (ServiceError, PermissionError) as err:
        return _spool_one(record, spool_path, str(err))
    except Exception as err:  # noqa: BLE001 - never break training (an unreadable answer: not JSON)
        return _spool_one(record, spool_path, f"unreadable answer: {type(err).__name__}: {err}")
    if not isinstance(ans, dict):
        return _spool_one(record, spool_path, f"unreadable answer: {type(ans).__name__}, not the ingest answer")
    rid = record.record_id
    if rid in ans.get("stored", []):
        log.info("memfit: telemetry %s stored (peak %d bytes)", rid, record.measurement.peak_allocated_bytes)
        return ReportResult("sent", record, json.dumps(ans))
    if rid in ans.get("duplicates", []):
        return ReportResult("duplicate", record, json.dumps(ans))
    for status in ("quarantined", "rejected"):
        mine = [
            r for r in ans.get(status, []) if isinstance(r, dict) and (r.get("record_id") == rid or r.get("index") == 0)
        ]
        if mine:
            reason = "; ".join(str(r.get("reason")) for r in mine)
            _log_once(status, "memfit: telemetry %s by the service: %s", status, reason)
            return ReportResult(status, record, reason)
    return _spool_one(
        record, spool_path, f"the service's answer names no verdict for record {rid}: {json.dumps(ans)[:200]}"
    )


def _spool_one(record: TelemetryRecord, spool_path: str | Path | None, why: str) -> ReportResult:
    """Spool ``record`` because it was not sent (``why``); ``error`` only when the spool cannot be written."""
    try:
        where = spool(record, spool_path)
    except OSError as io_err:
        _log_once("spool-failed", "memfit: telemetry not sent (%s) and not spooled (%s)", why, io_err)
        return ReportResult("error", record, f"{why}; spool failed: {io_err}")
    _log_once(
        "spooled", "memfit: telemetry not sent (%s); spooled to %s (memfit.reporter.flush_spool later)", why, where
    )
    return ReportResult("spooled", record, why)


def report_peak(
    client_or_url: Client | str,
    model: Any,
    plan: Any,
    *,
    request: RecommendRequest | None = None,
    steps: int = 2,
    peak_allocated_bytes: int | None = None,
    step_time_s: float | None = None,
    spool_path: str | Path | None = None,
    token: str | None = None,
    model_name: str | None = None,
    pipeline_stage: int | None = None,
    **describe_kwargs: Any,
) -> ReportResult:
    """Send the peak of the first ``steps`` training steps as telemetry. Never raises.

    Call it after those steps. On CUDA the peak is ``torch.cuda.max_memory_allocated`` since the
    last ``torch.cuda.reset_peak_memory_stats()`` (call that before step 1, or it is the process
    peak). On CPU pass ``peak_allocated_bytes`` measured by a tensor tracker; without it the report
    is skipped (logged).

    Args:
        client_or_url: :class:`memfit.client.Client` or the service URL (with ``token``).
        model: the live model. plan: :class:`AppliedCheckpointing` (preferred) or the Recommendation.
        request: the job's configuration; default ``memfit.describe(model, **describe_kwargs)``.
        steps: how many steps the peak covers (informational; the record holds one peak).
        step_time_s: wall time of one step, seconds, if measured.
        spool_path: JSONL spool for records that could not be sent.
        pipeline_stage: as :func:`build_record` takes it.

    Returns:
        :class:`ReportResult` (``status`` says what happened).
    """
    try:
        if request is None:
            from memfit.describe import describe

            request = describe(model, **describe_kwargs)
        if peak_allocated_bytes is None:
            measured = _measure_cuda()
            if measured is None:
                _log_once(
                    "no-peak",
                    "memfit: no CUDA device and no measured peak_allocated_bytes given: telemetry report skipped",
                    level=logging.INFO,
                )
                return ReportResult("skipped", None, "no CUDA peak and no measured value")
        else:
            if isinstance(peak_allocated_bytes, bool) or not isinstance(peak_allocated_bytes, numbers.Integral):
                why = f"peak_allocated_bytes: must be an integer number of bytes, got {peak_allocated_bytes!r:.40}"
                _log_once("bad-peak", "memfit: telemetry not sent: %s", why)
                return ReportResult("error", None, why)
            measured = {
                "peak_allocated_bytes": int(peak_allocated_bytes),
                "method": Method.CPU_TRACKER,
                "device_name": "cpu",
                "device_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            }
            cuda = _measure_cuda()
            if cuda is not None:  # a caller-measured peak on a GPU job: keep it, with the device's identity
                measured.update(
                    method=Method.CUDA, device_name=cuda["device_name"], device_memory_bytes=cuda["device_memory_bytes"]
                )
        record = build_record(
            model,
            plan,
            request,
            step_time_s=step_time_s,
            model_name=model_name,
            pipeline_stage=pipeline_stage,
            **measured,
        )
        log.debug(
            "memfit: reporting the peak of the first %d steps: %d bytes", steps, record.measurement.peak_allocated_bytes
        )
        return send_or_spool(_client(client_or_url, token), record, spool_path)
    except Exception as err:  # noqa: BLE001 - never break training
        _log_once("report-error", "memfit: telemetry report failed: %s: %s", type(err).__name__, err)
        return ReportResult("error", None, f"{type(err).__name__}: {err}")


def quarantine_path(spool_path: str | Path | None = None) -> Path:
    """Where unsendable spool lines go: ``<spool>.quarantine`` (JSONL, one ``{reason, line}`` per line)."""
    p = Path(spool_path) if spool_path is not None else default_spool_path()
    return p.with_suffix(p.suffix + ".quarantine")


def _quarantine(spool_path: Path, items: list[tuple[str, str]]) -> None:
    _append_lines(quarantine_path(spool_path), "".join(json.dumps({"reason": r, "line": ln}) + "\n" for r, ln in items))


def flush_spool(
    client_or_url: Client | str, spool_path: str | Path | None = None, *, token: str | None = None, batch: int = 500
) -> int:
    """Send spooled records; returns how many the service took (stored or duplicate). Never raises.

    The spool is moved aside first, so records appended meanwhile are kept. Each line is read on its
    own: a torn or malformed line (a crash mid-write) and records the service rejects go to
    :func:`quarantine_path` with the reason, and never block the good records. Records still
    unsendable (service down) go back to the spool. Nothing is lost.
    """
    p = Path(spool_path) if spool_path is not None else default_spool_path()
    work = p.with_suffix(p.suffix + ".flushing")
    try:
        if p.exists():
            if work.exists():  # a previous flush was interrupted: merge
                text = p.read_text(encoding="utf-8", errors="replace")
                _append_lines(work, text if text.endswith("\n") or not text else text + "\n")
                p.unlink()
            else:
                p.rename(work)
        if not work.exists():
            return 0
        lines = [ln for ln in work.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError as err:
        _log_once("flush-io", "memfit: cannot read the spool %s: %s", p, err)
        return 0
    records, held = [], []
    for ln in lines:
        try:
            rec = json.loads(ln)
        except ValueError as err:
            held.append((f"not JSON (torn write?): {err}", ln))
            continue
        if isinstance(rec, dict):
            records.append((ln, rec))
        else:
            held.append((f"not a record object: {type(rec).__name__}", ln))
    client = _client(client_or_url, token)
    sent, keep = 0, []
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        try:
            ans = client.send_telemetry([rec for _ln, rec in chunk])
        except (ServiceError, PermissionError) as err:
            log.info("memfit: spool flush stopped: %s", err)
            keep.extend(ln for ln, _rec in records[start:])
            break
        except Exception as err:  # noqa: BLE001 - anything else: keep the lines for the next flush, stop
            _log_once("flush-error", "memfit: spool flush failed: %s: %s", type(err).__name__, err)
            keep.extend(ln for ln, _rec in records[start:])
            break
        if not isinstance(ans, dict):
            _log_once("flush-error", "memfit: spool flush stopped: the answer is not the ingest answer")
            keep.extend(ln for ln, _rec in records[start:])
            break
        taken = set(ans.get("stored", [])) | set(ans.get("duplicates", []))
        judged = set()
        for r in list(ans.get("rejected", [])) + list(ans.get("quarantined", [])):
            i = r.get("index") if isinstance(r, dict) else None
            if isinstance(i, int) and 0 <= i < len(chunk) and i not in judged:
                judged.add(i)
                held.append((f"service: {r.get('reason')}", chunk[i][0]))
        for i, (ln, rec) in enumerate(chunk):
            if rec.get("record_id") in taken:
                sent += 1
            elif i not in judged:  # no verdict on it in the answer: sent again by the next flush
                keep.append(ln)
    try:
        if held:
            _quarantine(p, held)
            _log_once(
                "flush-quarantined",
                "memfit: %d spooled line(s) could not be sent; kept in %s",
                len(held),
                quarantine_path(p),
            )
        if keep:
            _append_lines(p, "\n".join(keep) + "\n")
        work.unlink()
    except OSError as err:
        _log_once("flush-io", "memfit: cannot rewrite the spool %s: %s", p, err)
    log.info("memfit: flushed %d spooled record(s), %d kept, %d quarantined", sent, len(keep), len(held))
    return sent
