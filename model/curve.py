"""The one memory curve: peak, bound, breakdown and peak phase for every k, for every caller.

``/predict``, ``/recommend``, the CLI, evaluation and the report all call
:meth:`MemoryPredictor.curve`. Two paths produce it:

* **traced**: the configuration's per-phase terms are in the :class:`model.terms.TermsCache` (shipped
  for the catalog, or traced once for a new config); the peak over k is composed by
  :func:`model.compose.compose_terms` (0.04 % MAPE in ``shared/design/peak-composition.md``);
* **provisional**: no terms yet (a never-seen config whose trace is pending, or a setup the tracer
  does not cover — see :func:`model.terms.not_traceable_reason`), and the answer says so. Where the
  :class:`model.coefficients.CoefficientModel` covers the configuration, it predicts the per-phase
  terms and :func:`model.compose.compose` composes them as on the traced path (margin group
  ``provisional_coefficients``); otherwise the LightGBM :class:`model.estimator.PeakMemoryRegressor`
  answers from the log-ratio to the analytic estimate.

Every curve is shaped the same way, by construction:

* **monotone in micro-batch and sequence length** (traced path, pipeline/context parallel aside): each phase
  is composed as its max over all smaller micro-batches and sequence lengths
  (:func:`model.compose.token_envelope`), equal to the plain composition where that already grows;
* **monotone in k**: the point at k is the max over k' ≥ k of the path's raw values (checkpointing
  more layers can only be answered with at most the memory of fewer; a rise from a recompute
  transient is carried down to smaller k, which is conservative);
* **never below the model-state floor**: weights + gradients + optimizer states
  (:func:`model.analytic.model_state_bytes`), all live at the optimizer step;
* **a breakdown that adds up exactly**: parameters, gradients and optimizer states as live in the
  phase where the peak falls, and the rest as ``activations_bytes`` (forward/backward phases) or
  ``optimizer_temporaries_bytes`` (optimizer phase);
* **a bound whose width depends on the path and the configuration**: ``upper = point × (1 + margin)``
  with the margin of the :func:`margin_group` (traced; traced with sharding, apart where the configuration
  avoids the sharded composition's known misses, :func:`uniform_configuration`; provisional), each a
  split-conformal quantile of relative residuals on held-out architectures, never below the group's
  measured floor (see :mod:`benchmarks.accuracy`).

Offloaded configurations (:mod:`model.offload`) are answered from the curve of their traced base
(the same configuration without offload; FSDP full-shard for parameter offload) by
:func:`model.offload.offload_device_phases`, on the base's path (the host memory the offloaded states need is the
job's, :meth:`model.job.Job.host_memory_bytes`); the bound takes the margin of the base's group.
ZeRO-1 (:mod:`model.zero1`) is answered the same way from its unsharded base, less the optimizer states (and
step temporaries) of the parameters ``ZeroRedundancyOptimizer`` gives other ranks.
Frozen fine-tunes (embeddings and the first N layers frozen) are answered the same way from the curve of
their base, the full fine-tune of the L − N layers above (:mod:`model.frozen`), where that applies.

Each of these ways is one :class:`model.derivation.Derivation` object; :meth:`MemoryPredictor.curve` applies
:data:`DERIVATIONS` in order (offload, frozen layers, ZeRO-1, the traced terms, gradient accumulation from one
micro-batch's terms, the learned coefficients, the learned ratio model, DeepSpeed stage 3's offload buffers,
DeepSpeed stage 2, gradient accumulation) and makes the last :class:`model.derivation.Draft` a :class:`Curve`.
A new way to derive a curve is one more object in that tuple.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memfit.schema import GIB, CheckpointImpl, FineTune, ModelSpec, Sharding, TrainingConfig
from model.analytic import ModelStates, optimizer_state_bytes_per_param
from model.compose import PEAK_PHASES, compose, compose_terms
from model.deepspeed_zero import DeepSpeedStage2Derivation, DeepSpeedStage3BuffersDerivation
from model.derivation import PROVISIONAL, TRACED, Derivation, Draft, Request, peak_phases
from model.frozen import FrozenLayersDerivation
from model.offload import OffloadDerivation
from model.parallel import ParallelCurve, compose_pipeline, rank_share
from model.terms import TermsCache, not_traceable_reason, terms_key
from model.zero1 import Zero1Derivation

#: margin group of traced answers for sharded training (FSDP / ZeRO-2/3 traced over a fake process group)
TRACED_SHARDED = "traced_sharded"
#: margin group of provisional answers composed from learned phase coefficients (:mod:`model.coefficients`),
#: and of those for sharded training (fewer traced examples to learn from: twice the error leaving the
#: architecture out, benchmarks/results/accuracy.txt)
PROVISIONAL_COEFFICIENTS = "provisional_coefficients"
PROVISIONAL_COEFFICIENTS_SHARDED = "provisional_coefficients_sharded"
#: the traced path's bound never sits closer than this to the point: the composition is exact up to 512-byte
#: rounding on most configurations (benchmarks/results/accuracy.txt), and a calibrated quantile of
#: mostly-zero residuals would not cover the few that miss
TRACED_MARGIN_FLOOR = 0.005
#: the same for sharded configurations (composed from 3- and 4-layer traces; micro-batch 1 is traced on its own,
#: ``mb1`` terms). Their worst miss is opt-1.3b, ZeRO-3 + LoRA r64, fp32, b = 1: 1.49 % low at 0 < k < 19 (its
#: forward-phase peak), so the floor covers 1 / (1 - 0.0149) - 1 = 1.51 %
TRACED_SHARDED_MARGIN_FLOOR = 0.016
#: margin group of traced answers for sharded training that avoid what the sharded composition misses: micro-batch
#: 2 or more, a full fine-tune, decoder layers all alike (:func:`uniform_configuration`)
TRACED_SHARDED_UNIFORM = "traced_sharded_uniform"
#: its floor: on the 2,782 such rows of the telemetry the composed point was at most 0.022 % under the measured
#: peak (every miss of more is at micro-batch 1, with LoRA or frozen layers, or with a layer pattern), so a
#: tenth of the sharded floor still leaves ten times the largest miss
TRACED_SHARDED_UNIFORM_MARGIN_FLOOR = 0.002
MARGIN_FLOORS = {
    TRACED: TRACED_MARGIN_FLOOR,
    TRACED_SHARDED: TRACED_SHARDED_MARGIN_FLOOR,
    TRACED_SHARDED_UNIFORM: TRACED_SHARDED_UNIFORM_MARGIN_FLOOR,
}
#: default relative bound margins per group until calibrated (measured in benchmarks/results/accuracy.txt)
DEFAULT_MARGINS = {
    **MARGIN_FLOORS,
    PROVISIONAL: 0.30,
    PROVISIONAL_COEFFICIENTS: 0.30,
    PROVISIONAL_COEFFICIENTS_SHARDED: 0.30,
}


def uniform_configuration(training: TrainingConfig, period: int) -> bool:
    """Whether a traced configuration avoids the known misses of the sharded composition: micro-batch size >= 2
    (b = 1 has its own fit and a boundary term the all-or-nothing small models lack), a full fine-tune (frozen
    embeddings change the bottom layer's backward) and a layer-type ``period`` of 1 (k cutting through a
    sliding/full pattern is charged the average layer). Mondrian conformal (Vovk et al. 2005, "Algorithmic
    Learning in a Random World", ch. 4): such answers are calibrated apart, in :data:`TRACED_SHARDED_UNIFORM`."""
    return training.micro_batch_size >= 2 and training.finetune is FineTune.FULL and period == 1


def margin_group(path: str, sharding: Sharding | str, composed: bool = False, uniform: bool = False) -> str:
    """Which calibrated bound margin answers ``path`` under ``sharding``: the path, with traced answers for
    sharded training in a group of their own (their composition is less exact; :data:`TRACED_SHARDED_UNIFORM`
    where ``uniform``, :func:`uniform_configuration`), and provisional answers composed from learned coefficients
    (``composed``) in theirs, again apart for sharded training."""
    sharded = Sharding(sharding) is not Sharding.NONE
    if path == TRACED and sharded:
        return TRACED_SHARDED_UNIFORM if uniform else TRACED_SHARDED
    if path == PROVISIONAL and composed:
        return PROVISIONAL_COEFFICIENTS_SHARDED if sharded else PROVISIONAL_COEFFICIENTS
    return path


_STATE_PHASES_WITH_GRADS = {"bwd.emb", "opt"}


@dataclass(frozen=True)
class CurvePoint:
    """One k of a curve (bytes per device).

    Attributes:
        k: checkpointed decoder layers (the first k of each pipeline stage).
        predicted_bytes: predicted peak allocated bytes.
        upper_bytes: calibrated upper bound of the peak allocated bytes.
        peak_phase: phase where the peak falls (``fwd.layers`` … ``opt``); None when the provisional answer
            comes from the LightGBM ratio model (no phases).
        breakdown: parts of ``predicted_bytes``; they add up to it exactly.
    """

    k: int
    predicted_bytes: int
    upper_bytes: int
    peak_phase: str | None
    breakdown: dict[str, int]


@dataclass(frozen=True)
class Curve:
    """A configuration's whole curve, k = 0..L, and how it was made.

    Attributes:
        path: ``traced`` or ``provisional``.
        points: one :class:`CurvePoint` per k, index = k.
        floor_bytes: the model-state floor no point goes below.
        terms_key: the traced-terms key of the configuration, None when not traceable.
        reason: why the curve is provisional (None on the traced path).
    """

    path: str
    points: list[CurvePoint]
    floor_bytes: int
    terms_key: str | None
    reason: str | None = None
    notes: list[str] = field(default_factory=list)
    #: the provisional answer was composed from learned phase coefficients (:mod:`model.coefficients`)
    learned_coefficients: bool = False
    pipeline: ParallelCurve | None = None  # per-stage split (traced path with pipeline/context parallelism)
    #: raw composed peak per k before the envelope and floor (float, shape (L+1,))
    raw_bytes: Any = None
    #: traced path: every phase's composed live bytes, shape (L+1, len(PEAK_PHASES)); None when provisional
    phase_bytes: Any = None
    #: the bound's margin group (:func:`margin_group`); a ZeRO-1 curve composed from its unsharded base takes the
    #: base's (:mod:`model.zero1`). None where the curve is composed on another's (offload, frozen layers): the
    #: group of its path and sharding
    margin_group: str | None = None


#: phases in which a step of one micro-batch does not yet hold every gradient (model.compose.PEAK_PHASES names)
_PHASES_BEFORE_ALL_GRADS = ("fwd.layers", "fwd.head", "bwd.head", "bwd.layers")


def accumulation_phases(phase_bytes: np.ndarray, gradients_bytes: int) -> np.ndarray:
    """Each phase's live bytes under gradient accumulation, from a step of one micro-batch: the summed gradients
    (``gradients_bytes`` per rank) are added to every phase before the end of backward, where that step holds
    none or only some of them; ``bwd.emb`` and ``opt`` hold them all already. An upper bound: in ``bwd.layers``
    the gradients of the layers already done are counted twice. Shape (L+1, len(PEAK_PHASES)) in and out.
    """
    out = np.array(phase_bytes, dtype=np.float64, copy=True)
    cols = [PEAK_PHASES.index(p) for p in _PHASES_BEFORE_ALL_GRADS]
    out[:, cols] += gradients_bytes
    return out


def upper_bytes(predicted_bytes: int, margin: float) -> int:
    """The calibrated bound on a point: ``ceil(predicted_bytes × (1 + margin))`` bytes (``margin``: relative, of the
    point's margin group; the module docstring's bound)."""
    return math.ceil(predicted_bytes * (1 + margin))


def breakdown(
    states: ModelStates, predicted_bytes: int, phase: str | None, gradients_live: bool = False
) -> dict[str, int]:
    """Split a predicted peak into the model states (:func:`model.analytic.model_state_bytes`) live in
    ``phase`` and the rest; the parts add up to ``predicted_bytes`` exactly.

    Gradients are counted as live from the end of backward (``bwd.emb``) through the optimizer step;
    before that they build up layer by layer and are part of ``activations_bytes``. On the
    provisional path (``phase`` None) and under gradient accumulation (``gradients_live``: the summed
    gradients are held through every phase) all states are counted.

    Raises:
        ValueError: ``predicted_bytes`` below the states counted.
    """
    s = states
    grads = s.gradients_bytes if gradients_live or phase is None or phase in _STATE_PHASES_WITH_GRADS else 0
    parts = {"parameters_bytes": s.weights_bytes, "gradients_bytes": grads, "optimizer_states_bytes": s.optimizer_bytes}
    rest = int(predicted_bytes) - sum(parts.values())
    if rest < 0:  # cannot happen above the floor; keep the parts honest if it ever does
        raise ValueError(f"predicted {predicted_bytes} B is below the model states {sum(parts.values())} B")
    parts["optimizer_temporaries_bytes" if phase == "opt" else "activations_bytes"] = rest
    return parts


class MemoryPredictor:
    """Answers :meth:`curve` from traced terms when it has them, else from the provisional estimator.

    Args:
        estimator: a fitted :class:`model.estimator.PeakMemoryRegressor` (the provisional path), or None.
        terms: the traced-terms cache.
        margins: relative bound margin per path (:data:`DEFAULT_MARGINS` when None).
        coefficients: a fitted :class:`model.coefficients.CoefficientModel`, or None: answers the provisional
            configurations it covers by composing its predicted phase terms.
        tracer: optional callable ``(key, hf_config, training) -> str`` asked to trace a missing key (in
            the background: :class:`service.tracing.BackgroundTracer`, or at once:
            :class:`service.tracing.InlineTracer`); it returns what the answer should say. Until the
            terms exist the curve is answered provisionally.
    """

    def __init__(
        self,
        estimator: Any = None,
        terms: TermsCache | None = None,
        margins: dict[str, float] | None = None,
        tracer: Any = None,
        coefficients: Any = None,
    ) -> None:
        self.estimator = estimator
        self.coefficients = coefficients
        self.terms = terms if terms is not None else TermsCache()
        self.margins = {**DEFAULT_MARGINS, **(margins or {})}
        self.tracer = tracer
        #: the steps :meth:`curve` applies in order (:data:`DERIVATIONS`)
        self.derivations: tuple[Derivation, ...] = DERIVATIONS

    def curve(self, model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None = None) -> Curve:
        """The whole curve over k = 0..``model.num_layers`` for one configuration (bytes per device): the
        :attr:`derivations` applied in order (:mod:`model.derivation`), the last draft made a :class:`Curve`.

        Args:
            model: the architecture with its total and trainable parameter counts.
            training: the configuration; its ``checkpoint_layers`` are ignored.
            hf_config: the HF config dict the model is built from (needed for the traced path).

        Raises:
            ValueError: no path can answer (no terms and no provisional estimator).
        """
        request, draft = Request(model, training, hf_config), None
        for step in self.derivations:
            draft = step.derive(self, request, draft)
        if draft.composed_from is None:  # the request's own composition: its group, and notes on the configuration
            period = draft.period
            uniform = period is not None and uniform_configuration(training, period)
            group = margin_group(draft.path, training.sharding, draft.learned, uniform=uniform)
        else:  # composed from a base: the base's path and learned flag, the derivation's sharding
            group = margin_group(draft.path, draft.margin_sharding, draft.learned)
        pipe, margin = draft.pipeline, self.margins[group]
        held = None if pipe is None else (lambda at: draft.stage_states[pipe.bottleneck(at)])
        points = self._points(draft.path, draft.raw, draft.phases, draft.states, margin, held, draft.gradients_live)
        if pipe is not None:  # the stage the answer names carries the answer's floor and envelope
            pipe = pipe.with_peak(np.array([p.predicted_bytes for p in points]))
        own = draft.composed_from is None
        return Curve(
            path=draft.path,
            points=points,
            floor_bytes=draft.states.total_bytes,
            terms_key=draft.terms_key,
            reason=draft.reason if draft.path == PROVISIONAL or not own else None,
            notes=draft.notes + (self._configuration_notes(request, draft, group) if own else []),
            pipeline=pipe,
            raw_bytes=draft.raw,
            phase_bytes=draft.phase_bytes,
            learned_coefficients=draft.learned,
            margin_group=group if draft.report_group else None,
        )

    def _configuration_notes(self, request: Request, draft: Draft, group: str) -> list[str]:
        """What the answer of the request's own composition says about its path and configuration."""
        model, training, hf_config = request.model, request.training, request.hf_config
        path, notes = draft.path, []
        if path == PROVISIONAL:
            how = "learned phase coefficients, composed per phase" if draft.learned else "learned model"
            notes.append(f"provisional answer ({how}): {draft.reason}")
        if model.num_experts is not None and path == TRACED:
            notes.append(
                f"MoE traced with balanced routing (hottest expert at {training.moe_imbalance_factor:g}x its "
                f"balanced share) over {training.expert_parallel_size} expert-parallel rank(s)"
            )
        elif model.num_experts is not None:
            notes.append(
                "MoE is approximate: this configuration's expert routing is not traced; the learned model answers"
            )
        if training.tensor_parallel_size > 1 and path == TRACED:
            notes.append(
                f"tensor parallelism{' + sequence parallelism' if training.sequence_parallel else ''} "
                f"traced with DTensor over a fake process group of {training.tensor_parallel_size} ranks "
                "(per rank)"
            )
        if training.pipeline_parallel_size > 1:
            notes.append(
                f"pipeline parallelism composed per stage ({training.pipeline_parallel_size} stages, "
                f"{training.pipeline_schedule.value}, {training.micro_batches_per_step} micro-batches)"
                + ("" if draft.pipeline is not None else ": the provisional answer is for a rank holding all layers")
            )
        if training.context_parallel_size > 1:
            notes.append(
                f"context parallelism composed: {training.seq_len // training.context_parallel_size} tokens "
                "per rank plus ring-attention key/value buffers"
                + ("" if draft.pipeline is not None else ": the provisional answer is for the whole sequence")
            )
        if training.sharding is not Sharding.NONE and path == TRACED:
            # what the trace was, not a fault: the memory is rank 0's, traced in one process (no GPUs, no network)
            cp = training.context_parallel_size
            notes.append(
                f"{training.sharding.value} over {training.sharding_group_size} "
                + (
                    f"data x context-parallel ranks ({training.data_parallel_size} x {cp}, torchtitan's dp_shard_cp)"
                    if cp > 1
                    else "data-parallel ranks"
                )
                + ": rank 0's memory, traced in one process over torch's fake process group of "
                f"{training.sharding_group_size} ranks (no communication is run)"
            )
            experts, ranks = model.num_experts, training.sharding_group_size
            fsdp2 = training.sharding not in (Sharding.ZERO1, Sharding.ZERO3)  # zero3: tracer.collect's flat partition
            if fsdp2 and experts and experts < ranks and training.tensor_parallel_size == 1:
                notes.append(
                    f"FSDP2 shards dim 0: the fused ({experts}, ...) expert tensors are padded to {ranks} rows over "
                    f"{ranks} ranks, gathered at {ranks / experts:g}x their size; "
                    + (
                        "DeepSpeed's stage 2 keeps whole parameters and gathers none, so this answer is high for it"
                        if training.sharding is Sharding.ZERO2
                        else "sharding them on another dimension (fully_shard's shard_placement_fn, torchtitan) or "
                        "DeepSpeed's flat partition (sharding zero3) avoids it"
                    )
                )
        if group == TRACED_SHARDED:  # a new user saw an 8x wider bound at micro-batch 1 than at 2, unexplained
            notes.append(
                f"bound {100 * self.margins[group]:.1f} % above the point: sharded steps at micro-batch 1, with LoRA "
                f"or frozen layers, or with a layer-type pattern are composed less exactly than the others "
                f"({100 * self.margins[TRACED_SHARDED_UNIFORM]:.1f} %)"
            )
        if training.checkpoint_impl is CheckpointImpl.REENTRANT and training.finetune is not FineTune.FULL:
            notes.append(
                "reentrant checkpointing behind frozen embeddings: the checkpointed layers' inputs do not "
                "require grad, so without a fix they get no gradients (or the step fails); answered as "
                "memfit.apply runs it, with model.enable_input_require_grads(); use_reentrant=False "
                "(checkpoint_impl non_reentrant) is the other fix"
            )
        if hf_config is not None:  # keys that change a step but not the key's meaning (memfit.hf.canonical_hf_config)
            from memfit.hf import config_assumptions

            assumed = config_assumptions(hf_config)
            if assumed:
                notes.append(assumed)
        paged = optimizer_state_bytes_per_param(training)[1] * model.trainable_params
        if paged:
            notes.append(
                f"{training.optimizer.value}: about {paged / GIB:.2f} GiB of optimizer states live in CUDA "
                "unified memory (cudaMallocManaged), outside PyTorch's allocator: not in the peak allocated "
                "bytes; the driver pages them to host RAM when the device is full"
            )
        return notes

    def _points(
        self,
        path: str,
        raw: np.ndarray,
        phases: list[str | None],
        states: ModelStates,
        margin: float,
        held: Any = None,
        gradients_live: bool = False,
    ) -> list[CurvePoint]:
        """Envelope over k' >= k (monotone, conservative), the state floor, bound and breakdown per k.

        ``held(at)`` gives the model states of the rank that peaks at k = ``at`` (pipeline stages); default
        ``states``. ``gradients_live``: gradients are held in every phase (gradient accumulation).
        """
        point = np.maximum(np.maximum.accumulate(raw[::-1])[::-1], states.total_bytes)
        # the k' >= k whose peak the envelope takes: the first maximum of raw[k:] (np.argmax's tie rule), one pass
        values, ats, at = raw.tolist(), [0] * len(raw), len(raw) - 1
        for k in range(len(raw) - 1, -1, -1):
            if values[k] >= values[at]:
                at = k
            ats[k] = at
        points = []
        for k in range(len(raw)):
            p = math.ceil(point[k])
            at = ats[k]
            phase = phases[at]
            points.append(
                CurvePoint(
                    k=k,
                    predicted_bytes=p,
                    upper_bytes=upper_bytes(p, margin),
                    peak_phase=phase,
                    breakdown=breakdown(held(at) if held else states, p, phase, gradients_live),
                )
            )
        return points


class TracedTerms:
    """The :class:`model.derivation.Derivation` that starts the request's own composition: the model states per
    rank (one expert-parallel rank's share, the fullest pipeline stage) and, where the configuration is traceable
    and its terms are in the cache (or the tracer stores them at once), the composed curve
    (:func:`model.compose.compose_terms`; per pipeline stage with pipeline or context parallelism). Asks the
    tracer for a missing key and records why the curve stays provisional."""

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        if draft is not None:
            return draft
        model, training, hf_config = request.model, request.training, request.hf_config
        share = rank_share(model, training, hf_config)
        d = Draft(
            states=share.fullest_states,
            reason=not_traceable_reason(model, training, hf_config),
            rank_model=share.model,
            stage_states=share.stage_states,
        )
        if d.reason is None and hf_config is None:
            d.reason = "no HF config to trace"
        if d.reason is not None:
            return d
        d.terms_key = key = terms_key(hf_config, training)
        terms = predictor.terms.get(key)
        if terms is None and predictor.tracer is not None:
            status = predictor.tracer(key, hf_config, training)
            terms = predictor.terms.get(key)  # a synchronous tracer has stored them already
            if terms is None:
                d.reason = f"this configuration has not been traced yet: {status}"
        elif terms is None:
            d.reason = "this configuration has not been traced yet"
        if terms is None:
            return d
        d.path, d.period = TRACED, terms.get("period", 1)
        if _pipeline_or_context(training):
            long = terms.get("long")
            coef = long["coef"] if long and training.seq_len >= long["min_seq_len"] else terms["coef"]
            p = terms.get("period", 1)
            depths = tuple(terms.get("depths", (p, 2 * p)))
            d.pipeline = compose_pipeline(coef, depths, model, training)
            d.raw, d.phases = d.pipeline.peak_bytes.astype(np.float64), d.pipeline.phase
            d.phase_bytes = d.pipeline.phase_bytes  # one stage (context parallel alone): its phases
        else:
            c = compose_terms(terms, model.num_layers, training.micro_batch_size, training.seq_len)
            d.raw, d.phases, d.phase_bytes = c.peak_bytes.astype(np.float64), c.phase, c.phase_bytes
        return d


def _pipeline_or_context(training: TrainingConfig) -> bool:
    return training.pipeline_parallel_size > 1 or training.context_parallel_size > 1


class AccumulatedTerms:
    """The :class:`model.derivation.Derivation` answering gradient accumulation that is not traced itself from
    the traced terms of one micro-batch per step, the gradient buffer added where it is not live already
    (:func:`accumulation_phases`; not with pipeline or context parallelism)."""

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        training, hf_config = request.training, request.hf_config
        if draft.raw is not None or draft.terms_key is None or not training.accumulates_gradients:
            return draft
        if _pipeline_or_context(training):
            return draft
        single = predictor.terms.get(
            terms_key(hf_config, training.model_copy(update={"gradient_accumulation_steps": 1}))
        )
        if single is None:
            return draft
        draft.path, draft.period, draft.accumulation_composed = TRACED, single.get("period", 1), True
        c = compose_terms(single, request.model.num_layers, training.micro_batch_size, training.seq_len)
        draft.phase_bytes = accumulation_phases(c.phase_bytes, draft.states.gradients_bytes)
        draft.raw, draft.phases = peak_phases(draft.phase_bytes, PEAK_PHASES)
        return draft


class LearnedCoefficients:
    """The :class:`model.derivation.Derivation` answering an untraced request the learned phase coefficients
    cover (:class:`model.coefficients.CoefficientModel`), composed per phase as traced terms are; with pipeline or
    context parallelism, per stage (:func:`model.parallel.compose_pipeline`) from the coefficients of the same
    configuration on one stage (the terms key holds neither size: they are composed on top)."""

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        model, training, hf_config = request.model, request.training, request.hf_config
        if draft.raw is not None or predictor.coefficients is None:
            return draft
        staged = _pipeline_or_context(training)
        one_stage = (  # context-parallel ranks stay in the sharding group (TrainingConfig.sharding_group_size)
            training.model_copy(
                update={
                    "pipeline_parallel_size": 1,
                    "context_parallel_size": 1,
                    "data_parallel_size": training.sharding_group_size,
                }
            )
            if staged
            else training
        )
        if not predictor.coefficients.covers(draft.rank_model, one_stage, hf_config):
            return draft
        coef = predictor.coefficients.predict_coef(draft.rank_model, one_stage, hf_config)
        draft.path, draft.learned = PROVISIONAL, True
        if staged:
            draft.pipeline = compose_pipeline(coef, (1, 2), model, training)
            draft.raw, draft.phases = draft.pipeline.peak_bytes.astype(np.float64), draft.pipeline.phase
            draft.phase_bytes = draft.pipeline.phase_bytes
            return draft
        c = compose(coef, model.num_layers, training.micro_batch_size, training.seq_len)
        draft.raw, draft.phases, draft.phase_bytes = c.peak_bytes.astype(np.float64), c.phase, c.phase_bytes
        return draft


class LearnedRatio:
    """The :class:`model.derivation.Derivation` answering what nothing else did: the LightGBM ratio model
    (:class:`model.estimator.PeakMemoryRegressor`) over the analytic estimate, no phases.

    Raises:
        ValueError: no provisional model loaded.
    """

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        if draft.raw is not None:
            return draft
        if draft.path is None:
            draft.path = PROVISIONAL
        if predictor.estimator is None:
            raise ValueError(f"no traced terms for this configuration ({draft.reason}) and no provisional model loaded")
        from model.features import curve_matrix

        base, ratio = predictor.estimator.predict_matrix(curve_matrix(request.model, request.training))
        draft.raw, draft.phases = np.exp(base + ratio), [None] * (request.model.num_layers + 1)
        return draft


class GradientAccumulation:
    """The :class:`model.derivation.Derivation` of gradient accumulation on a finished composition: what the
    answer says, and on the learned paths (steps of one micro-batch) the whole gradient buffer added to every k
    (an upper bound). Offloaded gradients accumulate in host memory: the device curve stays one micro-batch's.
    Curves composed from a frozen or ZeRO-1 base carry it from the base."""

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        training = request.training
        steps = training.gradient_accumulation_steps
        if draft.composed_from == "offload" and steps > 1:
            draft.notes.append(
                f"gradient accumulation over {steps} micro-batches: the "
                "offloaded gradients accumulate in host memory, the device holds one micro-batch's peak"
            )
        if draft.composed_from is not None or not training.accumulates_gradients:
            return draft
        draft.gradients_live = True
        if draft.accumulation_composed:
            draft.notes.append(
                f"gradient accumulation over {steps} micro-batches "
                "composed from the traced phases of one micro-batch per step, the gradient buffer added "
                "to every phase before the end of backward (an upper bound until it is traced: "
                f"{draft.reason})"
            )
        elif draft.path == TRACED:
            draft.notes.append(
                f"gradient accumulation over {steps} micro-batches traced: a later micro-batch runs with every "
                "gradient live"
            )
        else:  # the learned paths know steps of one micro-batch: add the whole gradient buffer (an upper bound)
            if draft.pipeline is not None:  # context parallel (pipelines accumulate over num_micro_batches instead)
                draft.pipeline = draft.pipeline.plus([st.gradients_bytes for st in draft.stage_states])
                draft.raw = draft.pipeline.peak_bytes.astype(np.float64)
                draft.phase_bytes = draft.pipeline.phase_bytes
            else:
                draft.raw = draft.raw + draft.states.gradients_bytes
            draft.notes.append(
                f"gradient accumulation over {steps} micro-batches: "
                "the learned answer for one micro-batch plus the whole gradient buffer (an upper bound)"
            )
        return draft


#: the steps :meth:`MemoryPredictor.curve` applies, in order (:mod:`model.derivation`)
DERIVATIONS: tuple[Derivation, ...] = (
    OffloadDerivation(),
    FrozenLayersDerivation(),
    Zero1Derivation(not_traceable_reason),
    TracedTerms(),
    AccumulatedTerms(),
    LearnedCoefficients(),
    LearnedRatio(),
    DeepSpeedStage3BuffersDerivation(),
    DeepSpeedStage2Derivation(),
    GradientAccumulation(),
)
