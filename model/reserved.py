"""The fit decision as the GPU makes it: does the step's allocation stream run in the caching allocator?

A step runs out of memory when PyTorch's caching allocator cannot *reserve* a segment for a request, not
when the *allocated* bytes reach the card's size (issue 27: both of its jobs failed with the allocated peak
3.6 GiB under the cap). So the recommended k is the smallest k whose step, replayed through
:class:`model.allocator.CachingAllocatorModel` with the user's allocator settings, does not run out of memory
within

    cap = PyTorch-visible total x (1 - headroom) - memory outside PyTorch

(what ``torch.cuda.set_per_process_memory_fraction`` leaves the allocator). Memory outside PyTorch is the CUDA
context (measured per device, :meth:`model.overhead.OverheadModel.outside_pytorch`) plus NCCL's buffers when
``gpu_count > 1``. The cuBLAS workspaces are in the stream (``tracer.allocation.SM90_WORKSPACES``).

**Where the full model's stream comes from.** ``tracer.stream_source.stream_source``: the full model's step
(build, warm-up step, measured step, exactly as the GPU validation runs it) composed from a small template
model's, recorded once with layer labels (:mod:`model.stream_compose`: 5-10 layers for a period-1 model,
milliseconds per k), or traced whole on fake tensors where no template applies (about 0.1 s per decoder layer
of an 8B model). Streams and templates are cached on disk. The search visits few k (:func:`search_k`): it
starts at the k the measured allowance gives, never below the smallest k whose allocated bound fits (reserved
>= allocated, so nothing below can run), and gallops down or up to the boundary; a cached configuration
answers in milliseconds (the decision is cached in memory by the caller).

**Default allocator: one largest request of room.** Replaying the fake trace, the default allocator runs at
caps where the GPU ran out of memory: Llama-3-8B k = 21 needs 75.9 GiB simulated but failed at 78.59 GiB on
the H200; the LoRA job k = 28 needs 19.9 GiB simulated but failed at 22.90 GiB; k = 25 needs 24.6 simulated but
failed at 25.25 (issue 27's table). Each gap is less than one largest request of the step (the fp32 logits,
3.91 GiB), and the GPU's message named that request. Until GPU allocator traces
(``python -m training.gpu_fit_check --out`` then ``--replay-traces``) show which cached segment the real run
could not reuse, the default allocator's simulated step must run within the cap less its largest request
(:func:`default_allocator_allowance_bytes`); with ``expandable_segments:True`` the simulation matched the GPU
(19 and 25) and no allowance is added.

**Where no stream can be had** (several GPUs, sharding, offload, pipeline, tensor or context parallelism,
quantized bases, ``layout="even"``, a model the recorder cannot build, or a stream not recorded yet), the decision
takes the reserved peak as the resident model states plus the rest of the allocated upper bound times the reserved /
allocated ratio measured for that allocator setting (:meth:`model.overhead.OverheadModel.allowance_ratio`: the median
of ``training/gpu_pressure.py``'s unconstrained runs), keeps the same room free as the simulation
(:func:`allocator_room_bytes` of :func:`model.analytic.largest_request_bytes`), and the answer's notes say so. On the
24 default-allocator pressure runs (H200, 2026-11-30) that figure is at or above the smallest cap the step ran under
in 22 (``python -m benchmarks.allocator_reserved``), and in 18 of the 20 expandable-segments runs (the others 0.04
and 0.30 GiB below).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from model.allocator import GIB, MIB, AllocationStream, AllocatorSettings, ReplayResult, replay

#: k -> the full model's allocation stream with its first k layers checkpointed, or None when none can be had
StreamSource = Callable[[int], AllocationStream | None]


def allocator_room_bytes(largest_request_bytes: int, settings: AllocatorSettings) -> int:
    """Room the step must leave free under the cap (bytes): its largest single request with the default allocator
    (no expandable segments), 0 with expandable segments. Calibrated on issue 27's four GPU observations (module
    docstring). The one rule of both decisions: :func:`simulated_fit` (the stream's largest request) and
    :func:`allowance_fit` (:func:`model.analytic.largest_request_bytes`)."""
    return 0 if settings.expandable_segments else largest_request_bytes


def default_allocator_allowance_bytes(stream: AllocationStream, settings: AllocatorSettings) -> int:
    """:func:`allocator_room_bytes` of a recorded step: its largest request after the warm-up step."""
    return allocator_room_bytes(max(stream.sizes[stream.measured_from :] or stream.sizes or [0]), settings)


@dataclass
class SimulatedStep:
    """One k's step replayed at the cap.

    Attributes (bytes): ``reserved_bytes``: peak reserved of the measured step without a cap (what
    ``max_memory_reserved`` reports with memory to spare); ``allocated_bytes``: its allocated peak; ``runs``:
    no simulated out-of-memory at ``cap - allowance``; ``allowance_bytes``: the room kept free;
    ``oom_request_bytes``: what the failing allocation tried to allocate (None when it runs).
    """

    k: int
    reserved_bytes: int
    allocated_bytes: int
    runs: bool
    allowance_bytes: int
    oom_request_bytes: int | None = None
    #: the smallest cap it runs at (:func:`running_cap_bytes`): the k = L step's, when nothing runs and
    #: :attr:`ReservedFit.shortfall_bytes` is read
    running_cap_bytes: int | None = None


def simulate_step(stream: AllocationStream, settings: AllocatorSettings, cap_bytes: int, k: int) -> SimulatedStep:
    """Replay ``stream`` uncapped (its reserved peak) and at ``cap_bytes`` less the allowance (does it run)."""
    allowance = default_allocator_allowance_bytes(stream, settings)
    free: ReplayResult = replay(stream, settings)
    if cap_bytes - allowance <= 0:
        return SimulatedStep(k, free.peak_reserved_bytes, free.peak_allocated_bytes, False, allowance, None)
    capped = replay(stream, settings, cap_bytes - allowance)
    return SimulatedStep(
        k, free.peak_reserved_bytes, free.peak_allocated_bytes, not capped.oom, allowance, capped.oom_request_bytes
    )


#: how close :func:`running_cap_bytes` finds the smallest cap: the caching allocator's large-segment rounding
RUNNING_CAP_RESOLUTION_BYTES = 2 * MIB


def running_cap_bytes(stream: AllocationStream, settings: AllocatorSettings, step: SimulatedStep) -> int:
    """The smallest cap (bytes, within :data:`RUNNING_CAP_RESOLUTION_BYTES` above it) at which ``step`` runs: capped
    replays bisected between its allocated peak (below it nothing runs) and its uncapped reserved peak (it runs),
    each plus the room kept free. A capped step can run below its uncapped reserved peak: before an allocation fails,
    the caching allocator frees its cached blocks and tries again (``c10/cuda/CUDACachingAllocator.cpp``
    ``release_cached_blocks``), which the replay models.
    """
    bad = step.allocated_bytes + step.allowance_bytes - 1
    good = max(step.reserved_bytes + step.allowance_bytes, bad + 1)
    while good - bad > RUNNING_CAP_RESOLUTION_BYTES:
        mid = (good + bad) // 2
        if replay(stream, settings, mid - step.allowance_bytes).oom:
            bad = mid
        else:
            good = mid
    return good


def search_k(runs: Callable[[int], bool], lo: int, hi: int, guess: int | None = None) -> int | None:
    """The smallest k in ``[lo, hi]`` for which ``runs(k)`` holds, taking ``runs`` as monotone (more checkpointed
    layers never need more memory); None when nothing in the range runs.

    Starts at ``guess`` (clamped to the range; default ``lo``) and gallops: down by 1, 2, 4, ... while k runs, up by
    1, 2, 4, ... while it does not, then bisects the last gap. With a good guess (the measured allowance's k) the
    boundary is one or two calls away, and each call may cost a full-model trace.
    """
    if lo > hi:
        return None
    g = min(max(lo if guess is None else guess, lo), hi)
    if runs(g):
        good, bad, step = g, lo - 1, 1
        while good > lo:
            probe = max(good - step, lo)
            if not runs(probe):
                bad = probe
                break
            good, step = probe, 2 * step
    else:
        bad, good, step = g, None, 1
        while good is None:
            probe = min(bad + step, hi)
            if runs(probe):
                good = probe
            elif probe == hi:
                return None
            else:
                bad, step = probe, 2 * step
    while good - bad > 1:
        mid = (good + bad) // 2
        if runs(mid):
            good = mid
        else:
            bad = mid
    return good


@dataclass
class ReservedFit:
    """The fit decision on reserved memory.

    Attributes:
        method: ``simulated`` (the caching-allocator model replayed the step) or ``allowance`` (allocated bound
            times the measured pressure ratio; no stream).
        settings: the allocator settings assumed.
        cap_bytes: what the allocator may reserve: usable bytes less memory outside PyTorch.
        k: the smallest k that runs (None: none).
        reserved_bytes: predicted peak reserved bytes per k, None where not computed (the simulated search
            visits a few k; the allowance covers every k).
        steps: the simulated steps, per k visited.
        notes: what the answer should say about the decision.
        allowance_room_bytes: ``allowance``: the room kept free under ``cap_bytes`` (:func:`allocator_room_bytes`).
    """

    method: str
    settings: AllocatorSettings
    cap_bytes: int
    k: int | None
    reserved_bytes: list[int | None]
    steps: dict[int, SimulatedStep] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    allowance_room_bytes: int | None = None
    #: ``simulated``: the streams replayed, for the shortfall's smallest running cap (found when first read)
    streams: StreamSource | None = None

    def runs_at(self, k: int) -> bool:
        """Whether the step at k runs by this decision's test, the test that picked :attr:`k`: the smallest
        running k. ``allowance``: the figure at k fits :attr:`cap_bytes`. ``simulated``: k >= the chosen k, the
        monotone order the search (:func:`search_k`) assumes; every visited step agrees with it."""
        if self.method == "allowance":
            reserved = self.reserved_bytes[k]
            return reserved is not None and reserved + (self.allowance_room_bytes or 0) <= self.cap_bytes
        return self.k is not None and k >= self.k

    @property
    def room_bytes(self) -> int | None:
        """What the step had to leave free under :attr:`cap_bytes` (the default allocator's largest request,
        :func:`allocator_room_bytes`): the simulated steps' or the allowance's; None where neither was computed."""
        if self.method == "allowance":
            return self.allowance_room_bytes
        return max((s.allowance_bytes for s in self.steps.values()), default=None)

    @property
    def shortfall_bytes(self) -> int:
        """When nothing runs: how far the k = L step is over the cap, at least 1 byte; 0 when a k runs. Simulated:
        the smallest cap the step runs at (:func:`running_cap_bytes`) less the cap; allowance: its reserved figure
        plus the room less the cap."""
        if self.k is not None:
            return 0
        last = len(self.reserved_bytes) - 1
        step = self.steps.get(last)
        if step is not None:
            if step.running_cap_bytes is None and not step.runs and self.streams is not None:
                step.running_cap_bytes = running_cap_bytes(self.streams(last), self.settings, step)
            needed = step.running_cap_bytes or step.reserved_bytes + step.allowance_bytes
            return max(1, needed - self.cap_bytes)
        reserved = self.reserved_bytes[last]
        return max(1, (reserved or 0) + (self.allowance_room_bytes or 0) - self.cap_bytes)


def simulated_fit(
    upper_bytes: Sequence[int],
    streams: StreamSource,
    settings: AllocatorSettings,
    cap_bytes: int,
    guess: int | None = None,
) -> ReservedFit | None:
    """Smallest k whose simulated step runs within ``cap_bytes`` and whose allocated upper bound fits it.

    Args:
        upper_bytes: the calibrated upper bound of allocated bytes per k = 0..L (the curve's).
        streams: the full model's stream per k (:data:`StreamSource`).
        settings: allocator settings.
        cap_bytes: usable bytes less memory outside PyTorch.
        guess: where the search starts (:func:`search_k`), e.g. the measured allowance's k.

    Returns:
        The decision, or None when ``streams`` gives no stream for a k the search needs (the caller falls back).
    """
    num = len(upper_bytes)
    steps: dict[int, SimulatedStep] = {}
    missing: list[int] = []

    def runs(k: int) -> bool:
        if k not in steps:
            stream = streams(k)
            if stream is None:
                missing.append(k)
                raise LookupError(k)
            steps[k] = simulate_step(stream, settings, cap_bytes, k)
        return steps[k].runs

    lo = next((k for k, u in enumerate(upper_bytes) if u <= cap_bytes), num)
    try:
        k = search_k(runs, lo, num - 1, guess) if lo < num else None
        if k is None and num - 1 not in steps:
            runs(num - 1)  # the shortfall is reported at k = L (its smallest running cap: when the answer reads it)
    except LookupError:
        return None
    reserved: list[int | None] = [None] * num
    for j, s in steps.items():
        reserved[j] = s.reserved_bytes
    visited = ", ".join(str(j) for j in sorted(steps))
    first = (
        f"fit decided by replaying the step through a model of PyTorch's caching allocator "
        f"({settings.describe()} settings) at {cap_bytes / GIB:.2f} GiB for the allocator (k visited: {visited})"
    )
    fit = ReservedFit("simulated", settings, cap_bytes, k, reserved, steps, [first], streams=streams)
    if not settings.expandable_segments:
        fit.notes.append(
            "default allocator: the step must run with its largest request "
            f"({(fit.room_bytes or 0) / GIB:.2f} GiB) left free: capped H200 runs ran out of memory within "
            "one largest request of the simulated cap; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True needs no "
            "such room"
        )
    return fit


def allowance_fit(
    upper_bytes: Sequence[int],
    settings: AllocatorSettings,
    cap_bytes: int,
    ratio: float,
    source: str,
    why: str,
    largest_request_bytes: int = 0,
    states_bytes: int = 0,
) -> ReservedFit:
    """Fallback without a stream: the reserved peak per k (bytes) is the resident model states (``states_bytes``,
    allocated once before the step in blocks of their own) plus the rest of the allocated upper bound x ``ratio``
    (the measured reserved / allocated ratio of ``settings``); the smallest k whose figure fits ``cap_bytes`` with
    :func:`allocator_room_bytes` of ``largest_request_bytes`` (:func:`model.analytic.largest_request_bytes`) left
    free, as :func:`simulated_fit` keeps it. ``why`` says why no stream was simulated."""
    room = allocator_room_bytes(largest_request_bytes, settings)
    s = states_bytes
    reserved: list[int | None] = [u if u <= s else s + int((u - s) * ratio) for u in upper_bytes]
    limit = cap_bytes - room
    k = next((j for j, r in enumerate(reserved) if r <= limit), None)
    states = "the model states plus the rest of " if states_bytes else ""
    note = (
        f"allocator not simulated ({why}): reserved memory taken as {states}the allocated bound x {ratio:.3f} "
        f"({source}, {settings.describe()} allocator settings)"
    )
    if room:
        note += f", with the largest request ({room / GIB:.2f} GiB, the fp32 logits or a weight's gradient) left free"
    return ReservedFit("allowance", settings, cap_bytes, k, reserved, {}, [note], allowance_room_bytes=room)
