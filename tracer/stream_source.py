"""The full model's allocation stream per k, for the fit decision (:mod:`model.reserved`), cached on disk.

:func:`stream_source` gives a :data:`model.reserved.StreamSource` for one model and training configuration: k ->
the stream of the full model's step with its first k decoder layers checkpointed: a full-model stream from the
cache, else composed (:mod:`model.stream_compose`) from a small template model's stream recorded with layer
labels (:func:`record_template`, cached by :func:`template_path`), else the full model traced
(:func:`tracer.allocation.cached_step_allocations`), all traced as the job's GPU generation runs the step (its
CUDA-semantics trace policy and cuBLAS workspaces, part of the cache key; the H100/H200's where none is named).
Looking a stream up and composing one need no PyTorch (:func:`stream_path` reads package versions from their
metadata), so the service answers from the cache in its serving process and asks its tracing process for a
missing template (``request``); the command line records (a template of an 8B model: about 1 s; a full model:
3-8 s).

:func:`unsupported_reason` names the configurations the recorder does not trace as one process runs them
(several GPUs, sharding, offload, tensor/pipeline/context/expert parallelism, quantized bases, gradient
accumulation): those are decided on the measured allowance instead (:func:`model.reserved.allowance_fit`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.schema import CheckpointImpl, FineTune, Offload, Quantization, Sharding, TrainingConfig
from model.allocator import AllocationStream
from model.cuda_semantics import UNNAMED_GPU_GENERATION, GpuGeneration, step_workspaces
from model.snapshot import config_key

#: a stream found missing is looked for again after this many seconds (another process may have recorded it)
MISS_RECHECK_S = 2.0
#: Bump when the recording changes what a stream holds (part of the cache key).
STREAM_FORMAT = 2
#: the GPU generation a stream follows when none is named: the H100/H200's (the shipped CUDA rows' and the GPU
#: check's), :data:`model.cuda_semantics.UNNAMED_GPU_GENERATION`
DEFAULT_GENERATION = UNNAMED_GPU_GENERATION.value


@dataclass(frozen=True)
class Refusal:
    """Why a stream source's ``request`` did not queue the recording asked for (it returns None when it did, or
    when it is already queued): ``final`` where a recording of it failed (the source stops asking for this
    configuration and falls back to the measured allowance), else the queue is full for now (asked again the next
    time the stream is looked for). ``reason``: the failure, or the queue's bound that was reached."""

    reason: str
    final: bool


#: the variable naming the folder of cached streams and templates, and its default
STREAM_CACHE_ENV, STREAM_CACHE_DEFAULT = "MEMFIT_STREAM_CACHE", "~/.cache/memfit/allocation_streams"


def stream_cache_dir() -> Path:
    """``$MEMFIT_STREAM_CACHE`` or ``~/.cache/memfit/allocation_streams``."""
    return Path(os.environ.get(STREAM_CACHE_ENV) or STREAM_CACHE_DEFAULT).expanduser()


def trace_policy_name(generation: str = DEFAULT_GENERATION) -> str:
    """The name of the CUDA-semantics trace policy (``tracer.cuda_policy.cuda_step_semantics``) of ``generation``,
    part of a stream's cache key.

    Raises:
        ValueError: ``generation`` is not a :class:`model.cuda_semantics.GpuGeneration` value.
    """
    return f"cuda_step_semantics({GpuGeneration(generation).value})"


@functools.lru_cache(maxsize=8)
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def stream_config_id(hf_config: dict[str, Any], num_layers: int | None = None) -> str:
    """The model part of a stream's cache key: :func:`model.snapshot.config_key` of ``hf_config`` (one key whether
    the config is its published ``config.json`` fields, as the command line sends it, or transformers' full
    serialisation, as :func:`memfit.describe` sends it), and for a template model built from it with
    :func:`memfit.hf.small_config` (``num_layers`` decoder layers), that depth. The template's own config is not
    canonicalised: in the serving process that would import transformers."""
    key = config_key(hf_config)
    return key if num_layers is None else f"{key};layers={num_layers}"


def stream_path(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    *,
    warmup: int = 1,
    workspaces: Mapping[str, int] | None = None,
    context_name: str = "",
    kernel_scratch: bool = True,
    config_id: str | None = None,
) -> Path:
    """Where :func:`tracer.allocation.cached_step_allocations` keeps this stream: a hash of everything that shapes
    it (the model's :func:`stream_config_id`, ``config_id`` when given, else that of ``hf_config``; the training
    configuration with its checkpointed layers, warm-up, workspaces (default: the sm90 cuBLAS workspaces,
    :func:`model.cuda_semantics.step_workspaces`), trace policy, torch and transformers versions,
    :data:`STREAM_FORMAT`)."""
    key = json.dumps(
        {
            "config": config_id if config_id is not None else stream_config_id(hf_config),
            "training": training.model_dump(mode="json"),
            "warmup": warmup,
            "workspaces": dict(step_workspaces(GpuGeneration.SM90) if workspaces is None else workspaces),
            "context": context_name,
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "format": STREAM_FORMAT,
            "kernel_scratch": kernel_scratch,
        },
        sort_keys=True,
        default=str,
    )
    return stream_cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"


def unsupported_reason(training: TrainingConfig, gpu_count: int = 1) -> str | None:
    """Why the recorder cannot give this job's stream as one GPU process runs it, or None when it can."""
    if gpu_count > 1 or training.data_parallel_size > 1:
        return "several GPUs: the recorder traces one process"
    checks = (
        (training.sharding is not Sharding.NONE, "sharded optimizer or parameters"),
        (training.tensor_parallel_size > 1, "tensor parallelism"),
        (training.pipeline_parallel_size > 1, "pipeline parallelism"),
        (training.context_parallel_size > 1, "context parallelism"),
        (training.expert_parallel_size > 1, "expert parallelism"),
        (training.quantization is not Quantization.NONE, "a quantized base"),
        (training.offload_optimizer is not Offload.NONE, "offload"),
        (training.offload_parameters is not Offload.NONE, "offload"),
        (training.gradient_accumulation_steps > 1, "gradient accumulation"),
        (training.optimizer_in_backward, "optimizer in backward"),
    )
    for bad, what in checks:
        if bad:
            return f"{what}: not recorded by the allocation-stream tracer"
    return None


def composition_period(hf_config: dict[str, Any], num_layers: int) -> int | None:
    """The layer-type period :mod:`model.stream_compose` composes with (``memfit.hf.layer_type_cycle``), or None
    where the stream is not composed: a mixture of experts (whose routing the template does not carry), or no
    cycle of at most half the layers. Kept on disk next to the streams per config and transformers version:
    reading the layer types builds the HF config, which imports transformers (3-4 s of a command line's run)."""
    from memfit.hf import layer_type_cycle, num_routed_experts

    if num_routed_experts(hf_config) is not None:
        return None
    key = json.dumps([stream_config_id(hf_config), num_layers, _version("transformers")])
    path = stream_cache_dir() / "periods" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if path.exists():
        return json.loads(path.read_text())["period"]
    period = layer_type_cycle(hf_config, num_layers // 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"period": period}))
    tmp.replace(path)
    return period


def _template_job(
    hf_config: dict[str, Any], training: TrainingConfig, num_layers: int, k: int, period: int | None
) -> tuple[dict[str, Any], TrainingConfig, str] | None:
    """The small model's config, training configuration and :func:`stream_config_id` whose labelled stream is the
    template for the full model at ``k``, or None where the stream is not composed (see :func:`template_path`)."""
    from memfit.hf import small_config
    from model.stream_compose import template_shape

    if (
        period is None
        or training.checkpoint_impl is not CheckpointImpl.NON_REENTRANT
        or training.finetune is FineTune.FROZEN  # frozen leading layers differ from the others by index
    ):
        return None
    n, kc = template_shape(num_layers, k, period)
    if n >= num_layers:
        return None
    return (
        small_config(hf_config, n),
        training.model_copy(update={"checkpoint_layers": list(range(kc))}),
        stream_config_id(hf_config, n),
    )


#: part of a template stream's cache key: recorded with layer labels (``tracer.allocation.step_allocations``)
LAYERED = "layered"


def template_path(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    num_layers: int,
    k: int,
    period: int | None = 0,
    generation: str = DEFAULT_GENERATION,
) -> Path | None:
    """Where the labelled template stream for the full model at ``k`` on a GPU of ``generation`` is cached, or None
    where the stream is not composed (:func:`composition_period`, computed unless ``period`` is given; a template
    as deep as the model: the model is traced itself)."""
    job = _template_job(
        hf_config, training, num_layers, k, composition_period(hf_config, num_layers) if period == 0 else period
    )
    if job is None:
        return None
    cfg, t, config_id = job
    return stream_path(
        cfg,
        t,
        workspaces=step_workspaces(GpuGeneration(generation)),
        context_name=f"{trace_policy_name(generation)};{LAYERED}",
        config_id=config_id,
    )


def record_template(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    num_layers: int,
    k: int,
    model_name: str | None = None,
    period: int | None = 0,
    generation: str = DEFAULT_GENERATION,
) -> AllocationStream | None:
    """Record (or load) the template stream of :func:`template_path` (through
    :func:`tracer.allocation.cached_step_allocations`, layer-labelled, traced as ``generation``'s GPUs run the
    step); None where no template is used.

    Raises:
        ValueError: what :func:`tracer.allocation.step_allocations` raises.
    """
    job = _template_job(
        hf_config, training, num_layers, k, composition_period(hf_config, num_layers) if period == 0 else period
    )
    if job is None:
        return None
    from tracer.allocation import cached_step_allocations, cuda_trace_policy

    name, factory = cuda_trace_policy(generation)
    cfg, t, config_id = job
    return cached_step_allocations(
        cfg,
        t,
        model_name=model_name,
        workspaces=step_workspaces(GpuGeneration(generation)),
        step_context=factory,
        context_name=f"{name};{LAYERED}",
        layered=True,
        config_id=config_id,
    )


#: :func:`record_templates_near` records the templates of the k within this distance of the asked one: the search
#: (:func:`model.reserved.search_k`) gallops 1, 2, 4 from its guess and bisects, so a boundary up to 3 layers from
#: the guess is decided from these alone
NEAR_K = 4


def record_templates_near(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    num_layers: int,
    k: int,
    radius: int = NEAR_K,
    generation: str = DEFAULT_GENERATION,
) -> list[int]:
    """Record the template for ``k`` (:func:`record_template`), then those of the k within ``radius`` of it,
    nearest first, that are not cached yet; the k whose template was recorded or found, in that order.

    One request of the service's tracing process then covers the k the fit search visits next: it asks for one
    missing template at a time, and without the neighbours a small model (GPT-2's 12 layers, where most k have a
    template of their own) took one request per visited k. k in the middle of a deep model share one template
    (:func:`model.stream_compose.template_shape`), so there the neighbours add nothing.

    Raises:
        ValueError: what :func:`record_template` raises for ``k`` itself; a neighbour that fails ends the
            neighbours quietly (the search asks for it again and gets the error then).
    """
    period = composition_period(hf_config, num_layers)
    record_template(hf_config, training, num_layers, k, period=period, generation=generation)
    done = [k]
    seen = {template_path(hf_config, training, num_layers, k, period, generation)}
    for j in sorted(range(max(0, k - radius), min(num_layers, k + radius) + 1), key=lambda j: (abs(j - k), j)):
        path = template_path(hf_config, training, num_layers, j, period, generation)
        if path is None or path in seen:
            continue
        seen.add(path)
        if not path.exists():
            try:
                record_template(hf_config, training, num_layers, j, period=period, generation=generation)
            except Exception:  # noqa: BLE001 - the neighbour's own request reports its error
                break
        done.append(j)
    return done


def _record_full(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    k: int,
    model_name: str | None = None,
    generation: str = DEFAULT_GENERATION,
) -> AllocationStream:
    """The full model's stream with its first ``k`` layers checkpointed, recorded (or loaded) with ``generation``'s
    CUDA-semantics trace policy and cuBLAS workspaces (:func:`tracer.allocation.cached_step_allocations`).

    Raises:
        ValueError: what :func:`tracer.allocation.step_allocations` raises.
    """
    from tracer.allocation import cached_step_allocations, cuda_trace_policy

    name, factory = cuda_trace_policy(generation)
    t = training.model_copy(update={"checkpoint_layers": list(range(k))})
    return cached_step_allocations(
        hf_config,
        t,
        model_name=model_name,
        workspaces=step_workspaces(GpuGeneration(generation)),
        step_context=factory,
        context_name=name,
    )


def record_for_fit(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    num_layers: int,
    k: int,
    generation: str = DEFAULT_GENERATION,
) -> list[int]:
    """Record what :func:`stream_source` needs for the full model's stream at ``k`` on a GPU of ``generation`` when
    it may not record itself (the service asks its tracing process for this): the templates near ``k``
    (:func:`record_templates_near`) where a template applies and composes the stream at ``k``; else the full
    model's stream at ``k`` (no template applies: experts, frozen layers, reentrant checkpointing; or the template
    does not compose). Returns the k whose streams are now at hand, ``k`` first.

    Raises:
        ValueError: what the recorder raises for ``k`` itself.
    """
    from model.stream_compose import CompositionError, compose, template_shape

    period = composition_period(hf_config, num_layers)
    template = record_template(hf_config, training, num_layers, k, period=period, generation=generation)
    if template is not None:
        try:
            compose(template, template_shape(num_layers, k, period)[1], num_layers, k, period)
        except CompositionError:
            pass
        else:
            return record_templates_near(hf_config, training, num_layers, k, generation=generation)
    _record_full(hf_config, training, k, generation=generation)
    return [k]


def stream_source(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    num_layers: int,
    *,
    model_name: str | None = None,
    record: bool = True,
    request=None,
    generation: str = DEFAULT_GENERATION,
    announce: Callable[[str], None] | None = None,
):
    """A :data:`model.reserved.StreamSource` for ``training`` (its ``checkpoint_layers`` ignored): k -> the stream
    with layers ``0..k-1`` checkpointed, as a GPU of ``generation`` (a :class:`model.cuda_semantics.GpuGeneration`
    value) runs the step: its SDPA backend, CUDA's autocast lists and fused dropout
    (:func:`tracer.cuda_policy.cuda_step_semantics`), and its cuBLAS workspaces
    (:func:`model.cuda_semantics.step_workspaces`).

    In order: the full model's stream from the cache; the stream composed from a small template model's
    (:mod:`model.stream_compose`, template cached by :func:`template_path`, recorded when missing and
    ``record``); the full model traced when ``record`` (where no template applies or its composition fails);
    else None. Without ``record``, what is missing is asked of ``request`` when given (``(hf_config, training,
    num_layers, k, path, generation) -> None`` (queued) ``or a`` :class:`Refusal`, e.g. the service's tracing
    queue, which runs :func:`record_for_fit`): the template at ``path``, or the full model's stream at ``path``
    where no template composes it.

    A recording that fails (a model the fake-tensor recorder cannot run, here or in ``request``'s process) gives
    None, and the reason is kept in the source's ``failed`` attribute; the caller then falls back to the measured
    allowance. The source's ``composed`` and ``requested`` attributes list the k it composed and the k whose
    streams were queued by ``request``; ``deferred`` holds the reason of the last request refused for now (a full
    queue); ``compose_failed`` says why a template did not compose. ``announce(message)`` is told once, before the
    source's first recording here (seconds to a minute on a CPU), so that a command line does not wait in silence.

    Raises:
        ValueError: ``generation`` is not a :class:`model.cuda_semantics.GpuGeneration` value.
    """
    from model.stream_compose import CompositionError, compose, template_shape

    announced: list[bool] = []

    def recording(what: str) -> None:
        if announce is not None and not announced:
            announced.append(True)
            name = model_name or hf_config.get("model_type") or "the model"
            announce(
                f"recording {what} of {name}'s training step with {generation} CUDA semantics (fake tensors on the "
                "CPU), for the fit decision: "
                f"seconds to a minute, once per configuration (kept in {stream_cache_dir()}, ${STREAM_CACHE_ENV})"
            )

    generation = GpuGeneration(generation).value
    policy = trace_policy_name(generation)
    workspaces = step_workspaces(GpuGeneration(generation))
    config_id = stream_config_id(hf_config)
    streams: dict[int, AllocationStream | None] = {}
    looked: dict[int, float] = {}  # k -> when a missing stream was last looked for
    periods: list[int | None] = []  # computed at the first composition (it builds the HF config)

    def composed(k: int) -> AllocationStream | None:
        if source.compose_failed is not None:
            return None
        if not periods:
            periods.append(composition_period(hf_config, num_layers))
        period = periods[0]
        path = template_path(hf_config, training, num_layers, k, period, generation)
        if path is None:
            return None
        try:
            if path.exists():
                template = AllocationStream.load(path)
            elif record:
                recording("the allocation stream of a small template model")
                template = record_template(hf_config, training, num_layers, k, model_name, period, generation)
            else:
                ask(k, path)
                return None
            stream = compose(template, template_shape(num_layers, k, period)[1], num_layers, k, period)
        except CompositionError as err:
            source.compose_failed = str(err)
            return None
        except Exception as err:  # noqa: BLE001 - a configuration the recorder cannot run: fall back
            source.failed = f"{type(err).__name__}: {str(err)[:200]}"
            return None
        source.composed.append(k)
        return stream

    def source(k: int) -> AllocationStream | None:
        if streams.get(k) is not None or (k in streams and time.monotonic() - looked[k] < MISS_RECHECK_S):
            return streams[k]
        t = training.model_copy(update={"checkpoint_layers": list(range(k))})
        path = stream_path(hf_config, t, workspaces=workspaces, context_name=policy, config_id=config_id)
        stream = None
        looked[k] = time.monotonic()
        if path.exists():
            stream = AllocationStream.load(path)
        elif source.failed is None:
            asked = len(source.requested)
            stream = composed(k)
            if stream is None and not record and source.failed is None and len(source.requested) == asked:
                ask(k, path)  # no template composes it: the full model's stream
        if stream is None and record and source.failed is None:
            try:
                recording("the allocation stream")
                stream = _record_full(hf_config, training, k, model_name, generation)
            except Exception as err:  # noqa: BLE001 - a configuration the recorder cannot run: fall back
                source.failed = f"{type(err).__name__}: {str(err)[:200]}"
        streams[k] = stream
        return stream

    def ask(k: int, path) -> None:
        if request is None:
            return
        refused = request(hf_config, training, num_layers, k, str(path), generation)
        if refused is None:
            source.requested.append(k)
        elif refused.final:
            source.failed = refused.reason
        else:
            source.deferred = refused.reason

    source.failed = None
    source.deferred = None
    source.compose_failed = None
    source.composed = []
    source.requested = []  # the k whose missing stream ``request`` queued
    source.num_layers = num_layers
    source.key = json.dumps(
        [hf_config, training.model_dump(mode="json", exclude={"checkpoint_layers"}), policy],
        sort_keys=True,
        default=str,
    )
    return source


def recording_source(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    num_layers: int,
    model_name=None,
    record=True,
    generation: str = DEFAULT_GENERATION,
    announce: Callable[[str], None] | None = None,
):
    """:func:`stream_source` as :class:`service.recommender.Recommender` takes it (``record`` as asked): the command
    line's, which tells ``announce`` before it records."""
    return stream_source(
        hf_config,
        training,
        num_layers,
        model_name=model_name,
        record=record,
        generation=generation,
        announce=announce,
    )


def cached_source(
    hf_config: dict[str, Any],
    training: TrainingConfig,
    num_layers: int,
    model_name=None,
    record=True,
    request=None,
    generation: str = DEFAULT_GENERATION,
):
    """:func:`stream_source` that never records (the serving process runs no PyTorch): streams recorded by the
    command line or the GPU check on this machine, and streams composed from recorded templates, are used; what is
    missing is asked of ``request`` where ``record`` (a request's own search; an alternative's, ``record=False``,
    asks nothing: one request must not queue a recording per alternative); others fall back to the measured
    allowance."""
    return stream_source(
        hf_config,
        training,
        num_layers,
        model_name=model_name,
        record=False,
        request=request if record else None,
        generation=generation,
    )


#: ``MEMFIT_ALLOCATOR_STREAMS``: ``record`` (trace a missing stream), ``cache`` (use recorded ones only) or ``off``
STREAMS_ENV = "MEMFIT_ALLOCATOR_STREAMS"


def configured_source(default: str, request=None, announce: Callable[[str], None] | None = None):
    """The stream factory a front end uses: :func:`recording_source` (telling ``announce`` before it records),
    :func:`cached_source` (asking ``request`` for missing templates) or None (``off``), as
    ``$MEMFIT_ALLOCATOR_STREAMS`` says, else ``default`` (the command line records, the service reads the cache and
    queues templates in its tracing process).

    Raises:
        ValueError: an unknown value (the variable and the allowed values named).
    """
    mode = (os.environ.get(STREAMS_ENV) or default).strip().lower()
    sources = {
        "record": functools.partial(recording_source, announce=announce),
        "cache": functools.partial(cached_source, request=request),
        "off": None,
    }
    if mode not in sources:
        raise ValueError(f"{STREAMS_ENV} must be one of record, cache, off; got {mode!r}")
    return sources[mode]
