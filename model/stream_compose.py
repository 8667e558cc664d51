"""A deep model's allocation stream composed from a shallow model's, layer by layer.

The fit decision (:mod:`model.reserved`) replays the full model's step through the caching-allocator model at a
few k. Tracing the full model for each k costs seconds (about 0.1 s per decoder layer of an 8B model); this
module builds the stream of an L-layer model with its first k layers checkpointed from the stream of one small
*template* model of the same architecture, recorded with layer labels
(:attr:`model.allocator.AllocationStream.layer_labels`), in milliseconds.

**Template.** For each of the two parts of the target (the k checkpointed layers, the L - k others), the
template keeps the part's first two and last two layers and, between them, one full period of layer types, and
more where the first layer of a type would otherwise be repeated (:func:`template_part_layers`); a shorter part is
kept whole. So every target layer has a template layer of the same checkpointing, the same layer type (index mod
``period``) and the same neighbours up to two layers away: the first and last layers of the model and of each part
are where the events differ (the embedding's output, the loss, the hidden state handed from a checkpointed to a
plain layer).

**Composition.** Each phase of the template (build, forward, backward, optimizer step, per step) is a sequence
of *runs* of one label. A *sweep* is a run of consecutive layer labels, up (build, forward, optimizer) or down
(backward; foreach temporaries). Its first and last labels must be edge layers, each standing for exactly one
target layer (the first and last layers of the model and of each part, and their neighbours); the target
layers between them copy the template run of their template layer (:func:`layer_templates`). A single run (a
layer's output freed after the last layer's forward has returned) is a sweep of one. Runs labelled -1
(embedding, head, loss, allocator workspaces) are copied once. Every allocation gets a new handle; a free names
the allocation at the same place (phase, sweep, ordinal within its run) of the layer at the same distance
from its own layer as in the template.

Checked while composing, else :class:`CompositionError` (the caller traces the full model instead): every
labelled run lies in a sweep or maps to a layer with that template; every free finds its allocation, of the
template's size, live. ``tests/test_stream_compose.py`` compares composed streams with full traces, event by
event, for several architectures, precisions, optimizers and k. The stream source does not compose where a
layer differs by its index rather than its type (frozen leading layers), for mixtures of experts, or with
reentrant checkpointing (``tracer.stream_source.template_path``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from model.allocator import AllocationStream

#: layers kept at each end of a part (the first and last layers differ from the inner ones)
EDGE_LAYERS = 2


class CompositionError(ValueError):
    """The template's events do not compose into the target (the caller records the full model instead)."""


def template_part_layers(part_layers: int, period: int, start: int = 0) -> int:
    """Layers the template keeps of a part of ``part_layers`` layers that starts at the model's layer ``start``.

    The part's middle (all but :data:`EDGE_LAYERS` at each end) is copied from the template's middle, whose last
    period the part's longer middle repeats (:func:`_part_index`). That repeated period must not hold the first
    layer of any type in the model (layers below ``period``): in backward the first layer of a type frees what
    the model computed once for all layers of that type (Gemma-3's global-attention layers), and a repeated copy
    would free it twice. So the template's middle keeps at least one period, and at least up to model layer
    ``2 * period`` less the edge layers below it; a part no longer than that is kept whole; else the fewest layers at
    least that many with the same remainder mod ``period``, so that the part's last layer has the target's last
    layer type.

    Raises:
        ValueError: ``part_layers`` < 0, ``period`` < 1 or ``start`` < 0.
    """
    if part_layers < 0 or period < 1 or start < 0:
        raise ValueError(f"part_layers and start must be >= 0 and period >= 1, got {part_layers}, {start}, {period}")
    least = 2 * EDGE_LAYERS + max(period, 2 * period - EDGE_LAYERS - start)
    if part_layers <= least:
        return part_layers
    return least + (part_layers - least) % period


def template_shape(num_layers: int, k: int, period: int) -> tuple[int, int]:
    """``(template layers, template k)`` for a target of ``num_layers`` layers with its first ``k`` checkpointed.

    Raises:
        ValueError: ``k`` outside ``[0, num_layers]``.
    """
    if not 0 <= k <= num_layers:
        raise ValueError(f"k must be in [0, {num_layers}], got {k}")
    kc = template_part_layers(k, period)
    return kc + template_part_layers(num_layers - k, period, start=k), kc


def _part_index(j: int, part: int, kept: int, period: int) -> int:
    """The template layer (index within the part's ``kept`` template layers) that the part's layer ``j`` copies:
    the edge layers their own; an inner layer ``d`` of the part's middle the template's middle layer ``d`` while
    there is one, then the template middle's last period over and over (the middle holds
    ``kept - 2 * EDGE_LAYERS`` layers, at least one period, of the same length mod ``period`` as the part's), so
    every template layer is copied, by layers of its type, and the middle's last layer copies the template
    middle's last."""
    if j < EDGE_LAYERS or part == kept:
        return j
    if j >= part - EDGE_LAYERS:
        return kept - (part - j)
    d, middle = j - EDGE_LAYERS, kept - 2 * EDGE_LAYERS
    if d >= middle:
        d = middle - period + (d - middle + period) % period
    return EDGE_LAYERS + d


def layer_templates(num_layers: int, k: int, period: int) -> list[int]:
    """Per target layer, the template layer whose events it copies (see the module docstring)."""
    n, kc = template_shape(num_layers, k, period)
    out = [_part_index(i, k, kc, period) for i in range(k)]
    out += [kc + _part_index(j, num_layers - k, n - kc, period) for j in range(num_layers - k)]
    return out


@dataclass
class _Piece:
    runs: list[tuple[int, int, int]]  # (label, start, end) per run, template events [start, end)
    targets: list[int | None]  # per target run: its layer (None: the run is label -1, copied once)


def _runs(labels: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    j = start
    while j < end:
        e = j + 1
        while e < end and labels[e] == labels[j]:
            e += 1
        runs.append((labels[j], j, e))
        j = e
    return runs


def _pieces(runs: list[tuple[int, int, int]], t_of: list[int]) -> list[_Piece]:
    """Runs grouped into sweeps (consecutive labels, step +1 or -1) mapped onto target layers: a sweep's first
    and last labels are template layers that stand for exactly one target layer each, and the target layers
    between them copy the sweep's runs by :func:`layer_templates`."""
    stands_for: dict[int, list[int]] = {}
    for layer, t in enumerate(t_of):
        stands_for.setdefault(t, []).append(layer)
    pieces: list[_Piece] = []
    i = 0
    while i < len(runs):
        label = runs[i][0]
        if label == -1:
            pieces.append(_Piece([runs[i]], [None]))
            i += 1
            continue
        j, step = i + 1, 0
        if j < len(runs) and runs[j][0] != -1 and abs(runs[j][0] - label) == 1:
            step = runs[j][0] - label
            while j < len(runs) and runs[j][0] != -1 and runs[j][0] == runs[j - 1][0] + step:
                j += 1
        seq = runs[i:j]
        ends = [stands_for.get(seq[0][0], []), stands_for.get(seq[-1][0], [])]
        if any(len(e) != 1 for e in ends):
            raise CompositionError(
                f"template layers {seq[0][0]}..{seq[-1][0]}: a sweep must start and end at a layer of the model's "
                "or a part's edge"
            )
        first, last = ends[0][0], ends[1][0]
        targets = list(range(first, last + 1)) if step >= 0 else list(range(first, last - 1, -1))
        if step and (last - first) * step < 0 or {t_of[t] for t in targets} != {r[0] for r in seq}:
            raise CompositionError(
                f"template layers {seq[0][0]}..{seq[-1][0]} do not cover target layers {first}..{last}"
            )
        pieces.append(_Piece(seq, targets))
        i = j
    return pieces


def compose(template: AllocationStream, template_k: int, num_layers: int, k: int, period: int) -> AllocationStream:
    """The stream of ``num_layers`` layers with the first ``k`` checkpointed, from ``template``.

    Args:
        template: a labelled stream (:attr:`AllocationStream.layer_labels`) of the same architecture and
            training configuration with ``template_shape(num_layers, k, period)`` layers and ``template_k``
            checkpointed.
        template_k: the template's checkpointed layers.
        num_layers / k: the target.
        period: the architecture's layer-type period (``memfit.hf.layer_period``).

    Returns:
        The composed stream, labelled; ``meta`` is the template's with ``composed_from`` added.

    Raises:
        CompositionError: the template is unlabelled, of another shape, or its events do not compose
            (module docstring).
    """
    labels = template.layer_labels
    if labels is None:
        raise CompositionError("the template stream has no layer labels")
    n = max(labels, default=-1) + 1
    if (n, template_k) != template_shape(num_layers, k, period):
        raise CompositionError(
            f"template of {n} layers, k = {template_k}; {num_layers} layers at k = {k} need "
            f"{template_shape(num_layers, k, period)}"
        )
    t_of = layer_templates(num_layers, k, period)
    marks = [at for at, _ in template.phases]
    if not marks or marks[0] != 0:
        marks = [0, *marks]
    if template.measured_from not in (*marks, len(template)):
        raise CompositionError(f"the measured step starts inside a phase (event {template.measured_from})")
    bounds = [*marks, len(template)]
    sections = [_pieces(_runs(labels, a, b), t_of) for a, b in pairwise(bounds)]

    # where each template allocation is: (section, piece, template label or None, ordinal in its run)
    where: dict[int, tuple[int, int, int | None, int]] = {}
    for s, pieces in enumerate(sections):
        for q, p in enumerate(pieces):
            for label, a, b in p.runs:
                ordinal = 0
                for e in range(a, b):
                    if template.sizes[e]:
                        where[template.handles[e]] = (s, q, None if label == -1 else label, ordinal)
                        ordinal += 1

    handles: list[int] = []
    sizes: list[int] = []
    out_labels: list[int] = []
    phases: list[tuple[int, str]] = []
    names = dict(template.phases)
    placed: dict[tuple[int, int, int | None, int], tuple[int, int]] = {}  # -> (new handle, size)
    live: set[int] = set()
    measured_from = 0

    def emit(s: int, q: int, run: tuple[int, int, int], layer: int | None, tlabel: int | None) -> None:
        _, a, b = run
        ordinal = 0
        for e in range(a, b):
            size = template.sizes[e]
            if size:
                h = len(placed) + 1
                placed[(s, q, layer, ordinal)] = (h, size)
                ordinal += 1
                live.add(h)
                handles.append(h)
                sizes.append(size)
                out_labels.append(-1 if layer is None else layer)
                continue
            found = where.get(template.handles[e])
            if found is None:
                raise CompositionError(f"template event {e} frees an allocation the template never made")
            sa, qa, la, oa = found
            if la is None:
                key = (sa, qa, None, oa)
            elif layer is None or tlabel is None:
                raise CompositionError(f"template event {e} frees a layer's allocation outside any layer")
            else:
                key = (sa, qa, layer + la - tlabel, oa)
            got = placed.get(key)
            template_size = template.sizes[_alloc_event[template.handles[e]]]
            if got is None or got[1] != template_size or got[0] not in live:
                raise CompositionError(f"template event {e}'s free has no matching live allocation in the target")
            live.discard(got[0])
            handles.append(got[0])
            sizes.append(0)
            out_labels.append(-1 if layer is None else layer)

    _alloc_event = {h: e for e, (h, size) in enumerate(zip(template.handles, template.sizes)) if size}
    for s, pieces in enumerate(sections):
        start = bounds[s]
        if start in names:
            phases.append((len(sizes), names[start]))
        if start == template.measured_from:
            measured_from = len(sizes)
        for q, p in enumerate(pieces):
            by_label = {run[0]: run for run in p.runs}
            for layer in p.targets:
                if layer is None:
                    emit(s, q, p.runs[0], None, None)
                else:
                    run = by_label[t_of[layer]]
                    emit(s, q, run, layer, run[0])
    if template.measured_from == len(template):
        measured_from = len(sizes)
    meta = {**template.meta, "composed_from": {"layers": n, "k": template_k, "period": period}}
    return AllocationStream(handles, sizes, measured_from, phases, meta, out_labels)
