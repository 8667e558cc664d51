"""Feature matrix for the predictor: raw configuration fields plus analytic memory terms (bytes).

Input is a pandas DataFrame of flat telemetry rows (:meth:`memfit.schema.TelemetryRecord.to_row`
columns; extra columns are ignored). Output columns are :data:`FEATURE_NAMES`, in that order. The
model family's identity is deliberately *not* a feature (leave-architecture-out must generalise);
its structure is (gated MLP, GQA ratio, learned-dropout families, widths).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from memfit.hf import attention_that_runs
from memfit.schema import (
    Attention,
    CheckpointImpl,
    FineTune,
    ModelSpec,
    Offload,
    Optimizer,
    PipelineSchedule,
    Precision,
    Quantization,
    Sharding,
    TrainingConfig,
)
from model.analytic import (
    GATED_MLP_FAMILIES,
    AnalyticEstimate,
    activation_bytes_per_layer,
    activation_dtype_bytes,
    analytic_estimate,
    analytic_estimates,
)

CATEGORIES: dict[str, list[str]] = {
    "precision": [e.value for e in Precision],
    "optimizer": [e.value for e in Optimizer],
    "sharding": [e.value for e in Sharding],
    "attention": [e.value for e in Attention],
    "finetune": [e.value for e in FineTune],
    "checkpoint_impl": [e.value for e in CheckpointImpl],
}
RAW = [
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "total_params",
    "trainable_params",
    "micro_batch_size",
    "seq_len",
    "data_parallel_size",
    "tensor_parallel_size",
    "lora_rank",
    "frozen_layers",
    "num_checkpointed_layers",
]
ANALYTIC = [
    "weights_bytes",
    "gradients_bytes",
    "optimizer_bytes",
    "activation_layer_bytes",
    "activations_bytes",
    "checkpoint_inputs_bytes",
    "logits_bytes",
    "optimizer_temp_bytes",
    "backward_peak_bytes",
    "optimizer_peak_bytes",
    "analytic_peak_bytes",
]
DERIVED = [
    "gated_mlp",
    "tied_embeddings",
    "gqa_ratio",
    "checkpoint_fraction",
    "tokens",
    "activation_dtype_bytes",
    "log_analytic_peak",
    "activation_share",
]
FEATURE_NAMES: list[str] = RAW + list(CATEGORIES) + DERIVED + ANALYTIC
#: +1 / -1 monotone constraints in the log-ratio target (0 elsewhere): more checkpointed layers never
#: raise the peak, more tokens never lower it.
MONOTONE: dict[str, int] = {
    "num_checkpointed_layers": -1,
    "checkpoint_fraction": -1,
    "micro_batch_size": 1,
    "seq_len": 1,
    "tokens": 1,
}


def row_specs(row: dict) -> tuple[ModelSpec, TrainingConfig]:
    """Model and training specs of one flat telemetry row (first k layers checkpointed); the row is
    trusted (validated on ingestion), so no pydantic validation runs here."""
    m = {k: row[k] for k in ModelSpec.model_fields if k in row and row[k] is not None}
    t = {k: row[k] for k in TrainingConfig.model_fields if k in row and row[k] is not None}
    if isinstance(t.get("lora_target_modules"), str):  # JSON text in flat rows
        t["lora_target_modules"] = json.loads(t["lora_target_modules"])
    for c, enum in _ENUMS.items():
        if c in t:
            t[c] = enum(t[c])
    t["checkpoint_layers"] = range(int(row["num_checkpointed_layers"]))
    return ModelSpec.model_construct(**m), TrainingConfig.model_construct(**t)


#: every enum field of TrainingConfig: model_construct keeps raw strings, and the analytic terms compare
#: by identity (``quantization is not Quantization.NONE``), so a flat row's "none" must become the member
_ENUMS = {
    "precision": Precision,
    "optimizer": Optimizer,
    "sharding": Sharding,
    "attention": Attention,
    "finetune": FineTune,
    "checkpoint_impl": CheckpointImpl,
    "quantization": Quantization,
    "offload_optimizer": Offload,
    "offload_parameters": Offload,
    "pipeline_schedule": PipelineSchedule,
}
_CODES = {c: {v: float(i) for i, v in enumerate(cats)} for c, cats in CATEGORIES.items()}
_TRAINING_DEFAULTS = {"tensor_parallel_size": 1, "data_parallel_size": 1, "lora_rank": 0, "frozen_layers": 0}


def feature_row(
    model: ModelSpec,
    training: TrainingConfig,
    estimate: AnalyticEstimate | None = None,
    per_layer: int | None = None,
    activation_bytes: int | None = None,
) -> list[float]:
    """One row of :data:`FEATURE_NAMES` (categoricals as their code in :data:`CATEGORIES`); ``estimate``,
    ``per_layer`` and ``activation_bytes``: the configuration's :func:`model.analytic.analytic_estimate`,
    :func:`model.analytic.activation_bytes_per_layer` and :func:`model.analytic.activation_dtype_bytes` where the
    caller has them already."""
    k = len(training.checkpoint_layers)
    L = model.num_layers
    raw = {
        "num_layers": L,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "intermediate_size": model.intermediate_size,
        "vocab_size": model.vocab_size,
        "total_params": model.total_params,
        "trainable_params": model.trainable_params,
        "micro_batch_size": training.micro_batch_size,
        "seq_len": training.seq_len,
        "data_parallel_size": training.data_parallel_size,
        "tensor_parallel_size": training.tensor_parallel_size,
        "lora_rank": training.lora_rank or 0,
        "frozen_layers": training.frozen_layers,
        "num_checkpointed_layers": k,
    }
    cats = {c: _CODES[c][getattr(training, c).value] for c in CATEGORIES}
    cats["attention"] = _CODES["attention"][attention_that_runs(model.architecture, training.attention).value]
    e = analytic_estimate(model, training) if estimate is None else estimate
    per_layer = activation_bytes_per_layer(model, training) if per_layer is None else per_layer
    analytic = {
        "weights_bytes": e.states.weights_bytes,
        "gradients_bytes": e.states.gradients_bytes,
        "optimizer_bytes": e.states.optimizer_bytes,
        "activation_layer_bytes": per_layer,
        "activations_bytes": e.activations_bytes,
        "checkpoint_inputs_bytes": e.checkpoint_inputs_bytes,
        "logits_bytes": e.logits_bytes,
        "optimizer_temp_bytes": e.optimizer_temp_bytes,
        "backward_peak_bytes": e.backward_peak_bytes,
        "optimizer_peak_bytes": e.optimizer_peak_bytes,
        "analytic_peak_bytes": e.peak_bytes,
    }
    derived = {
        "gated_mlp": float(model.architecture in GATED_MLP_FAMILIES),
        "tied_embeddings": float(model.tie_word_embeddings),
        "gqa_ratio": model.num_attention_heads / model.num_key_value_heads,
        "checkpoint_fraction": k / L,
        "tokens": training.micro_batch_size * training.seq_len,
        "activation_dtype_bytes": activation_dtype_bytes(training.precision)
        if activation_bytes is None
        else activation_bytes,
        "log_analytic_peak": math.log(e.peak_bytes),
        "activation_share": (e.activations_bytes + e.logits_bytes) / e.peak_bytes,
    }
    row = {**raw, **cats, **analytic, **derived}
    return [float(row[c]) for c in FEATURE_NAMES]


def curve_matrix(model: ModelSpec, training: TrainingConfig) -> np.ndarray:
    """Features for k = 0..L (first k layers checkpointed), shape ``(L + 1, len(FEATURE_NAMES))``; the analytic
    estimates of every k in one :func:`model.analytic.analytic_estimates` call."""
    estimates = analytic_estimates(model, training)
    per_layer = activation_bytes_per_layer(model, training)
    activation_bytes = activation_dtype_bytes(training.precision)
    return np.array(
        [
            feature_row(
                model,
                training.model_construct(**{**training.__dict__, "checkpoint_layers": range(k)}),
                estimates[k],
                per_layer,
                activation_bytes,
            )
            for k in range(model.num_layers + 1)
        ]
    )


def accumulation_mask(rows: pd.DataFrame) -> np.ndarray:
    """1.0 for flat telemetry rows measured under gradient accumulation with the gradients on the device
    (:attr:`memfit.schema.TrainingConfig.accumulates_gradients`), else 0.0; shape (len(rows),). Rows from before
    the ``gradient_accumulation_steps`` column count as one micro-batch per step."""
    if "gradient_accumulation_steps" not in rows.columns:
        return np.zeros(len(rows))
    ga = pd.to_numeric(rows["gradient_accumulation_steps"], errors="coerce").fillna(1).to_numpy()
    off = (
        rows["offload_optimizer"].fillna("none").astype(str).to_numpy()
        if "offload_optimizer" in rows.columns
        else np.full(len(rows), "none")
    )
    return ((ga > 1) & (off == "none")).astype(np.float64)


def build_features(rows: pd.DataFrame) -> pd.DataFrame:
    """Feature matrix (float64, categoricals as pandas categoricals) for flat telemetry rows.

    Raises:
        KeyError: a required column is missing (named in the message).
    """
    need = ["architecture", *RAW[:8], "micro_batch_size", "seq_len", "num_checkpointed_layers"]
    missing = [c for c in need if c not in rows.columns]
    if missing:
        raise KeyError(f"telemetry rows lack columns {missing}")
    records = rows.to_dict("records")
    matrix = np.array(
        [
            feature_row(
                *row_specs(
                    {
                        **_TRAINING_DEFAULTS,
                        **{k: v for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))},
                    }
                )
            )
            for r in records
        ]
    ).reshape(len(records), len(FEATURE_NAMES))
    out = pd.DataFrame(matrix, columns=FEATURE_NAMES, index=rows.index)
    for c, cats in CATEGORIES.items():
        out[c] = pd.Categorical.from_codes(out[c].astype(int), categories=cats)
    return out
