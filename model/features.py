"""Feature matrix for the predictor: raw configuration fields plus analytic memory terms (bytes).

Input is a pandas DataFrame of flat telemetry rows (:meth:`memfit.schema.TelemetryRecord.to_row`
columns; extra columns are ignored). Output columns are :data:`FEATURE_NAMES`, in that order. The
model family's identity is deliberately *not* a feature (leave-architecture-out must generalise);
its structure is (gated MLP, GQA ratio, learned-dropout families, widths).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from memfit.schema import (
    Attention, CheckpointImpl, FineTune, ModelSpec, Optimizer, Precision, Sharding, TrainingConfig,
)
from model.analytic import GATED_MLP_FAMILIES, activation_dtype_bytes, analytic_estimate

CATEGORIES: dict[str, list[str]] = {
    "precision": [e.value for e in Precision],
    "optimizer": [e.value for e in Optimizer],
    "sharding": [e.value for e in Sharding],
    "attention": [e.value for e in Attention],
    "finetune": [e.value for e in FineTune],
    "checkpoint_impl": [e.value for e in CheckpointImpl],
}
RAW = ["num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
       "total_params", "trainable_params", "micro_batch_size", "seq_len", "data_parallel_size",
       "tensor_parallel_size", "lora_rank", "frozen_layers", "num_checkpointed_layers"]
ANALYTIC = ["weights_bytes", "gradients_bytes", "optimizer_bytes", "activation_layer_bytes", "activations_bytes",
            "checkpoint_inputs_bytes", "logits_bytes", "optimizer_temp_bytes", "backward_peak_bytes",
            "optimizer_peak_bytes", "analytic_peak_bytes"]
DERIVED = ["gated_mlp", "tied_embeddings", "gqa_ratio", "checkpoint_fraction", "tokens", "activation_dtype_bytes",
           "log_analytic_peak", "activation_share"]
FEATURE_NAMES: list[str] = RAW + list(CATEGORIES) + DERIVED + ANALYTIC
#: +1 / -1 monotone constraints in the log-ratio target (0 elsewhere): more checkpointed layers never
#: raise the peak, more tokens never lower it.
MONOTONE: dict[str, int] = {"num_checkpointed_layers": -1, "checkpoint_fraction": -1, "micro_batch_size": 1,
                            "seq_len": 1, "tokens": 1}


def _specs(row: dict) -> tuple[ModelSpec, TrainingConfig]:
    m = {k: row[k] for k in ModelSpec.model_fields if k in row and row[k] is not None}
    t = {k: row[k] for k in TrainingConfig.model_fields if k in row and row[k] is not None}
    t["checkpoint_layers"] = list(range(int(row["num_checkpointed_layers"])))
    t.pop("lora_target_modules", None)
    return ModelSpec.model_construct(**m), TrainingConfig.model_construct(**{
        **t, **{c: type(TrainingConfig.model_fields[c].default)(t[c]) for c in CATEGORIES if c in t}})


def build_features(rows: pd.DataFrame) -> pd.DataFrame:
    """Feature matrix (float64 + pandas categoricals) for flat telemetry rows.

    Raises:
        KeyError: a required column is missing (named in the message).
    """
    missing = [c for c in ["architecture", *RAW[:8], "micro_batch_size", "seq_len", "num_checkpointed_layers"]
               if c not in rows.columns]
    if missing:
        raise KeyError(f"telemetry rows lack columns {missing}")
    df = rows.copy()
    for col, default in (("tensor_parallel_size", 1), ("data_parallel_size", 1), ("lora_rank", 0),
                         ("frozen_layers", 0), ("tie_word_embeddings", False), ("precision", "amp_bf16"),
                         ("optimizer", "adamw_foreach"), ("sharding", "none"), ("attention", "sdpa"),
                         ("finetune", "full"), ("checkpoint_impl", "non_reentrant"), ("head_dim", None)):
        if col not in df.columns:
            df[col] = default
    df["lora_rank"] = df["lora_rank"].fillna(0)
    df["head_dim"] = df["head_dim"].astype(object).where(df["head_dim"].notna(), None)
    analytic = []
    for row in df.to_dict("records"):
        spec, training = _specs(row)
        e = analytic_estimate(spec, training)
        analytic.append([e.states.weights_bytes, e.states.gradients_bytes, e.states.optimizer_bytes,
                         e.activations_bytes // max(1, spec.num_layers - training.num_checkpointed_layers)
                         if spec.num_layers > training.num_checkpointed_layers else e.recompute_bytes,
                         e.activations_bytes, e.checkpoint_inputs_bytes, e.logits_bytes, e.optimizer_temp_bytes,
                         e.backward_peak_bytes, e.optimizer_peak_bytes, e.peak_bytes])
    out = pd.DataFrame(index=df.index)
    for c in RAW:
        out[c] = df[c].astype("float64")
    for c, cats in CATEGORIES.items():
        out[c] = pd.Categorical(df[c].astype(str), categories=cats)
    out["gated_mlp"] = df["architecture"].isin(GATED_MLP_FAMILIES).astype("float64")
    out["tied_embeddings"] = df["tie_word_embeddings"].astype(bool).astype("float64")
    out["gqa_ratio"] = out["num_attention_heads"] / out["num_key_value_heads"]
    out["checkpoint_fraction"] = out["num_checkpointed_layers"] / out["num_layers"]
    out["tokens"] = out["micro_batch_size"] * out["seq_len"]
    out["activation_dtype_bytes"] = [activation_dtype_bytes(Precision(p)) for p in df["precision"]]
    a = np.asarray(analytic, dtype="float64").reshape(len(df), len(ANALYTIC))
    for i, c in enumerate(ANALYTIC):
        out[c] = a[:, i]
    out["log_analytic_peak"] = np.log(out["analytic_peak_bytes"])
    out["activation_share"] = (out["activations_bytes"] + out["logits_bytes"]) / out["analytic_peak_bytes"]
    return out[FEATURE_NAMES]
