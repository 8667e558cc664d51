"""Recommendation: the smallest number k of checkpointed layers whose step runs in the GPU's memory.

For one model and training configuration, :meth:`model.curve.MemoryPredictor.curve` gives the
predicted allocated peak and its calibrated upper bound for all k = 0..L. The fit is decided on reserved
memory (:mod:`model.reserved`): the smallest k whose step, replayed through the caching-allocator model with
the user's ``PYTORCH_CUDA_ALLOC_CONF``, runs within ``capacity × (1 − headroom)`` less the memory outside
PyTorch, and whose allocated bound fits there too; without an allocation stream, the allocated bound times the
measured pressure allowance of the allocator setting. Recompute cost: re-running the forward of k of L layers costs about
k/L of a forward pass, and a forward is about a third of a training step's compute (backward ≈ 2×
forward; Chen et al. 2016, arXiv 1604.06174, Sec. 4; Korthikanti et al. 2022, arXiv 2205.05198, Sec. 5),
so the overhead fraction is ``k / (3 L)``. With the first N layers frozen (``finetune="frozen"``) those
layers have no backward and checkpointing them recomputes nothing (:mod:`model.frozen`): the fraction is
``max(0, k − N) / (L + 2 (L − N))`` (:func:`recompute_fraction`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass

import numpy as np

from memfit.schema import FineTune, ModelSpec, Quantization, Sharding, TrainingConfig
from model.allocator import GIB, AllocatorSettings, unsplit_block_bytes
from model.analytic import largest_request_bytes, weight_dtype_bytes
from model.curve import Curve, CurvePoint, MemoryPredictor
from model.job import ParameterTensors, parameter_tensors
from model.overhead import Overhead, OverheadModel
from model.parallel import stage_layer_counts
from model.reserved import ReservedFit, StreamSource, allowance_fit, simulated_fit


@dataclass
class Plan:
    """Answer for one configuration (bytes per device).

    ``curve`` is the predictor's whole curve; ``total_upper_bytes[k]`` is its bound at k plus the memory
    outside PyTorch, the cuBLAS workspaces and, without a simulated stream, the measured allocator allowance.
    ``reserved`` is the fit decision on reserved memory (:class:`model.reserved.ReservedFit`): its
    ``reserved_bytes[k]`` is the predicted peak reserved bytes (None where the simulated search did not visit k).
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
    reserved: ReservedFit | None = None

    @property
    def shortfall_bytes(self) -> int:
        """When nothing fits: the usable memory missing at k = L, at least 1 byte; 0 when a k fits. The larger of the
        fit's shortfall (under the allocator's cap, clamped at 0: plus the memory outside PyTorch beyond the usable)
        and the bound's over the usable. Read by the answer only: a simulated fit finds its smallest running cap
        then (:attr:`model.reserved.ReservedFit.shortfall_bytes`), not for every alternative planned."""
        if self.k is not None:
            return 0
        outside = self.overhead.cuda_context_bytes + self.overhead.nccl_bytes
        fit = self.reserved.shortfall_bytes if self.reserved is not None else 0
        return max(fit + max(outside - self.usable_bytes, 0), self.total_upper_bytes[-1] - self.usable_bytes, 1)

    @property
    def at(self) -> CurvePoint:
        """The curve point at the recommended k (at k = L when nothing fits)."""
        return self.curve.points[self.k if self.k is not None else len(self.curve.points) - 1]


def layer_indices(k: int, num_layers: int, pipeline_parallel_size: int = 1, method: str = "block") -> list[int]:
    """Which layers to checkpoint: ``block`` = the first layers of each pipeline stage (Megatron's
    ``--recompute-method block``; the stages of :func:`model.parallel.stage_layer_counts`, k shared evenly over
    them, the remainder to the first ones, a full stage's rest to the others), ``even`` = evenly spaced over the model.

    Raises:
        ValueError: k outside [0, num_layers] or an unknown method.
    """
    if not 0 <= k <= num_layers:
        raise ValueError(f"k={k} must be in [0, {num_layers}]")
    if method == "even":
        return sorted({round(x) for x in np.linspace(0, num_layers - 1, k)}) if k else []
    if method != "block":
        raise ValueError(f"method must be 'block' or 'even', got {method!r}")
    if pipeline_parallel_size <= 1:
        return list(range(k))
    counts = stage_layer_counts(num_layers, pipeline_parallel_size)
    take, left, open_ = [0] * len(counts), k, list(range(len(counts)))
    while left:  # an even share per open stage, the remainder to the first ones; a full stage's rest goes round
        share, extra = divmod(left, len(open_))
        for i, s in enumerate(open_):
            give = min(counts[s] - take[s], share + (i < extra))
            take[s], left = take[s] + give, left - give
        open_ = [s for s in open_ if take[s] < counts[s]]
    out, start = [], 0
    for n, t in zip(counts, take):
        out.extend(range(start, start + t))
        start += n
    return out


def recompute_fraction(k: int, num_layers: int, training: TrainingConfig) -> float:
    """Share of a training step's compute spent re-running the forward of the first ``k`` checkpointed layers.

    A layer's forward costs one unit and its backward two (Chen et al. 2016, arXiv 1604.06174, Sec. 4); frozen
    layers (``finetune="frozen"``, the first ``frozen_layers``) run no backward and save nothing to recompute.
    Returns ``max(0, k − N) / (L + 2 (L − N))`` with N frozen layers (N = 0 otherwise): ``k / (3 L)`` unfrozen.
    """
    frozen = training.frozen_layers if training.finetune is FineTune.FROZEN else 0
    step_units = num_layers + 2 * (num_layers - frozen)
    return max(0, k - frozen) / step_units if step_units else 0.0


def parameter_block_bytes(
    model: ModelSpec, training: TrainingConfig, hf_config: dict | None, settings: AllocatorSettings | None = None
) -> int:
    """Bytes ``torch.cuda.memory_allocated`` counts for the parameters beyond their sizes, which no trace sees: the
    constructor allocates every parameter on an empty caching allocator, and a tensor over 10 MiB whose 2 MiB
    rounding leaves at most 1 MiB gets its whole block (:func:`model.allocator.unsplit_block_bytes` over
    :func:`model.job.parameter_tensors` in the stored dtype). GPT-2-large in fp32: its two 25 MiB MLP weights per
    layer hold 1 MiB more each, 72.6 MiB over 36 layers with the embeddings' (the H200 rows' -0.50 % at k = 36).

    0 where the parameters are not allocated one tensor each on an empty allocator as the model declares them, or
    not modelled: sharded (ZeRO, FSDP), tensor-, pipeline- or expert-parallel, or quantized; and without a config
    that builds.
    """
    if (
        hf_config is None
        or training.sharding is not Sharding.NONE
        or training.quantization is not Quantization.NONE
        or max(training.tensor_parallel_size, training.pipeline_parallel_size, training.expert_parallel_size) > 1
    ):
        return 0
    tensors = parameter_tensors(hf_config)
    if tensors is None:
        return 0
    return _parameter_block_bytes(tensors, model.num_layers, weight_dtype_bytes(training.precision), settings)


def allocator_bounds(upper_bytes: Sequence[int], block_bytes: int, overhead_model: OverheadModel) -> list[int]:
    """Allocated bytes the caching allocator holds at each allocated upper bound (bytes, one per k): the bound plus
    the cuBLAS workspaces (the recorded streams hold them too) and the parameters' unsplit blocks (``block_bytes``,
    :func:`parameter_block_bytes`), allocated bytes no trace sees. What :func:`model.reserved.simulated_fit` and
    :func:`model.reserved.allowance_fit` are given."""
    return [u + overhead_model.cublas_workspace_bytes + block_bytes for u in upper_bytes]


@functools.lru_cache(maxsize=1024)
def _parameter_block_bytes(
    tensors: ParameterTensors, num_layers: int, element_bytes: int, settings: AllocatorSettings | None
) -> int:
    """:func:`parameter_block_bytes` once per model shape, dtype and allocator settings (an 80-layer replay costs
    about a millisecond, and every plan of a request asks)."""
    return unsplit_block_bytes((n * element_bytes for n in tensors.in_order(num_layers)), settings)


def plan(
    predictor: MemoryPredictor,
    model: ModelSpec,
    training: TrainingConfig,
    *,
    capacity_bytes: int,
    hf_config: dict | None = None,
    headroom_fraction: float = 0.05,
    device_name: str | None = None,
    gpu_count: int = 1,
    overhead_model: OverheadModel | None = None,
    layout: str = "block",
    allocator: AllocatorSettings | None = None,
    streams: StreamSource | None = None,
    no_stream_reason: str | Callable[[], str] = "no allocation stream for this configuration",
    fit_cache: MutableMapping | None = None,
) -> Plan:
    """Smallest k whose step runs in ``capacity_bytes × (1 − headroom_fraction)`` less the memory outside PyTorch.

    The curve comes from :meth:`model.curve.MemoryPredictor.curve`, the one curve every caller uses. With
    ``streams`` (the full model's allocation stream per k, block layout), the step is replayed through the
    caching-allocator model with ``allocator`` (default: PyTorch's defaults; :func:`model.reserved.simulated_fit`);
    otherwise, or when a stream is missing, the allocated bound times the allocator setting's measured allowance
    (:func:`model.reserved.allowance_fit`; ``no_stream_reason`` says why in the notes: a callable is asked after the
    streams were, so it can say what asking them started). ``fit_cache`` keeps
    simulated decisions by (the source's ``key`` attribute, bounds, settings, cap), so a repeated request replays
    nothing.

    Raises:
        ValueError: headroom outside [0, 0.9] or capacity <= 0.
    """
    if not 0 <= headroom_fraction <= 0.9:
        raise ValueError(f"headroom_fraction={headroom_fraction} must be in [0, 0.9]")
    if capacity_bytes <= 0:
        raise ValueError("capacity_bytes must be > 0")
    overhead_model = overhead_model or OverheadModel()
    settings = allocator or AllocatorSettings()
    c = predictor.curve(model, training, hf_config)
    usable = int(capacity_bytes * (1 - headroom_fraction))
    outside, outside_source = overhead_model.outside_pytorch(device_name, gpu_count)
    nccl = overhead_model.nccl_bytes(gpu_count)
    cap = max(usable - outside, 0)
    if cap == 0:  # no step runs: nothing to replay (nor a stream to record for it)
        streams = None
        no_stream_reason = (
            f"the usable {usable / GIB:.2f} GiB leave nothing for PyTorch beside the {outside / GIB:.2f} GiB outside "
            "it: no k fits"
        )
    blocks = parameter_block_bytes(model, training, hf_config, settings)
    bounds = allocator_bounds([p.upper_bytes for p in c.points], blocks, overhead_model)
    largest = largest_request_bytes(model, training)  # the allowance's room; a simulated step has its stream's
    fit = None
    if streams is not None and c.pipeline is None and layout == "block":
        key = getattr(streams, "key", None)
        cache_key = (key, tuple(bounds), settings, cap) if key is not None and fit_cache is not None else None
        fit = fit_cache.get(cache_key) if cache_key is not None else None
        if fit is None:
            ratio, source = overhead_model.allowance_ratio(settings.expandable_segments)
            guess = allowance_fit(bounds, settings, cap, ratio, source, "", largest, c.floor_bytes).k
            fit = simulated_fit(bounds, streams, settings, cap, len(bounds) - 1 if guess is None else guess)
            if fit is not None and cache_key is not None:
                fit_cache[cache_key] = fit
    elif streams is not None:
        no_stream_reason = "pipeline stages or an even layout: streams are recorded for the first k layers"
    if fit is None:
        ratio, source = overhead_model.allowance_ratio(settings.expandable_segments)
        why = no_stream_reason() if callable(no_stream_reason) else no_stream_reason
        fit = allowance_fit(bounds, settings, cap, ratio, source, why, largest, c.floor_bytes)
    if fit.method == "simulated":
        totals = [b + outside for b in bounds]
    else:
        totals = [r + outside for r in fit.reserved_bytes]
    k = fit.k
    at = k if k is not None else model.num_layers
    if k is None:
        layers = []
    elif c.pipeline is not None:  # per-stage k chosen by the composition: k_i layers of stage i, laid out per stage
        layers = [
            st.first_layer + j
            for st, ks in zip(c.pipeline.stages, c.pipeline.stage_k[k])
            for j in layer_indices(ks, st.num_layers, 1, layout)
        ]
    else:
        layers = layer_indices(k, model.num_layers, training.pipeline_parallel_size, layout)
    allowance = totals[at] - bounds[at] - outside
    overhead = Overhead(
        allowance,
        outside - nccl,
        overhead_model.cublas_workspace_bytes,
        nccl,
        f"outside PyTorch: {outside_source}; allocator: {fit.notes[0]}",
        blocks,
    )
    return Plan(
        fits=k is not None,
        k=k,
        layers=layers,
        curve=c,
        total_upper_bytes=totals,
        capacity_bytes=capacity_bytes,
        usable_bytes=usable,
        overhead=overhead,
        recompute_fraction=recompute_fraction(k or 0, model.num_layers, training),
        reserved=fit,
    )


# -- what fits instead --------------------------------------------------------------------------------
#: categories of change, in ranking order: what the change gives up (``shorter_sequence``: the context the model
#: trains on)
CATEGORIES = ("same_training", "more_hardware", "numerics", "trained_weights", "shorter_sequence")
#: a sequence at least this long is a long context: context parallelism is worth trying, and when nothing fits the
#: alternatives include the longest shorter sequence that fits (:func:`longest_fitting_seq_len`)
LONG_CONTEXT_TOKENS = 8192
#: the shorter sequence lengths tried are multiples of this many tokens
SEQ_LEN_STEP_TOKENS = 1024
#: context-parallel sizes offered over more GPUs at a long context
CONTEXT_PARALLEL_SIZES = (2, 4, 8)
#: heavy recompute: a plan that fits only with more than this share of the layers checkpointed gets alternatives
HEAVY_RECOMPUTE_SHARE = 0.5


@dataclass(frozen=True)
class Candidate:
    """One concrete change to a configuration, before it is planned.

    Attributes:
        description: what to change, in words.
        change: the changed request fields (training fields, ``gradient_accumulation_steps`` among them,
            plus ``gpu_count`` where it changes).
        category: one of :data:`CATEGORIES`.
        throughput_loss_fraction: estimated step-time loss of the change itself (recompute excluded).
        cost: the cost in words, with its source.
    """

    description: str
    change: dict
    category: str
    throughput_loss_fraction: float
    cost: str


def needs_alternatives(p: Plan) -> bool:
    """True when nothing fits, or the fit needs more than :data:`HEAVY_RECOMPUTE_SHARE` of the layers recomputed."""
    return not p.fits or p.k > HEAVY_RECOMPUTE_SHARE * len(p.curve.points[1:])


def candidate_changes(training: TrainingConfig, model: ModelSpec, gpu_count: int) -> list[Candidate]:
    """The changes worth trying for ``training`` on ``gpu_count`` GPUs (unranked; each is planned by the caller).

    Throughput losses are coarse, stated estimates: ZeRO-1/2 move as much data as plain data parallelism
    and ZeRO-3 1.5× as much (Rajbhandari et al. 2020, arXiv 1910.02054, Sec. 7.2); halving the
    micro-batch shrinks every GEMM (about 5 % per halving on a busy GPU); ZeRO-Offload's CPU optimizer
    step and PCIe traffic cost a share of each step (Ren et al. 2021, arXiv 2101.06840, Sec. 6 reports
    about 30-40 % below GPU-only throughput at equal batch); parameter offload moves every layer's
    weights over PCIe in forward and backward (ZeRO-Infinity, arXiv 2104.07857, Sec. 8).
    """
    from memfit.schema import FineTune, Offload, Optimizer, Precision, Quantization, Sharding

    out: list[Candidate] = []
    n = gpu_count
    half_sharded = training.sharding in (Sharding.NONE, Sharding.ZERO1)
    if n > 1 and half_sharded:
        out.append(
            Candidate(
                f"ZeRO-2 over the {n} GPUs",
                {"sharding": "zero2", "data_parallel_size": n},
                "same_training",
                0.0,
                "same communication volume as data parallel (ZeRO paper Sec. 7.2)",
            )
        )
    if n > 1 and training.sharding not in (Sharding.ZERO3, Sharding.FSDP_FULL_SHARD):
        out.append(
            Candidate(
                f"ZeRO-3 / FSDP full-shard over the {n} GPUs",
                {"sharding": "zero3", "data_parallel_size": n},
                "same_training",
                0.05,
                "1.5x data-parallel communication, mostly overlapped (ZeRO paper Sec. 7.2)",
            )
        )
    mb, halvings = training.micro_batch_size, 0
    while mb > 1:
        mb, halvings = mb // 2, halvings + 1
        accumulation = training.gradient_accumulation_steps * (training.micro_batch_size // mb)
        out.append(
            Candidate(
                f"micro_batch_size {mb} with {accumulation}x gradient accumulation (same global batch)",
                {"micro_batch_size": mb, "gradient_accumulation_steps": accumulation},
                "same_training",
                0.05 * halvings,
                f"smaller GEMMs: ~{5 * halvings}% slower steps at the same global batch",
            )
        )
    if training.offload_optimizer is Offload.NONE:
        out.append(
            Candidate(
                "offload the optimizer to CPU (ZeRO-Offload: optimizer states, master weights and "
                "fp32 gradients in host memory)",
                {"offload_optimizer": "cpu"},
                "same_training",
                0.3,
                "CPU optimizer step and PCIe gradient/parameter copies each step: ~30% slower "
                "(ZeRO-Offload, arXiv 2101.06840, Sec. 6); needs the host memory given",
            )
        )
    if training.offload_parameters is Offload.NONE:
        change: dict = {"offload_optimizer": "cpu", "offload_parameters": "cpu"}
        if training.sharding not in (Sharding.ZERO3, Sharding.FSDP_FULL_SHARD):
            change.update({"sharding": "zero3", "data_parallel_size": n} if n > 1 else {"sharding": "none"})
        out.append(
            Candidate(
                "offload parameters and optimizer to CPU (ZeRO-3 offload_param / FSDP2 CPUOffloadPolicy)",
                change,
                "same_training",
                0.6,
                "every layer's weights cross PCIe in forward and "
                "backward: often 2x slower or more (ZeRO-Infinity, arXiv 2104.07857, Sec. 8)",
            )
        )
    # long sequences: context parallelism splits the activations along the sequence (model.parallel); on the same
    # GPUs it takes cp of the data-parallel replicas, and gradient accumulation cp-fold keeps the samples per step
    cp = 1 << (n.bit_length() - 1) if n > 1 else 1
    while cp > 1 and training.seq_len % cp:
        cp //= 2
    if cp > 1 and training.context_parallel_size == 1 and training.seq_len >= 8192:
        within = {
            "context_parallel_size": cp,
            "data_parallel_size": n // cp,
            "gradient_accumulation_steps": training.gradient_accumulation_steps * cp,
        }
        ring = f"ring attention exchanges K/V blocks each layer: ~10% slower; {cp}x gradient accumulation"
        out.append(
            Candidate(
                f"context parallel over {cp} GPUs (activations split along the sequence; {cp}x gradient "
                "accumulation keeps the samples per step)",
                within,
                "same_training",
                0.1,
                ring,
            )
        )
        if training.sharding in (Sharding.NONE, Sharding.ZERO1):  # torchtitan's layout: FSDP over dp x cp ranks
            out.append(
                Candidate(
                    f"context parallel over {cp} GPUs with ZeRO-3 / FSDP full-shard over all {n} "
                    f"({cp}x gradient accumulation keeps the samples per step)",
                    {**within, "sharding": "zero3"},
                    "same_training",
                    0.15,
                    ring + "; 1.5x data-parallel communication",
                )
            )
    if training.context_parallel_size == 1 and training.seq_len >= LONG_CONTEXT_TOKENS:
        # more GPUs, each holding 1/cp of the sequence; the data-parallel size and the sharding group follow the
        # request schema's rules for the new gpu_count (the caller validates the changed request)
        unsharded = training.sharding in (Sharding.NONE, Sharding.ZERO1)
        for cp in (c for c in CONTEXT_PARALLEL_SIZES if training.seq_len % c == 0):
            cost = f"{cp}x the GPUs; ring attention exchanges K/V blocks each layer: ~10% slower"
            out.append(
                Candidate(
                    f"context parallel {cp} over {cp * n} GPUs ({training.seq_len // cp} tokens each)",
                    {"gpu_count": cp * n, "context_parallel_size": cp},
                    "more_hardware",
                    0.1,
                    cost,
                )
            )
            if unsharded:  # torchtitan's layout: FSDP over the data x context-parallel ranks
                out.append(
                    Candidate(
                        f"context parallel {cp} over {cp * n} GPUs with ZeRO-3 / FSDP full-shard",
                        {"gpu_count": cp * n, "context_parallel_size": cp, "sharding": "zero3"},
                        "more_hardware",
                        0.15,
                        cost + "; 1.5x data-parallel communication",
                    )
                )
    for more in (2 * n, 4 * n, 8 * n):
        out.append(
            Candidate(
                f"ZeRO-3 over {more} GPUs",
                {"gpu_count": more, "sharding": "zero3", "data_parallel_size": more},
                "more_hardware",
                0.05,
                f"{more // n}x the GPUs; 1.5x data-parallel communication",
            )
        )
    lora_base = training.finetune is FineTune.LORA and training.quantization is Quantization.NONE
    if lora_base and training.precision in (Precision.AMP_BF16, Precision.AMP_FP16, Precision.FP32):
        # the frozen base is never updated: storing it in bf16 changes no update (memfit.schema.default_precision)
        out.append(
            Candidate(
                "bf16 frozen base (as PEFT, TRL and torchtune load it; adapters stay fp32)",
                {"precision": "bf16"},
                "same_training",
                0.0,
                "no slowdown and the same update: the frozen base is not trained, the adapters keep fp32",
            )
        )
    elif training.precision in (Precision.BF16_FP32_MASTER, Precision.AMP_BF16, Precision.AMP_FP16, Precision.FP32):
        out.append(
            Candidate(
                "pure bf16 (no fp32 master weights, bf16 optimizer states)",
                {"precision": "bf16"},
                "numerics",
                0.0,
                "no slowdown; bf16 weight updates can stall on small updates "
                "(Kahan summation or stochastic rounding advised)",
            )
        )
    if training.optimizer in (Optimizer.ADAMW_FOREACH, Optimizer.ADAMW_FUSED):
        out.append(
            Candidate(
                "8-bit AdamW (bitsandbytes block-wise states)",
                {"optimizer": "adamw_8bit"},
                "numerics",
                0.02,
                "block-wise quantized states: ~2% slower step, close to 32-bit Adam in quality",
            )
        )
    if training.finetune is FineTune.FULL:
        out.append(
            Candidate(
                "LoRA r=16 on PEFT's default target modules (base frozen)",
                {"finetune": "lora", "lora_rank": 16},
                "trained_weights",
                0.0,
                "faster steps (no base gradients); trains adapters, not the full weights",
            )
        )
    qlora_cost = (
        "dequantizes each linear's weights in forward and backward: ~25% slower than LoRA; trains "
        "adapters on a quantized base"
    )
    if training.finetune is FineTune.FULL:
        out.append(
            Candidate(
                "QLoRA: 4-bit NF4 base with LoRA r=16 on PEFT's default target modules",
                {"finetune": "lora", "lora_rank": 16, "quantization": "nf4"},
                "trained_weights",
                0.25,
                qlora_cost,
            )
        )
    elif (
        training.finetune is FineTune.LORA
        and training.quantization is Quantization.NONE
        and training.sharding is Sharding.NONE
    ):
        out.append(
            Candidate(
                f"QLoRA: the same LoRA r={training.lora_rank} on a 4-bit NF4 base",
                {"quantization": "nf4"},
                "numerics",
                0.25,
                qlora_cost,
            )
        )
    return out


def combined_changes(candidates: list[Candidate]) -> list[Candidate]:
    """Pairs of same-hardware changes from :func:`candidate_changes`, for when no single change fits: ZeRO-3 /
    FSDP full-shard over the same GPUs (it cuts the model states) with each smaller micro-batch under gradient
    accumulation (it cuts the activations), the two costs added."""
    sharded = [
        c
        for c in candidates
        if c.change.get("sharding") == "zero3" and set(c.change) == {"sharding", "data_parallel_size"}
    ]
    smaller = [c for c in candidates if set(c.change) == {"micro_batch_size", "gradient_accumulation_steps"}]
    return [
        Candidate(
            f"{s.description}, {m.description}",
            {**s.change, **m.change},
            "same_training",
            s.throughput_loss_fraction + m.throughput_loss_fraction,
            f"{s.cost}; {m.cost}",
        )
        for s in sharded[:1]
        for m in smaller
    ]


def longest_fitting_seq_len(seq_len: int, fits: Callable[[int], bool], step: int = SEQ_LEN_STEP_TOKENS) -> int | None:
    """The longest multiple of ``step`` below ``seq_len`` for which ``fits(length)`` holds, by bisection; None when
    not even ``step`` fits (or ``seq_len <= step``). ``fits`` is taken as monotone (a length fits when a longer one
    does): the traced curve is monotone in sequence length (:mod:`model.curve`). Calls ``fits`` about
    log2(seq_len / step) + 1 times.
    """
    lo, hi = 1, (seq_len - 1) // step  # multiples of step below seq_len: 1..hi
    if hi < 1 or not fits(step):
        return None
    while lo < hi:  # invariant: lo * step fits
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def rank_alternatives(alternatives: list, current_recompute_fraction: float | None = None) -> list:
    """Rank planned alternatives: the ones that fit first, by cost.

    Ranking rule: (1) the category, in :data:`CATEGORIES` order — changes that keep the hardware and the
    training update come first, then more hardware, then changed numerics (pure bf16, 8-bit states), then
    training other weights (LoRA, QLoRA), then a shorter sequence; (2) within a category, the least throughput loss
    (``throughput_loss_fraction``: the change's own cost plus its recompute, k / 3L); (3) the fewer GPUs (a
    ``change`` with ``gpu_count``: the smallest cluster that fits comes first, not the one with the lowest peak
    per GPU); (4) the lower predicted peak. When the current plan fits with heavy recompute
    (``current_recompute_fraction`` given), only alternatives that lose less throughput than that recompute are kept. When nothing fits, the three
    closest to fitting (smallest ``total_upper_bytes``) are returned instead.

    Args:
        alternatives: objects with ``fits``, ``category``, ``throughput_loss_fraction``,
            ``predicted_peak_bytes`` and ``total_upper_bytes`` (:class:`memfit.api.Alternative`).
        current_recompute_fraction: the current plan's recompute fraction when it fits, else None.

    Raises:
        ValueError: an unknown category.
    """
    for a in alternatives:
        if a.category not in CATEGORIES:
            raise ValueError(f"category={a.category!r} must be one of {list(CATEGORIES)}")
    fitting = [a for a in alternatives if a.fits]
    if current_recompute_fraction is not None:
        fitting = [a for a in fitting if a.throughput_loss_fraction < current_recompute_fraction]
    if not fitting:
        return (
            []
            if current_recompute_fraction is not None
            else sorted(alternatives, key=lambda a: a.total_upper_bytes)[:3]
        )
    return sorted(
        fitting,
        key=lambda a: (
            CATEGORIES.index(a.category),
            a.throughput_loss_fraction,
            (getattr(a, "change", None) or {}).get("gpu_count", 0),
            a.predicted_peak_bytes,
        ),
    )
