"""One protocol for every way a curve is derived: the steps :meth:`model.curve.MemoryPredictor.curve` applies in order.

A request (:class:`Request`: spec, training, HF config) is answered by a chain of :class:`Derivation` objects
(the container pattern of torchtitan's ``ModelConvertersContainer``, ``torchtitan/protocols/model_converter.py``:
converters built once and applied in a fixed order, each deciding for itself whether it acts). Each step gets the
:class:`Draft` so far and returns the next one:

* a step that *composes* a request acts while nothing has answered it yet (``draft is None``): the offload,
  frozen-layer and ZeRO-1 steps answer from the curve of a base request (:mod:`model.offload`,
  :mod:`model.frozen`, :mod:`model.zero1`), the predictor's own sources from the traced terms, the traced terms
  of one micro-batch, the learned coefficients or the learned ratio model (:mod:`model.curve`); a composing step
  that cannot answer returns ``None`` and the next one tries;
* a step that *transforms* an answer acts on the draft a composing step made: DeepSpeed's stage-2 step and
  reduce bucket, stage 3's offload buffers (:mod:`model.deepspeed_zero`), gradient accumulation
  (:mod:`model.curve`).

The predictor turns the last draft into a :class:`model.curve.Curve` (envelope over k, floor, bound, breakdown).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from memfit.schema import ModelSpec, Sharding, TrainingConfig
from model.analytic import ModelStates

#: the two paths of a curve (:mod:`model.curve`): composed from traced terms, or answered before they exist
TRACED, PROVISIONAL = "traced", "provisional"


@dataclass(frozen=True)
class Request:
    """What a curve is asked for: the architecture with its parameter counts, the training (``checkpoint_layers``
    ignored) and the HF config the model is built from (None: no traced or meta-build facts)."""

    model: ModelSpec
    training: TrainingConfig
    hf_config: dict[str, Any] | None = None


@dataclass
class Draft:
    """A curve before its envelope, floor, bound and breakdown (bytes per device).

    Attributes:
        path: ``traced`` or ``provisional`` (:data:`model.curve.TRACED`); None until a source answered.
        raw: composed peak per k, float64 shape (L+1,); None until a source answered.
        phases: the peak's phase per k (None entries on the learned-ratio path).
        phase_bytes: every phase's live bytes, shape (L+1, len(PEAK_PHASES)); None without phases.
        states: the model states of the floor and the breakdown.
        terms_key, reason, notes, learned: as in :class:`model.curve.Curve`.
        composed_from: None for the request's own composition (the predictor adds its notes about the
            configuration and takes its margin group), else the name of the step that composed it from a base.
        margin_sharding: for a draft composed from a base, the sharding whose margin group the bound takes
            (with the base's path and learned flag).
        report_group: whether the curve reports its margin group (:attr:`model.curve.Curve.margin_group`).
        gradients_live: gradients held in every phase (gradient accumulation) for the breakdown.
        rank_model, stage_states, pipeline, period, accumulation_composed: the own composition's facts (one
            expert-parallel rank's spec, model states per pipeline stage, per-stage split, layer-type period of
            the terms, composed from one micro-batch's terms).
    """

    path: str | None = None
    raw: np.ndarray | None = None
    phases: list[str | None] | None = None
    phase_bytes: np.ndarray | None = None
    states: ModelStates | None = None
    terms_key: str | None = None
    reason: str | None = None
    notes: list[str] = field(default_factory=list)
    learned: bool = False
    composed_from: str | None = None
    margin_sharding: Sharding | None = None
    report_group: bool = True
    gradients_live: bool = False
    rank_model: ModelSpec | None = None
    stage_states: list[ModelStates] = field(default_factory=list)
    pipeline: Any = None
    period: int | None = None
    accumulation_composed: bool = False


class Derivation(Protocol):
    """One step of the chain (module docstring). ``predictor`` is the :class:`model.curve.MemoryPredictor`
    applying it: a step composing from a base asks ``predictor.curve`` for the base's whole curve."""

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None: ...


def peak_phases(phase_bytes: np.ndarray, names: tuple[str, ...] | list[str]) -> tuple[np.ndarray, list[str | None]]:
    """(peak bytes per k, the phase it falls in per k) of per-phase bytes of shape (L+1, len(names))."""
    return phase_bytes.max(axis=1), [names[i] for i in phase_bytes.argmax(axis=1)]
