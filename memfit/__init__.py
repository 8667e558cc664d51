"""memfit: fit LLM training into GPU memory with the least activation recomputation.

    import memfit
    rec = memfit.Client("http://memfit:8000").recommend(memfit.describe(model, seq_len=4096, gpu="H100-80GB"))
    plan = memfit.apply(model, rec)          # checkpoint exactly rec.layers
    ...                                      # first training step
    memfit.verify(plan)                      # exactly those layers recomputed?

A recommendation is read once into a :class:`CheckpointPlan`, which ``apply``, the DeepSpeed patch
(:mod:`memfit.integrations.deepspeed`) and the Megatron-Core settings (:mod:`memfit.integrations.megatron`)
all take. The core needs only httpx and pydantic; torch, transformers, peft and deepspeed are imported
when used.
HF Trainer callbacks (``MemfitTrainerCallback``, ``MemfitReporterCallback``) load transformers on first access.
"""

from __future__ import annotations

from typing import Any

from memfit.alloc_conf import alloc_conf_from_env, use_expandable_segments
from memfit.api import Recommendation, RecommendRequest
from memfit.checkpointing import AppliedCheckpointing, CheckpointPlan, MemfitWarning, apply, checkpoint_layers, verify
from memfit.client import Client, FallbackRecommendation, NotFinal, RequestRejected, ServiceError, is_fallback
from memfit.describe import describe
from memfit.reporter import flush_spool, report_peak

__all__ = [
    "AppliedCheckpointing",
    "CheckpointPlan",
    "Client",
    "FallbackRecommendation",
    "MemfitReporterCallback",
    "MemfitTrainerCallback",
    "MemfitWarning",
    "NotFinal",
    "RecommendRequest",
    "Recommendation",
    "RequestRejected",
    "ServiceError",
    "alloc_conf_from_env",
    "apply",
    "checkpoint_layers",
    "describe",
    "flush_spool",
    "is_fallback",
    "report_peak",
    "use_expandable_segments",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name in ("MemfitTrainerCallback", "MemfitReporterCallback"):
        from memfit.integrations import hf

        return getattr(hf, name)
    if name == "apply_activation_checkpointing":  # the earlier name of checkpoint_layers
        from memfit import checkpointing

        return checkpointing.apply_activation_checkpointing
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
