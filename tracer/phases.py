"""Trace a training step's live bytes per phase on small full-width models: the traced path's inputs.

A full model's peak is composed (:mod:`model.compose`) from four small models of the *same* config at
full width: one and two decoder layers, none or all of them activation-checkpointed. For each, one
primed training step (optimizer states exist, as in step 2 of a run) is traced under fake tensors with
:class:`tracer.tracker.LiveStorageTracker`, and the peak of live bytes is recorded per phase:

* ``fwd.layers``: forward from the start until the top decoder layer's output exists;
* ``fwd.head``: the rest of forward (final norm, lm_head, loss);
* ``bwd.head``: backward until the gradient of the top decoder layer's output exists;
* ``bwd.layers``: decoder-layer backward (recompute included) until the gradient of the first layer's
  input exists;
* ``bwd.emb``: the rest of backward (embedding backward, tied-weight accumulation);
* ``opt``: the optimizer step and ``zero_grad(set_to_none=True)``;
* ``rest``: live bytes when the step starts (weights, optimizer states, the input ids).

Boundaries are set by tensor hooks registered in the real forward only (recompute forwards of
checkpointed layers do not move them). The phases and the composition rules are those of
``shared/design/peak-composition.md`` (measured there at 0.04 % MAPE on 14 unseen architectures).

Each phase's live bytes are, per model variant, a linear function of the token-shape basis
:func:`model.compose.token_basis` = (1, b·s, s, b·s², s²) with b = micro-batch size and s = sequence length: activations
and logits grow with b·s, rotary tables and position ids with s, eager attention scores with b·s²,
masks with s². Five traced (b, s) points per variant determine the five coefficients exactly; the
fit is checked against other token counts in ``tests/test_phases.py``. Without s² terms three points
fix the linear part (1, b·s, s): the first small model's trace checks a fourth point (a new length) against
that fit and traces the fifth only when it misses (eager attention always takes five), so an SDPA model without an
explicit mask takes three steps per variant instead of five (:func:`linear_token_points`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memfit.hf import layer_period, max_seq_len, small_config
from memfit.schema import CheckpointImpl, Offload, Sharding, TrainingConfig
from model.compose import BASIS_NAMES, PHASES, token_basis
from tracer.collect import _prime_optimizer, checkpoint_as_applied, close_optimizer, prepared_model

log = logging.getLogger(__name__)

#: sharding modes whose parameters FSDP2 gathers layer by layer
SHARDED_PARAMETERS = frozenset({Sharding.ZERO2, Sharding.ZERO3, Sharding.FSDP_FULL_SHARD, Sharding.FSDP_SHARD_GRAD_OP})
#: the longest sequence the pruning grid covers
MAX_TRACED_SEQ_LEN = 1 << 17


def sliding_window_threshold(hf_config: dict[str, Any]) -> int | None:
    """Sequence length from which HF builds an explicit sliding-window mask for SDPA (None: never).

    Mistral-style configs set ``sliding_window``; below it the window covers the whole sequence and
    transformers skips the mask (plain causal attention), from it on a ``(b, 1, s, s)`` mask exists.
    """
    w = hf_config.get("sliding_window")
    if not isinstance(w, int) or isinstance(w, bool) or w <= 0 or hf_config.get("use_sliding_window") is False:
        return None
    cap = max_seq_len(hf_config)
    return None if cap is not None and w > cap else w


def token_points(hf_config: dict[str, Any], long: bool = False) -> list[tuple[int, int]]:
    """Five (micro_batch_size, seq_len) points that determine the :func:`model.compose.token_basis` coefficients exactly.

    Three sequence lengths at b = 2 fix the constant, (2·b·s + s) and (2·b·s² + s²); two points at b = 4
    separate b·s from s and b·s² from s². Micro-batches of 1 are avoided: some reshapes are views there
    and copies otherwise, which would change the step's allocation sequence. Lengths stay within a
    learned position table, and on one side of a sliding window (:func:`sliding_window_threshold`):
    below it by default, from it on with ``long=True``.
    """
    cap = max_seq_len(hf_config) or 4096
    s1 = min(cap, 4096)
    w = sliding_window_threshold(hf_config)
    if w is not None and long:
        s2 = 1 << (w - 1).bit_length()  # the power of two >= w
        return (
            [(2, 2 * s2), (2, s2), (2, 3 * s2 // 2), (4, s2), (4, 2 * s2)]
            if s2 > w
            else [(2, 2 * w), (2, w), (2, 3 * w // 2), (4, w), (4, 2 * w)]
        )
    if w is not None and s1 >= w:
        s1 = 1 << ((w - 1).bit_length() - 1)  # the largest power of two < w
    s2, s3 = s1 // 4, s1 // 2
    return [(2, s1), (2, s2), (2, s3), (4, s2), (4, s1)]


#: the :data:`model.compose.BASIS_NAMES` columns of live bytes linear in tokens: (1, b·s, s)
LINEAR_COLUMNS = [0, 1, 2]
#: the largest difference, bytes, between an event's traced live bytes at the check point and the linear fit
#: through three points for the step to count as linear in tokens (measured: exactly 0 for linear steps; tens of
#: MiB for Falcon-7B's explicit (b, 1, s, s) mask at s = 4096)
LINEAR_CHECK_TOLERANCE_BYTES = 64 * 1024


def linear_token_points(
    points: list[tuple[int, int]],
) -> tuple[list[tuple[int, int]], tuple[int, int], tuple[int, int]]:
    """Split :func:`token_points`' five points into three that fix a fit on :data:`LINEAR_COLUMNS` (two lengths
    at b = 2, the shorter again at b = 4), the check point (the middle length at b = 2) and the fifth point,
    traced only when the check fails.

    The check point's length is one the three do not have, so an s² term shows there whether it scales with
    b or not: on these points the linear fit of ``b·s²`` misses the check point by +s1²/4 and that of ``s²``
    by +s1²/8 (s1 the longest length), and a tensor's bytes are a sum of such monomials with non-negative
    weights, so the misses cannot cancel. (A check at (4, s1) would pass a (1, 1, s, s) mask unseen: the fit
    through the three points is exact there for a pure s² term.)
    """
    p = list(points)
    return [p[0], p[1], p[3]], p[2], p[4]


def timeline_on_fit(
    timelines: list[list[tuple[str, int]]],
    points: list[tuple[int, int]],
    columns: list[int],
    check: list[tuple[str, int]],
    check_point: tuple[int, int],
) -> bool:
    """Whether the timeline traced at ``check_point`` is, event by event, what the exact fit of ``timelines`` (traced
    at ``points``) on the basis ``columns`` predicts there, to :data:`LINEAR_CHECK_TOLERANCE_BYTES`. False when
    the op sequences differ."""
    if not _aligned([*timelines, check]):
        return False
    predicted = token_basis(*check_point) @ event_coefficients(timelines, points, columns)
    return bool(
        np.abs(predicted - np.array([v for _, v in check], dtype=np.float64)).max() <= LINEAR_CHECK_TOLERANCE_BYTES
    )


#: the most allocation events a micro-batch-1 timeline may lack against the b >= 2 fit and still be answered by it
#: (:func:`micro_batch_one_on_fit`; measured: one, a reshape of the logits that is a view at b = 1)
MICRO_BATCH_ONE_DROPPED_EVENTS = 8


def micro_batch_one_on_fit(
    timelines: list[list[tuple[str, int]]],
    points: list[tuple[int, int]],
    columns: list[int],
    check: list[tuple[str, int]],
    check_point: tuple[int, int],
) -> np.ndarray | None:
    """The b >= 2 fit of ``timelines`` (traced at ``points``, on the basis ``columns``) at micro-batch 1, as event
    coefficients on (1, s, s²) (shape (5, events), bytes: ``b·s`` folded into ``s`` and ``b·s²`` into ``s²``), when
    the micro-batch-1 timeline ``check`` traced at ``check_point`` is on it; else None.

    On it means: walking both in order, every event of ``check`` is the next event of the fit in the same phase
    with the fit's live bytes there (to :data:`LINEAR_CHECK_TOLERANCE_BYTES`), the fit's events in between being
    allocations b = 1 does not make (a reshape that is a view at b = 1 and a copy from b = 2 on, at most
    :data:`MICRO_BATCH_ONE_DROPPED_EVENTS`). Those are dropped from the returned coefficients, so they are the
    micro-batch-1 timeline itself at ``check_point``. Where a view keeps its base alive instead (FSDP + LoRA on a
    pythia-shaped model: 2 hidden vectors per token per layer more at b = 1, ``tests/test_phases.py``), later
    events' bytes differ and the check fails: micro-batch 1 is then fitted on its own traces.
    """
    if check_point[0] != 1:
        return None
    theta = event_coefficients(timelines, points, columns)
    predicted = token_basis(*check_point) @ theta
    fit_phases = [p for p, _ in timelines[0]]
    kept, i = [], 0
    for phase, live in check:
        while i < len(fit_phases) and not (
            fit_phases[i] == phase and abs(predicted[i] - live) <= LINEAR_CHECK_TOLERANCE_BYTES
        ):
            i += 1
        if i == len(fit_phases) or i - len(kept) > MICRO_BATCH_ONE_DROPPED_EVENTS:
            return None
        kept.append(i)
        i += 1
    if len(fit_phases) - len(kept) > MICRO_BATCH_ONE_DROPPED_EVENTS:
        return None
    folded = np.zeros((theta.shape[0], len(kept)))
    folded[0], folded[2], folded[4] = theta[0, kept], theta[1, kept] + theta[2, kept], theta[3, kept] + theta[4, kept]
    return folded


#: the fewest decoder layers of the smaller traced model: the bottom layer is not like the others, so the
#: per-layer increment is measured between deeper models (:func:`traced_depths`)
MIN_TRACED_DEPTH = 2
#: the same with FSDP-gathered parameters (prefetch and reduce-scatter edge effects)
MIN_TRACED_DEPTH_SHARDED = 3


def traced_depths(period: int, sharding: Sharding) -> tuple[int, int]:
    """Decoder layers of the "one" and "two" layer small models: ``(d1, d1 + period)``, ``d1`` the smallest
    multiple of the layer-type ``period`` >= :data:`MIN_TRACED_DEPTH` (>= :data:`MIN_TRACED_DEPTH_SHARDED`
    with FSDP-gathered parameters, :data:`SHARDED_PARAMETERS`).

    :func:`model.compose.layer_values` charges each layer (P(d2) − P(d1)) / (d2 − d1) and keeps the rest in
    the base, so the increment must come from layers that are like every layer above them. The bottom
    layer is not: its input is the embedding output, which needs no gradient when the embeddings are
    frozen (LoRA: its backward computes no input gradient, whose transients are the ``bwd.layers`` peak of
    the parallel-residual blocks of GPT-J and Falcon), and nothing runs below it (BLOOM's layer loop keeps
    the previous block's output tuple, attention probabilities included, while the next block runs: for a
    checkpointed block those are otherwise free, so from two layers on the forward holds one more
    (b, heads, s, s) tensor, once, not per layer). From the second layer on each layer adds the same
    (BLOOM-560m, GPT-J-6B LoRA and Falcon-7B LoRA at full width and 1 to 4 layers;
    ``tests/test_phases_depth.py``).
    FSDP gathers a layer's parameters just in time, prefetches the next and reduce-scatters gradients
    behind: from three layers on each layer adds the same (measured on Llama-2-7B at world size 4).
    """
    first = MIN_TRACED_DEPTH_SHARDED if sharding in SHARDED_PARAMETERS else MIN_TRACED_DEPTH
    d1 = period * -(-first // period)
    return d1, d1 + period


@dataclass
class PhaseTerms:
    """Per-phase live-byte coefficients of the four small models (what :mod:`model.compose` composes).

    ``coef[(n, c)][phase]`` is a list of pieces, each a coefficient vector over :data:`BASIS_NAMES`
    (bytes), so that the phase's peak live bytes at micro-batch b and sequence length s are
    ``max(token_basis(b, s) @ piece for piece in pieces)``.
    ``trace_s`` is the wall time the traces took. The "one and two layer" models have ``depths`` layers:
    :func:`traced_depths`: (2, 3) when layers are alike (above the bottom layer, which is unlike the others;
    terms traced before that carry (1, 2)); with layers of several types in a repeating pattern of
    ``period`` layers (sliding-window / full attention) they hold whole patterns; with FSDP-gathered
    parameters they are (3, 4), past the edge effects of prefetching. :func:`model.compose.compose`
    divides their difference by the depth difference. With a
    sliding window, ``coef`` holds for sequences shorter than ``long_min_seq_len`` and ``long_coef`` from
    it on (the mask exists only there).
    """

    coef: dict[tuple[int, int], dict[str, list[list[float]]]]
    points: list[tuple[int, int]]
    attention: str
    trace_s: float = 0.0
    period: int = 1
    long_coef: dict[tuple[int, int], dict[str, list[list[float]]]] | None = None
    long_min_seq_len: int | None = None
    depths: tuple[int, int] | None = None
    #: micro-batch 1 on its own (``mb1_coef``; ``long_mb1_coef`` from ``long_min_seq_len`` on; the b >= 2 fit at b = 1
    #: where a b = 1 trace is on it, :func:`micro_batch_one_on_fit`): None
    #: in terms traced before it existed, which then compose b = 1 from the b >= 2 fit
    mb1_coef: dict[tuple[int, int], dict[str, list[list[float]]]] | None = None
    long_mb1_coef: dict[tuple[int, int], dict[str, list[list[float]]]] | None = None

    def to_json(self) -> dict[str, Any]:
        def keyed(coef):
            return None if coef is None else {f"{n},{c}": v for (n, c), v in coef.items()}

        out = {
            "coef": keyed(self.coef),
            "points": self.points,
            "attention": self.attention,
            "trace_s": round(self.trace_s, 3),
            "basis": list(BASIS_NAMES),
            "period": self.period,
            "depths": list(self.depths or (self.period, 2 * self.period)),
            "long": None
            if self.long_coef is None
            else {"min_seq_len": self.long_min_seq_len, "coef": keyed(self.long_coef)},
        }
        if self.mb1_coef is not None:
            out["mb1"] = {"coef": keyed(self.mb1_coef)}
        if self.long_mb1_coef is not None and out["long"] is not None:
            out["long"]["mb1_coef"] = keyed(self.long_mb1_coef)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PhaseTerms:
        def tupled(coef):
            return None if coef is None else {tuple(int(x) for x in k.split(",")): v for k, v in coef.items()}

        long = d.get("long")
        return cls(
            coef=tupled(d["coef"]),
            points=[tuple(p) for p in d["points"]],
            attention=d["attention"],
            trace_s=d.get("trace_s", 0.0),
            period=d.get("period", 1),
            long_coef=tupled(long["coef"]) if long else None,
            long_min_seq_len=long["min_seq_len"] if long else None,
            depths=tuple(d["depths"]) if d.get("depths") else None,
            mb1_coef=tupled((d.get("mb1") or {}).get("coef")),
            long_mb1_coef=tupled(long.get("mb1_coef")) if long else None,
        )


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


@contextlib.contextmanager
def _phase_hooks(layers, tracker, state: dict[str, bool]):
    """Hooks that move ``tracker`` through the phases at the real forward's layer boundaries."""

    def bottom_pre(_mod, args, kwargs):
        if state["bottom"]:
            return
        state["bottom"] = True
        h = _first_tensor(args) if args else kwargs.get("hidden_states")
        if h is not None and h.requires_grad:
            h.register_hook(lambda g: tracker.enter_phase("bwd.emb"))

    def top_post(_mod, _args, _kwargs, out):
        if state["top"]:
            return
        state["top"] = True
        tracker.enter_phase("fwd.head")
        h = _first_tensor(out)
        if h is not None and h.requires_grad:
            h.register_hook(lambda g: tracker.enter_phase("bwd.layers"))

    inner = [getattr(m, "_checkpoint_wrapped_module", m) for m in (layers[0], layers[-1])]
    handles = [
        inner[0].register_forward_pre_hook(bottom_pre, with_kwargs=True),
        inner[1].register_forward_hook(top_post, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class OptimizerReplay:
    """The optimizer step's memory events, traced once per small model and replayed in its later traced steps.

    The step allocates and frees tensors shaped like the parameters only (gradient casts, foreach temporaries,
    updated master weights), so its live bytes are those at its start plus offsets that do not depend on the
    micro-batch size or the sequence length (input ids, the only token-shaped tensor still alive, stay alive
    through it). The first :func:`_traced_step` given this object runs ``opt.step()`` and keeps those offsets;
    later ones append them to the timeline instead of stepping (the step is 12-17 % of a traced step's time on
    Mistral-7B with fp32 master weights, benchmarks/results/trace_time.txt). ``tests/test_phases.py`` checks
    that the terms are the same as with a real step every time.

    Attributes:
        offsets_bytes: live bytes of each allocation event in the step, less those at its start; None until
            a step was traced.
    """

    def __init__(self) -> None:
        self.offsets_bytes: list[int] | None = None

    def step(self, tracker, opt) -> None:
        """Run ``opt.step()`` the first time (recording its events), else replay the recorded events."""
        start = tracker.live_bytes
        if self.offsets_bytes is None:
            n = len(tracker.timeline)
            opt.step()
            self.offsets_bytes = [v - start for _, v in tracker.timeline[n:]]
        else:
            tracker.timeline.extend((tracker.phase, start + d) for d in self.offsets_bytes)


def _traced_step(run, opt, ids, replay: OptimizerReplay | None = None) -> list[tuple[str, int]]:
    """One primed training step; returns its memory timeline: (phase, live bytes) after every allocation
    and at every phase entry. With ``replay``, the optimizer step is traced once and replayed after that
    (:class:`OptimizerReplay`).

    Under gradient accumulation (``run.training.accumulates_gradients``) a first micro-batch's forward and
    backward run before the timeline starts, so the traced phases are those of a later micro-batch, with
    every gradient live, followed by the optimizer step (:func:`tracer.collect.accumulation_micro_batches`:
    later micro-batches repeat this timeline; the first holds a subset of it).
    """
    tracker = run.tracker
    if run.training.accumulates_gradients:
        with run.loss_context():
            with torch.autocast(run.on, dtype=run.amp_dtype) if run.use_autocast else contextlib.nullcontext():
                loss = run.model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
    state = {"top": False, "bottom": False}
    tracker.reset_peak()
    tracker.phase = "rest"
    tracker.timeline = [("rest", tracker.live_bytes)]
    tracker.enter_phase("fwd.layers")
    try:
        with _phase_hooks(run.layers, tracker, state), run.loss_context():
            with torch.autocast(run.on, dtype=run.amp_dtype) if run.use_autocast else contextlib.nullcontext():
                loss = run.model(input_ids=ids, labels=ids).loss
            tracker.enter_phase("bwd.head")
            loss.backward()
            del loss
        if tracker.phase != "bwd.emb":  # nothing below the first layer needs a gradient (frozen embeddings)
            tracker.enter_phase("bwd.emb")
        tracker.enter_phase("opt")
        if replay is None:
            opt.step()
        else:
            replay.step(tracker, opt)
        opt.zero_grad(set_to_none=True)
        tracker.enter_phase("end")
        timeline = tracker.timeline
    finally:
        tracker.timeline = None
    seen = {p for p, _ in timeline}
    missing = [p for p in PHASES if p not in seen]
    if missing:
        raise RuntimeError(f"phases {missing} were not traced (layer boundary hooks did not fire)")
    return timeline


def _traced_at(
    run, opt, micro_batch_size: int, seq_len: int, replay: OptimizerReplay | None = None
) -> list[tuple[str, int]]:
    """:func:`_traced_step` on input ids of shape (micro_batch_size, seq_len)."""
    return _traced_step(run, opt, run.input_ids(micro_batch_size, seq_len), replay)


def _pruning_grid(hf_config: dict[str, Any], lo: int = 16, hi: int | None = None) -> np.ndarray:
    """(b, s) points, ``lo <= s <= hi``, on which the upper envelope of a phase's events is kept, shape
    (n, 5) in the basis."""
    hi = min(hi or MAX_TRACED_SEQ_LEN, max_seq_len(hf_config) or MAX_TRACED_SEQ_LEN)
    seqs = sorted({lo, hi, *(int(s) for s in np.geomspace(lo, hi, 43))})
    bs = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256]
    b, s = np.meshgrid(np.array(bs, float), np.array(seqs, float))
    return token_basis(b.ravel(), s.ravel())


def _aligned(timelines: list[list[tuple[str, int]]]) -> bool:
    """Whether the timelines have the same events in the same phases (the same op sequence)."""
    return len({tuple(p for p, _ in t) for t in timelines}) == 1


def event_coefficients(
    timelines: list[list[tuple[str, int]]], points: list[tuple[int, int]], columns: list[int] | None = None
) -> np.ndarray:
    """Every timeline event's live bytes solved exactly on the :func:`model.compose.token_basis` ``columns`` (default
    all five; the others 0) from the timelines traced at ``points``: shape (5, events), bytes.

    Raises:
        RuntimeError: the timelines do not align (a shape-dependent branch in the model code).
    """
    if not _aligned(timelines):
        raise RuntimeError(
            f"timelines of the traced token points differ (lengths {sorted({len(t) for t in timelines})}): "
            "the step's op sequence depends on the input shape"
        )
    cols = list(range(len(BASIS_NAMES))) if columns is None else list(columns)
    X = np.stack([token_basis(b, s) for b, s in points])[:, cols]
    Y = np.array([[v for _, v in t] for t in timelines], dtype=np.float64)  # (points, events)
    theta = np.zeros((len(BASIS_NAMES), Y.shape[1]))
    theta[cols] = np.linalg.solve(X, Y)
    return theta


def envelope_pieces(
    timelines: list[list[tuple[str, int]]],
    points: list[tuple[int, int]],
    grid: np.ndarray,
    columns: list[int] | None = None,
) -> dict[str, list[list[float]]]:
    """Fit every timeline event's live bytes on :func:`model.compose.token_basis` and keep, per phase, the events on the
    upper envelope over ``grid``.

    The op sequence of a training step does not depend on b and s, so event i of each timeline is the
    same moment of the step; its live bytes are a polynomial in (b, s) with the :data:`BASIS_NAMES`
    monomials (up to 512-byte rounding), solved exactly from the traced points. A phase's peak at
    any (b, s) is then the max over its events — kept are those that are the max somewhere on ``grid``.

    ``columns``: the basis monomials to fit (default all five); the others get coefficient 0. Points at
    one micro-batch size b = 1 fit ``[0, 2, 4]`` (1, s, s²): there b·s = s and b·s² = s².

    Raises:
        RuntimeError: the timelines do not align (a shape-dependent branch in the model code).
    """
    return _envelope(event_coefficients(timelines, points, columns), [p for p, _ in timelines[0]], grid)


def _envelope(theta: np.ndarray, phases: list[str], grid: np.ndarray) -> dict[str, list[list[float]]]:
    """Per phase, the events of ``theta`` (shape (5, events), bytes; ``phases`` the phase of each event) that are
    the max of their phase somewhere on ``grid``, as coefficient vectors (:func:`envelope_pieces`)."""
    phase_of = np.array(phases)
    values = grid @ theta  # (grid, events)
    out: dict[str, list[list[float]]] = {}
    for p in PHASES:
        idx = np.flatnonzero(phase_of == p)
        keep = np.unique(idx[values[:, idx].argmax(axis=1)])
        out[p] = [theta[:, i].round(6).tolist() for i in keep]
    return out


class _TracePlan:
    """What :func:`trace_terms` traces per small model: the token regimes (points, pruning grid, basis columns; the
    b >= 2 polynomials first, ``n_poly`` of them, then their micro-batch-1 regimes) for one configuration."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        probe: TrainingConfig,
        regimes: list,
        n_poly: int,
        reentrant: bool,
        forced_points: bool,
    ) -> None:
        self.hf_config, self.probe, self.regimes, self.n_poly = hf_config, probe, regimes, n_poly
        self.reentrant, self.forced_points = reentrant, forced_points

    def warm_up(self) -> None:
        """One step of a one-layer model at the smallest traced length, its layer checkpointed: the first trace in
        a process imports the modeling code, PyTorch's decompositions and the checkpointing wrappers (about 1,200
        modules; seconds). Done before forking, the forked process inherits them instead of importing them again."""
        with prepared_model(small_config(self.hf_config, 1), self.probe) as run:
            opt = run.make_optimizer()
            _prime_optimizer(run.model, opt)
            checkpoint_as_applied(run.model, run.layers, [0], self.reentrant)
            _traced_at(run, opt, 1, self.probe.seq_len)
            close_optimizer(opt)
            del opt

    def trace_model(self, n: int, depth: int, linear: list[bool | None] | None = None) -> dict[str, Any]:
        """Trace the small model ``n`` (1 or 2) of ``depth`` decoder layers, none and all checkpointed, on every
        regime. ``linear``: per b >= 2 regime, whether it is linear in tokens (None: this model's first trace checks,
        :func:`timeline_on_fit`); default None each, False each with forced points.

        Returns ``{"coef": per regime {(n, c): phase pieces}, "linear": per b >= 2 regime, "points": per regime the
        fitted points, "attention": the attention implementation that ran}`` (JSON-safe but for the tuple keys).
        """
        linear = list(linear) if linear is not None else [False if self.forced_points else None] * self.n_poly
        fitted_points: list[list[tuple[int, int]]] = [pts for pts, _, _ in self.regimes]
        coefs: list[dict[tuple[int, int], dict[str, list[list[float]]]]] = [{} for _ in self.regimes]
        n_poly = self.n_poly

        main_fits: dict[int, tuple[list, list[tuple[int, int]], list[int]]] = {}  # this c's b >= 2 traces

        def fit(r: int, pts, grid, cols, trace, attention: str) -> dict[str, list[list[float]]]:
            if r >= n_poly:
                # micro-batch 1 on (1, s, s^2), or on (1, s) when the b >= 2 regime is linear (at b = 1 some reshapes
                # can be views, so its op sequence differs from b >= 2 and it is fitted on its own points) -- unless
                # a trace at its longest length is on the b >= 2 fit (:func:`micro_batch_one_on_fit`)
                main = r - n_poly
                if linear[main]:
                    pts, cols = [(1, s) for s in sorted({s for _, s in fitted_points[main]})], [0, 2]
                check = trace(*pts[-1])
                if not self.forced_points:
                    theta = micro_batch_one_on_fit(*main_fits[main], check, pts[-1])
                    if theta is not None:
                        fitted_points[r] = [pts[-1]]
                        return _envelope(theta, [p for p, _ in check], grid)
                fitted_points[r] = pts
                return envelope_pieces([trace(b, s) for b, s in pts[:-1]] + [check], pts, grid, cols)
            if linear[r] is False or attention == "eager":  # eager attention keeps (b, heads, s, s) scores
                linear[r] = False
                timelines = [trace(b, s) for b, s in pts]
            else:
                three, check, rest = linear_token_points(pts)
                timelines = [trace(b, s) for b, s in three]
                if linear[r] is None:
                    extra = trace(*check)
                    linear[r] = timeline_on_fit(timelines, three, LINEAR_COLUMNS, extra, check)
                    if not linear[r]:
                        timelines, pts = [*timelines, extra, trace(*rest)], [*three, check, rest]
                if linear[r]:
                    pts, cols = three, LINEAR_COLUMNS
            cols = list(range(len(BASIS_NAMES))) if cols is None else cols
            fitted_points[r] = pts
            main_fits[r] = (timelines, pts, cols)
            return envelope_pieces(timelines, pts, grid, cols)

        with prepared_model(small_config(self.hf_config, depth), self.probe) as run:
            attention = run.training.attention.value
            opt = run.make_optimizer()
            _prime_optimizer(run.model, opt)
            trace = functools.partial(_traced_at, run, opt, replay=OptimizerReplay())
            for c in (0, n):
                checkpoint_as_applied(run.model, run.layers, list(range(depth if c else 0)), self.reentrant)
                for r, ((pts, grid, cols), coef) in enumerate(zip(self.regimes, coefs)):
                    coef[(n, c)] = fit(r, pts, grid, cols, trace, attention)
            close_optimizer(opt)
            del opt, trace
        return {"coef": coefs, "linear": linear, "points": fitted_points, "attention": attention}


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _fork_available() -> bool:
    """Linux (fork is the start method there and safe for a process whose torch ran only under fake tensors) with at
    least two CPUs for this process."""
    import os
    import sys

    return sys.platform == "linux" and _cpus() >= 2 and hasattr(os, "fork")


def _can_fork() -> bool:
    """Whether a small model may be traced in a forked process: :func:`_fork_available`, and a CPU to spare: the
    1-minute load average (``os.getloadavg``, which counts this process while it traces) below the CPU count. On a
    busy machine the forked half gets no CPU of its own and the fork only costs: copying the page tables of a
    process that imported PyTorch, and copy-on-write faults (``tests/test_phases.py`` and ``tests/test_frozen.py``
    on 2 cores beside another test worker: 106 s wall, 205 s CPU forking; 93 s and 179 s not)."""
    import os

    return _fork_available() and os.getloadavg()[0] < _cpus()


def _die_with_parent(parent_pid: int) -> None:
    """Have Linux kill this process when its parent ends (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, prctl(2)): the
    service kills a trace past its time limit, and this half of it must not run on."""
    import ctypes
    import os
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent ended before the call
        os._exit(1)


class _Forked:
    """``target(*args)`` (a :meth:`_TracePlan.trace_model`) running in a process forked with ``os.fork`` (the
    service's tracing process is a daemonic ``multiprocessing`` process, which may not start ``multiprocessing``
    children). The result comes back through a pipe as JSON (no pickle)."""

    def __init__(self, target, *args) -> None:
        import os

        parent_pid = os.getpid()
        read_fd, write_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(read_fd)
                _die_with_parent(parent_pid)
                torch.set_num_threads(1)
                try:
                    out = target(*args)
                    out["coef"] = [[[n, c, v] for (n, c), v in coef.items()] for coef in out["coef"]]
                    msg = {"ok": out}
                except Exception as err:  # noqa: BLE001 - the parent traces this model itself
                    msg = {"error": f"{type(err).__name__}: {err}"}
                with os.fdopen(write_fd, "wb") as f:
                    f.write(json.dumps(msg).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_fd)
        self.read_fd = read_fd

    def kill(self) -> None:
        import os
        import signal

        os.kill(self.pid, signal.SIGKILL)
        os.close(self.read_fd)
        os.waitpid(self.pid, 0)

    def result(self) -> dict[str, Any] | None:
        """The forked trace's result, or None when it failed (the caller traces that model itself)."""
        import os

        with os.fdopen(self.read_fd, "rb") as f:
            data = f.read()
        os.waitpid(self.pid, 0)
        msg = json.loads(data) if data else {"error": "the forked trace ended without a result"}
        if "ok" not in msg:
            log.warning("tracing the larger small model in a forked process failed (%s); tracing it here", msg["error"])
            return None
        out = msg["ok"]
        out["coef"] = [{(n, c): v for n, c, v in coef} for coef in out["coef"]]
        out["points"] = [[tuple(p) for p in pts] for pts in out["points"]]
        return out


def trace_terms(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    *,
    points: list[tuple[int, int]] | None = None,
    micro_batch_one: bool = True,
    parallel: bool = True,
    generation: str | None = None,
) -> PhaseTerms:
    """Trace the four small models of ``hf_config`` under ``training`` and fit per-phase coefficients.

    ``generation`` (``"sm80"``, ``"sm86"``, ``"sm89"``, ``"sm90"``; default None: the CPU's kernels): trace the steps
    as that GPU generation's CUDA run executes them (:func:`tracer.cuda_policy.cuda_step_semantics`: the SDPA
    backend, CUDA autocast lists, fused dropout, CUDA's softmax backward); the terms are then keyed with it
    (:func:`model.terms.key_generation`).

    ``training``'s micro-batch size, sequence length, checkpoint layers, offload settings and pipeline and
    context parallel sizes are ignored (the traced points and :data:`VARIANTS` replace the first three;
    offload is composed on these terms by :mod:`model.offload`, pipeline and context parallelism by
    :mod:`model.parallel`); everything else (precision, optimizer, sharding,
    attention, fine-tuning) is traced as given. ``micro_batch_one`` (default): also give micro-batch 1
    coefficients of its own (``mb1_coef``, and ``long_mb1_coef`` past a sliding window), which
    :func:`model.compose.compose_terms` uses for b = 1 instead of the b >= 2 fit. Per regime and small model, one
    trace at b = 1 and the regime's longest length checks whether b = 1 is on the b >= 2 fit
    (:func:`micro_batch_one_on_fit`); where it is, the fit gives them, else two more lengths are traced (one when
    the b >= 2 regime is linear in tokens) and b = 1 is fitted on its own. ``points`` (default
    :func:`token_points`): trace exactly these and fit all five basis columns (and micro-batch 1 on its own traces);
    without it, a regime whose first trace is linear in tokens is traced at three points
    (:func:`linear_token_points`, :func:`timeline_on_fit`). ``parallel`` (default): on Linux with two CPUs or more,
    one of them to spare (:func:`_can_fork`), the larger small model is traced in a forked process while this one
    traces the smaller (``benchmarks/results/trace_time.txt``); the terms are the same either way.

    Raises:
        ValueError: a configuration the collector cannot run (see :func:`tracer.collect.prepared_model`).
        RuntimeError: a phase boundary could not be found in the model's forward.
    """
    if generation is not None:
        from tracer.cuda_policy import cuda_step_semantics

        with cuda_step_semantics(generation):
            return trace_terms(hf_config, training, points=points, micro_batch_one=micro_batch_one, parallel=parallel)
    t0 = time.perf_counter()
    # offload is composed on the terms without it (model.offload), pipeline and context parallelism per stage
    # and per sequence chunk (model.parallel); the terms key holds none of them
    # (an offloaded optimizer accumulates gradients in host memory: its base is traced without accumulation)
    # (context parallel: the states are sharded over data x context-parallel ranks, traced as that many data ranks)
    training = training.model_copy(
        update={
            "offload_optimizer": Offload.NONE,
            "offload_parameters": Offload.NONE,
            "data_parallel_size": training.sharding_group_size,
            "pipeline_parallel_size": 1,
            "context_parallel_size": 1,
            "num_micro_batches": None,
            "gradient_accumulation_steps": 2 if training.accumulates_gradients else 1,
        }
    )
    w = None if points else sliding_window_threshold(hf_config)
    regimes = [(points or token_points(hf_config), _pruning_grid(hf_config, hi=(w - 1) if w else None))]
    if w is not None:
        regimes.append((token_points(hf_config, long=True), _pruning_grid(hf_config, lo=w)))
    # micro-batch 1 on its own: some reshapes are views there and copies from b = 2 on (and saved tensors
    # differ), so b = 1 is not on the b >= 2 polynomial (FSDP + LoRA on pythia-160m: +6 MiB per layer at s = 1024)
    regimes = [(pts, grid, None) for pts, grid in regimes]
    if micro_batch_one:
        regimes += [
            ([(1, s) for s in sorted({s for _, s in pts})][:3], grid[grid[:, 1] == grid[:, 2]], [0, 2, 4])
            for pts, grid, _ in regimes
        ]
    probe = training.model_copy(
        update={"micro_batch_size": 1, "seq_len": min(p[1] for p in regimes[0][0]), "checkpoint_layers": []}
    )
    period = layer_period(hf_config)
    depths = traced_depths(period, training.sharding)
    n_poly = 2 if w is not None else 1  # the b >= 2 regimes (below and from a sliding window); mb1 ones follow
    plan = _TracePlan(
        hf_config,
        probe,
        regimes,
        n_poly,
        training.checkpoint_impl is CheckpointImpl.REENTRANT,
        forced_points=points is not None,
    )
    # the two small models are independent: the larger one is traced in a forked process while this one traces
    # the smaller (each decides linearity on its own first trace; they agree, or both are traced again at all
    # five points)
    other = None
    if parallel and _can_fork():
        plan.warm_up()
        other = _Forked(plan.trace_model, 2, depths[1])
    try:
        mine = plan.trace_model(1, depths[0])
    except BaseException:
        if other is not None:
            other.kill()
        raise
    theirs = other.result() if other is not None else None
    if theirs is None:
        theirs = plan.trace_model(2, depths[1], mine["linear"])
    elif theirs["linear"] != mine["linear"]:
        forced = [False] * n_poly
        mine, theirs = plan.trace_model(1, depths[0], forced), plan.trace_model(2, depths[1], forced)
    coefs = [{**a, **b} for a, b in zip(mine["coef"], theirs["coef"])]
    attention, fitted_points = mine["attention"], mine["points"]
    mb1 = coefs[n_poly:] if micro_batch_one else [None, None]
    return PhaseTerms(
        coef=coefs[0],
        points=fitted_points[0],
        attention=attention,
        trace_s=time.perf_counter() - t0,
        period=period,
        long_coef=coefs[1] if w is not None else None,
        long_min_seq_len=w,
        depths=depths,
        mb1_coef=mb1[0],
        long_mb1_coef=mb1[1] if w is not None else None,
    )
