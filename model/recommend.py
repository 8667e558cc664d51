"""Recommendation: the smallest number k of checkpointed layers whose bounded total fits.

For one model and training configuration, :meth:`model.curve.MemoryPredictor.curve` gives the
predicted allocated peak and its calibrated upper bound for all k = 0..L; the overhead
(:mod:`model.overhead`) is added to the bound; the answer is the smallest k whose bound fits
``capacity × (1 − headroom)``. Recompute cost: re-running the forward of k of L layers costs about
k/L of a forward pass, and a forward is about a third of a training step's compute (backward ≈ 2×
forward; Chen et al. 2016, arXiv 1604.06174, Sec. 4; Korthikanti et al. 2022, arXiv 2205.05198, Sec. 5),
so the overhead fraction is ``k / (3 L)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit.schema import ModelSpec, TrainingConfig
from model.curve import Curve, CurvePoint, MemoryPredictor
from model.overhead import Overhead, OverheadModel


@dataclass
class Plan:
    """Answer for one configuration (bytes per device).

    ``curve`` is the predictor's whole curve; ``total_upper_bytes[k]`` is its bound at k plus the
    overhead (CUDA context, cuBLAS, NCCL, fragmentation): what must fit in ``usable_bytes``.
    """

    fits: bool
    k: int | None
    layers: list[int]
    curve: Curve
    total_upper_bytes: list[int]
    capacity_bytes: int
    usable_bytes: int
    overhead: Overhead
    recompute_fraction: float = 0.0
    shortfall_bytes: int = 0

    @property
    def at(self) -> CurvePoint:
        """The curve point at the recommended k (at k = L when nothing fits)."""
        return self.curve.points[self.k if self.k is not None else len(self.curve.points) - 1]


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


def plan(predictor: MemoryPredictor, model: ModelSpec, training: TrainingConfig, *, capacity_bytes: int,
         hf_config: dict | None = None, headroom_fraction: float = 0.05, device_name: str | None = None,
         gpu_count: int = 1, overhead_model: OverheadModel | None = None, layout: str = "block") -> Plan:
    """Smallest k whose upper bound plus overhead fits ``capacity_bytes × (1 − headroom_fraction)``.

    The curve comes from :meth:`model.curve.MemoryPredictor.curve`, the one curve every caller uses.

    Raises:
        ValueError: headroom outside [0, 0.9] or capacity <= 0.
    """
    if not 0 <= headroom_fraction <= 0.9:
        raise ValueError(f"headroom_fraction={headroom_fraction} must be in [0, 0.9]")
    if capacity_bytes <= 0:
        raise ValueError("capacity_bytes must be > 0")
    overhead_model = overhead_model or OverheadModel()
    c = predictor.curve(model, training, hf_config)
    usable = int(capacity_bytes * (1 - headroom_fraction))
    totals = overhead_model.total_bytes([p.upper_bytes for p in c.points], device_name, gpu_count)
    k = next((i for i, t in enumerate(totals) if t <= usable), None)
    at = k if k is not None else model.num_layers
    if k is None:
        layers = []
    elif c.pipeline is not None:  # per-stage k chosen by the composition: the first k_i layers of stage i
        layers = [st.first_layer + j for st, ks in zip(c.pipeline.stages, c.pipeline.stage_k[k]) for j in range(ks)]
    else:
        layers = layer_indices(k, model.num_layers, training.pipeline_parallel_size, layout)
    return Plan(
        fits=k is not None, k=k,
        layers=layers,
        curve=c, total_upper_bytes=totals, capacity_bytes=capacity_bytes, usable_bytes=usable,
        overhead=overhead_model.overhead(c.points[at].upper_bytes, device_name, gpu_count),
        recompute_fraction=(k or 0) / (3 * model.num_layers),
        shortfall_bytes=0 if k is not None else totals[at] - usable,
    )
