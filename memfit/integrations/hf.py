"""HF ``Trainer`` integration (needs transformers).

The Trainer turns activation checkpointing on inside ``train()`` (``activation_checkpointing`` /
``gradient_checkpointing`` argument) and overwrites any per-layer choice made before. So
:class:`MemfitTrainerCallback` applies the plan at ``on_train_begin`` — after the Trainer did — and
verifies after the first optimizer step that exactly the planned layers recomputed::

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[MemfitTrainerCallback(rec)])
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from memfit.checkpointing import AppliedCheckpointing, apply, verify

log = logging.getLogger("memfit")


def _use_reentrant(args: Any) -> bool:
    kw = (
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    return bool(kw.get("use_reentrant", False)) if isinstance(kw, dict) else False


class MemfitTrainerCallback(TrainerCallback):
    """Apply a recommendation at ``on_train_begin`` and verify it after the first step.

    Args:
        recommendation: :class:`memfit.api.Recommendation` (or a list of layer indices).
        strict: raise instead of warning (see :func:`memfit.apply` / :func:`memfit.verify`).
        use_reentrant: checkpoint flavour; default from the TrainingArguments'
            ``activation_checkpointing_kwargs``/``gradient_checkpointing_kwargs``, else non-reentrant.

    Attributes:
        plan: the :class:`AppliedCheckpointing` once training began.
        verified: result of the verification after the first step (None before).
    """

    def __init__(
        self,
        recommendation: Any,
        *,
        strict: bool = False,
        use_reentrant: bool | None = None,
        deepspeed_config: dict[str, Any] | None = None,
    ) -> None:
        self.recommendation, self.strict, self.use_reentrant = recommendation, strict, use_reentrant
        self.deepspeed_config = deepspeed_config
        self.plan: AppliedCheckpointing | None = None
        self.verified: bool | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            log.warning("memfit: Trainer passed no model to on_train_begin; checkpointing plan not applied")
            return
        reentrant = self.use_reentrant if self.use_reentrant is not None else _use_reentrant(args)
        self.plan = apply(
            model,
            self.recommendation,
            strict=self.strict,
            use_reentrant=reentrant,
            deepspeed_config=self.deepspeed_config,
        )
        self.verified = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.plan is not None and self.verified is None:
            self.verified = verify(self.plan, strict=self.strict)


class MemfitReporterCallback(TrainerCallback):
    """Report the peak memory of the first ``steps`` steps to the service (see :mod:`memfit.reporter`).

    On CUDA the peak statistics are reset at ``on_train_begin`` and read after step ``steps``; on CPU
    ``peak_fn()`` (a caller's tensor-tracker value, bytes) is used, else the report is skipped with a
    log line. Never raises into training.

    Args:
        client_or_url: :class:`memfit.client.Client` or the service URL (with ``token``).
        plan: :class:`AppliedCheckpointing`, a :class:`MemfitTrainerCallback` (its plan once training
            began) or the Recommendation.
        steps: report after this many optimizer steps (>= 1).
        seq_len: tokens per sequence (needed to describe the job unless ``request`` is given).
        request: the job's :class:`RecommendRequest`; default ``memfit.describe(model, seq_len=...,
            training_args=args, **describe_kwargs)``.
        peak_fn: ``() -> int | None`` measured peak bytes (CPU runs).
        spool_path: JSONL spool for unsendable records.
        all_ranks: report from every process (per-device peaks differ, e.g. pipeline stages);
            default only the world's process zero reports.

    Attributes:
        result: the :class:`memfit.reporter.ReportResult` once reported.
    """

    def __init__(
        self,
        client_or_url: Any,
        plan: Any = None,
        *,
        steps: int = 2,
        seq_len: int | None = None,
        request: Any = None,
        peak_fn: Any = None,
        spool_path: Any = None,
        token: str | None = None,
        all_ranks: bool = False,
        **describe_kwargs: Any,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps={steps} must be >= 1")
        self.client_or_url, self.plan, self.steps, self.seq_len = client_or_url, plan, steps, seq_len
        self.request, self.peak_fn, self.spool_path, self.token = request, peak_fn, spool_path, token
        self.describe_kwargs, self.all_ranks = describe_kwargs, all_ranks
        self.result = None
        self._t0: float | None = None
        self._times: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        self.result, self._times = None, []

    def on_step_begin(self, args, state, control, **kwargs):
        import time

        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        import time

        from memfit.reporter import ReportResult, _log_once, report_peak

        if self.result is not None:
            return
        if self._t0 is not None:
            self._times.append(time.perf_counter() - self._t0)
        if state.global_step < self.steps:
            return
        if not self.all_ranks and not getattr(state, "is_world_process_zero", True):
            self.result = ReportResult("skipped", None, "not the world's process zero")
            return
        try:
            plan = self.plan.plan if isinstance(self.plan, MemfitTrainerCallback) else self.plan
            peak = self.peak_fn() if self.peak_fn is not None else None
            kw = dict(self.describe_kwargs)
            if self.request is None:
                kw.update(seq_len=self.seq_len, training_args=args)
            self.result = report_peak(
                self.client_or_url,
                model,
                plan,
                request=self.request,
                steps=self.steps,
                peak_allocated_bytes=peak,
                step_time_s=min(self._times) if self._times else None,
                spool_path=self.spool_path,
                token=self.token,
                **kw,
            )
        except Exception as err:  # noqa: BLE001 - never break training
            _log_once("callback-error", "memfit: telemetry callback failed: %s: %s", type(err).__name__, err)
            self.result = ReportResult("error", None, f"{type(err).__name__}: {err}")
