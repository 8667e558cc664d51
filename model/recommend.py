"""Recommendation: the smallest number k of checkpointed layers whose bounded total fits.

For one model and training configuration, the predictor is called once for all k = 0..L (one
booster call), giving the predicted allocated peak and its calibrated upper bound; the overhead
(:mod:`model.overhead`) is added to the bound; the answer is the smallest k whose bound fits
``capacity × (1 − headroom)``. Recompute cost: re-running the forward of k of L layers costs about
k/L of a forward pass, and a forward is about a third of a training step's compute (backward ≈ 2×
forward; Chen et al. 2016, arXiv 1604.06174, Sec. 4; Korthikanti et al. 2022, arXiv 2205.05198, Sec. 5),
so the overhead fraction is ``k / (3 L)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from memfit.schema import ModelSpec, TrainingConfig
from model.analytic import analytic_estimate
from model.estimator import PeakMemoryRegressor
from model.features import curve_matrix
from model.overhead import Overhead, OverheadModel


@dataclass(frozen=True)
class CurvePoint:
    k: int
    predicted_bytes: int  # predicted peak allocated bytes
    upper_bytes: int  # calibrated upper bound of allocated bytes
    total_upper_bytes: int  # upper bound + overhead: what must fit on the device


@dataclass
class Plan:
    """Answer for one configuration (bytes per device)."""

    fits: bool
    k: int | None
    layers: list[int]
    curve: list[CurvePoint]
    capacity_bytes: int
    usable_bytes: int
    overhead: Overhead
    breakdown: dict[str, int] = field(default_factory=dict)
    recompute_fraction: float = 0.0
    shortfall_bytes: int = 0


def layer_indices(k: int, num_layers: int, pipeline_parallel_size: int = 1, method: str = "block") -> list[int]:
    """Which layers to checkpoint: ``block`` = the first layers of each pipeline stage (Megatron's
    ``--recompute-method block``), ``even`` = evenly spaced over the model.

    Raises:
        ValueError: k outside [0, num_layers] or an unknown method.
    """
    if not 0 <= k <= num_layers:
        raise ValueError(f"k={k} must be in [0, {num_layers}]")
    if method == "even":
        return sorted({int(round(x)) for x in np.linspace(0, num_layers - 1, k)}) if k else []
    if method != "block":
        raise ValueError(f"method must be 'block' or 'even', got {method!r}")
    stages = max(1, pipeline_parallel_size)
    per_stage = num_layers // stages
    out: list[int] = []
    for s in range(stages):
        take = k // stages + (1 if s < k % stages else 0)
        out.extend(range(s * per_stage, s * per_stage + min(take, per_stage)))
    return sorted(out)


def curve_rows(model: ModelSpec, training: TrainingConfig) -> pd.DataFrame:
    """Flat feature rows for k = 0..L (what :class:`PeakMemoryRegressor` takes)."""
    base = {**model.model_dump(mode="json"), **training.model_dump(mode="json", exclude={"checkpoint_layers"})}
    return pd.DataFrame([{**base, "num_checkpointed_layers": k} for k in range(model.num_layers + 1)])


def plan(est: PeakMemoryRegressor, model: ModelSpec, training: TrainingConfig, *, capacity_bytes: int,
         headroom_fraction: float = 0.05, device_name: str | None = None, gpu_count: int = 1,
         overhead_model: OverheadModel | None = None, layout: str = "block") -> Plan:
    """Smallest k whose upper bound plus overhead fits ``capacity_bytes × (1 − headroom_fraction)``.

    Raises:
        ValueError: headroom outside [0, 0.9] or capacity <= 0.
    """
    if not 0 <= headroom_fraction <= 0.9:
        raise ValueError(f"headroom_fraction={headroom_fraction} must be in [0, 0.9]")
    if capacity_bytes <= 0:
        raise ValueError("capacity_bytes must be > 0")
    overhead_model = overhead_model or OverheadModel()
    base, ratio = est.predict_matrix(curve_matrix(model, training))
    # Checkpointing one more layer never needs more memory (up to a recompute transient the telemetry
    # tests bound): take the running max from the top, which only ever raises values (conservative).
    pred = np.maximum.accumulate(np.exp(base + ratio)[::-1])[::-1]
    upper = np.maximum.accumulate(np.exp(base + ratio + est.conformal_log_margin_)[::-1])[::-1]
    usable = int(capacity_bytes * (1 - headroom_fraction))
    curve = []
    for k, (p, u) in enumerate(zip(pred, upper)):
        ov = overhead_model.overhead(u, device_name, gpu_count)
        curve.append(CurvePoint(k, int(p), int(u), int(u) + ov.total_bytes))
    fitting = [c.k for c in curve if c.total_upper_bytes <= usable]
    k = fitting[0] if fitting else None
    at = curve[k if k is not None else model.num_layers]
    ov = overhead_model.overhead(at.upper_bytes, device_name, gpu_count)
    chosen = training.model_copy(update={"checkpoint_layers": list(range(at.k))})
    return Plan(
        fits=k is not None, k=k,
        layers=layer_indices(k, model.num_layers, training.pipeline_parallel_size, layout) if k is not None else [],
        curve=curve, capacity_bytes=capacity_bytes, usable_bytes=usable, overhead=ov,
        breakdown=breakdown(model, chosen, at.predicted_bytes),
        recompute_fraction=(k or 0) / (3 * model.num_layers),
        shortfall_bytes=0 if k is not None else at.total_upper_bytes - usable,
    )


def breakdown(model: ModelSpec, training: TrainingConfig, predicted_bytes: int) -> dict[str, int]:
    """Analytic parts of a predicted peak; ``other`` is what the prediction adds beyond them."""
    e = analytic_estimate(model, training)
    parts = {
        "parameters_bytes": e.states.weights_bytes,
        "gradients_bytes": e.states.gradients_bytes,
        "optimizer_states_bytes": e.states.optimizer_bytes,
        "activations_bytes": e.activations_bytes + e.checkpoint_inputs_bytes + e.recompute_bytes,
        "logits_bytes": e.logits_bytes,
    }
    parts["other_bytes"] = max(0, int(predicted_bytes) - sum(parts.values()))
    return parts
