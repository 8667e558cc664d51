"""Turn a :class:`memfit.api.RecommendRequest` into a :class:`memfit.api.Recommendation`.

Resolves the request once (:func:`model.job.resolve`: the model, a catalog name, HF config or explicit fields, and
the training with its defaults filled from the cluster) into a :class:`model.job.Job`, asks
:func:`model.recommend.plan` for the curve over k, and — when nothing fits, or it fits
only with heavy recompute (k > L/2) — answers "what fits instead": concrete changes
(:func:`model.recommend.candidate_changes`) each planned through the same curve, ranked by
:func:`model.recommend.rank_alternatives`.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from memfit.api import (
    Alternative,
    Prediction,
    PredictItem,
    Recommendation,
    RecommendRequest,
    StageOut,
    TrainingIn,
    gpu_catalog_name,
)
from memfit.errors import InvalidConfiguration
from memfit.schema import (
    GIB,
    FineTune,
    ModelSpec,
    Precision,
    Quantization,
    TrainingConfig,
)
from model.allocator import AllocatorConfError, AllocatorSettings
from model.cuda_semantics import (
    PRE_AMPERE,
    TARGET_GENERATION,
    UNNAMED_GPU_GENERATION,
    cuda_trace_reasons,
    target_generation,
)
from model.cuda_terms import generation_curve
from model.curve import PROVISIONAL, Curve, MemoryPredictor
from model.job import (
    Architecture,
    Job,
    check_attention,
    check_parallel,
    known_architectures,
    model_shape,
    resolve,
    resolve_architecture,
)
from model.overhead import OverheadModel
from model.recommend import (
    LONG_CONTEXT_TOKENS,
    SEQ_LEN_STEP_TOKENS,
    Candidate,
    Plan,
    allocator_bounds,
    candidate_changes,
    combined_changes,
    longest_fitting_seq_len,
    needs_alternatives,
    parameter_block_bytes,
    plan,
    rank_alternatives,
)
from model.reserved import allowance_fit
from model.terms import TermsCache

if TYPE_CHECKING:  # LightGBM (2 s to import) loads with a registry's model, not with the request checks
    from model.estimator import PeakMemoryRegressor


def warm_up(stop: threading.Event | None = None) -> int:
    """Import transformers, resolve every catalog HF config once (fills the caches; their parameter counts are read
    from the shipped snapshot) and build a one-layer model of each catalog family on the ``meta`` device, which
    imports its modeling code: a never-seen config of those families is then counted without those imports (1.2 s
    of a first answer on 2 cores). Returns how many configs were resolved. ``stop``: when set, return before the next
    step (the application is shutting down)."""
    from data import catalog
    from memfit.hf import count_params_from_config, import_transformers, small_config

    import_transformers()  # before a request's thread can: two threads importing transformers break it
    known_architectures()
    n = 0
    families: dict[str, dict] = {}
    for name in catalog.names():
        if stop is not None and stop.is_set():
            return n
        cfg = catalog.get(name)["hf_config"]
        try:
            resolve_architecture(cfg)
            n += 1
        except InvalidConfiguration:
            continue
        families.setdefault(cfg["model_type"], cfg)
    for cfg in families.values():
        if stop is not None and stop.is_set():
            break
        count_params_from_config(small_config(cfg, 1))
    return n


def _stages_out(p: Plan) -> list[StageOut]:
    """Each pipeline stage at the plan's k (at k = L when nothing fits); empty without a per-stage split."""
    pipe = p.curve.pipeline
    if pipe is None:
        return []
    k = p.at.k
    return [
        StageOut(
            stage=st.stage,
            first_layer=st.first_layer,
            num_layers=st.num_layers,
            k=int(pipe.stage_k[k][i]),
            micro_batches_in_flight=round(st.micro_batches_in_flight, 4),
            predicted_peak_bytes=int(pipe.stage_peak_bytes[k][i]),
            parameters=st.spec.total_params,
        )
        for i, st in enumerate(pipe.stages)
    ]


def check_request(req: RecommendRequest) -> None:
    """The request's parallel layout against its model's shape (:func:`model.job.check_parallel` on
    :func:`model.job.model_shape`),
    before any predictor is loaded or any parameter counted: ``memfit recommend`` runs it first, so a
    ``--tensor-parallel`` the model cannot split is refused in about a second, not after the predictor's load.
    :meth:`Recommender.recommend` runs the same checks (in :func:`model.job.resolve`).

    Raises:
        InvalidConfiguration: the field named (e.g. ``training.tensor_parallel_size``), with the allowed values.
    """
    check_parallel(req.training, model_shape(req.model), req.cluster.gpu_count)


def default_precision_note(training: TrainingConfig) -> str:
    """What the answer says about the precision :func:`memfit.schema.default_precision` chose for a LoRA job."""
    if training.quantization is Quantization.NONE:
        return (
            f"precision: {training.precision.value} (LoRA without a precision): the frozen base in bf16, as PEFT, "
            "TRL and torchtune load it, the adapters in fp32 (PEFT's autocast_adapter_dtype); give precision "
            "amp_bf16 for an fp32 base under autocast"
        )
    return (
        f"precision: {training.precision.value} (QLoRA without a precision): PEFT's "
        "prepare_model_for_kbit_training casts the base's unquantized weights (embeddings, norms, lm_head) to "
        "fp32; the adapters train under bf16 autocast"
    )


class CurveCache:
    """Memoises :meth:`model.curve.MemoryPredictor.curve` for one model version (same signature).

    A curve is a pure function of the model version, the traced terms and the configuration, so
    repeated configurations (the same job launched again, ``/recommend``'s alternatives) are answered
    from here. A cached provisional curve is recomputed once its configuration's traced terms arrive, or once
    the trace it was waiting for has ended without them (failed: its notes then say so instead of "ask again";
    looked for at most every ``recheck_s`` seconds), and so is one whose trace was deferred by a full queue (the
    tracer is asked again). The same holds for a curve answered from the CPU-semantics terms while the request's
    GPU generation is traced (:mod:`model.cuda_terms`). Least recently used entries go first beyond ``maxsize``.
    """

    def __init__(self, predictor: MemoryPredictor, maxsize: int = 2048, recheck_s: float = 1.0) -> None:
        self.predictor, self.maxsize, self.recheck_s = predictor, maxsize, recheck_s
        # answers from CPU-semantics terms while a GPU generation's trace runs queue nothing (model.cuda_terms)
        self._untraced = copy.copy(predictor)
        self._untraced.tracer = None
        self._awaiting: dict[tuple[str, ...], str] = {}  # cache key -> the generation's terms key it waits for
        # key -> (curve, when last checked, whether it waits for a trace in the background tracer's queue)
        self._curves: OrderedDict[tuple[str, str, str], tuple[Curve, float, bool]] = OrderedDict()
        self._lock = threading.Lock()

    def _waiting(self, c: Curve) -> bool:
        pending = getattr(getattr(self.predictor, "tracer", None), "pending", ())
        return c.path == PROVISIONAL and c.terms_key is not None and c.terms_key in pending

    @staticmethod
    def _key(model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None) -> tuple[str, ...]:
        gen = TARGET_GENERATION.get()
        return (
            model.model_dump_json(),
            training.model_dump_json(exclude={"checkpoint_layers"}),
            json.dumps(hf_config, sort_keys=True),
            gen.value if gen is not None else "",
        )

    def waits(self, model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None = None) -> bool:
        """Whether the cached curve of this configuration (for the request's GPU generation) waits for traced
        terms that the background tracer has queued, is running or deferred by a full queue: the generation's
        (answered from the CPU-semantics terms meanwhile) or its own (answered provisional meanwhile). False for a
        curve not cached, a trace that failed, or a process without a background tracer."""
        key = self._key(model, training, hf_config)
        with self._lock:
            hit = self._curves.get(key)
            awaited = self._awaiting.get(key)
        tracer = getattr(self.predictor, "tracer", None)

        def queued(terms_key: str) -> bool:
            return terms_key in getattr(tracer, "pending", ()) or terms_key in getattr(tracer, "deferred", ())

        if awaited is not None:
            return queued(awaited) and self.predictor.terms.get(awaited) is None
        c = hit[0] if hit is not None else None
        return c is not None and c.path == PROVISIONAL and c.terms_key is not None and queued(c.terms_key)

    def curve(self, model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None = None) -> Curve:
        key = self._key(model, training, hf_config)
        now = time.monotonic()
        with self._lock:
            hit = self._curves.get(key)
            if hit is not None:
                self._curves.move_to_end(key)
        tracer = getattr(self.predictor, "tracer", None)
        if hit is not None:
            c, checked, waiting = hit
            deferred = getattr(tracer, "deferred", ())
            awaited = self._awaiting.get(key)
            # the generation's trace: arrived; deferred by a full queue (ask again); or ended without terms (failed)
            stale = (
                awaited is not None
                and (
                    self.predictor.terms.get(awaited) is not None
                    or (
                        now - checked > self.recheck_s
                        and (awaited in deferred or (waiting and awaited not in getattr(tracer, "pending", ())))
                    )
                )
            ) or (
                c.path == PROVISIONAL
                and c.terms_key is not None
                and now - checked > self.recheck_s
                and (
                    self.predictor.terms.get(c.terms_key) is not None
                    or (waiting and not self._waiting(c))
                    or c.terms_key in deferred
                )
            )
            if not stale:
                if c.path == PROVISIONAL and now - checked > self.recheck_s:
                    with self._lock:
                        self._curves[key] = (c, now, waiting)
                return c
        c, awaited = generation_curve(self.predictor, self._untraced, model, training, hf_config)
        waiting = self._waiting(c) if awaited is None else awaited in getattr(tracer, "pending", ())
        with self._lock:
            self._curves[key] = (c, now, waiting)
            if awaited is None:
                self._awaiting.pop(key, None)
            else:
                self._awaiting[key] = awaited
            while len(self._curves) > self.maxsize:
                self._awaiting.pop(self._curves.popitem(last=False)[0], None)
        return c


#: training fields whose allowed values depend on the GPU count (a /predict item without a cluster has one GPU)
_PARALLEL_FIELDS = frozenset(
    {
        "sharding",
        "data_parallel_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "context_parallel_size",
        "expert_parallel_size",
    }
)


class Recommender:
    """Holds one model version and answers requests."""

    def __init__(
        self,
        est: PeakMemoryRegressor | None,
        version: str,
        overhead: OverheadModel | None = None,
        telemetry_range: dict[str, float] | None = None,
        terms: TermsCache | None = None,
        margins: dict[str, float] | None = None,
        tracer: Any = None,
        coefficients: Any = None,
        streams: Any = None,
    ) -> None:
        """``streams``: ``(hf_config, training, num_layers, model_name, record=, generation=) -> StreamSource``
        giving the full model's allocation stream per k as a GPU of that generation runs the step
        (:func:`tracer.stream_source.stream_source`), for the fit decision on reserved memory
        (:mod:`model.reserved`); None: decide on the measured allocator allowance."""
        self.est, self.version = est, version
        self.streams = streams
        self._fits: OrderedDict = OrderedDict()  # simulated fit decisions (model.recommend.plan's fit_cache)
        self._sources: OrderedDict = OrderedDict()  # stream sources per configuration (self.streams' results)
        self._lock = threading.Lock()
        import pandas as pd

        self.overhead = overhead or OverheadModel().fit(pd.DataFrame())  # shipped GPU pressure figures
        self.range = telemetry_range or {}
        # coefficients: a fitted model.coefficients.CoefficientModel answers the provisional configurations it covers
        self.predictor = MemoryPredictor(est, terms, margins, tracer, coefficients=coefficients)
        self.curves = CurveCache(self.predictor)
        # alternatives are answered from the same terms and estimator but queue no traces: one request must not
        # start a dozen background traces (an untraced alternative is answered, and labelled, provisional)
        self._alternative_curves = CurveCache(
            MemoryPredictor(est, self.predictor.terms, self.predictor.margins, coefficients=coefficients)
        )

    def _plan(
        self,
        job: Job,
        req: RecommendRequest,
        curves: CurveCache | None = None,
        settings: AllocatorSettings | None = None,
    ) -> Plan:
        # alternatives replay only streams already recorded: one request must not record a dozen configurations
        source, why = self._stream_source(job, record=curves is None)
        p = plan(
            curves or self.curves,
            job.spec,
            job.training,
            hf_config=job.hf_config,
            capacity_bytes=req.cluster.memory_bytes,
            headroom_fraction=req.headroom_fraction,
            device_name=req.cluster.gpu,
            gpu_count=job.gpu_count,
            overhead_model=self.overhead,
            layout=req.layout,
            allocator=settings if settings is not None else allocator_settings(req),
            streams=source,
            no_stream_reason=why if source is None else functools.partial(_missing_stream_reason, source),
            fit_cache=self._fits,
        )
        while len(self._fits) > 4096:
            self._fits.popitem(last=False)
        return p

    def _stream_source(self, job: Job, record: bool = True) -> tuple[Any, str]:
        """The full model's stream source for the fit decision, traced as the request's GPU generation runs the step
        (:data:`model.cuda_semantics.TARGET_GENERATION`; the H100/H200's for a GPU given by its memory alone), or
        (None, why not)."""
        spec, training, hf_config = job.spec, job.training, job.hf_config
        if self.streams is None:
            return None, "no allocation-stream recorder in this process"
        from tracer.stream_source import unsupported_reason

        why = unsupported_reason(training, job.gpu_count)
        if why is not None:
            return None, why
        generation = (TARGET_GENERATION.get() or UNNAMED_GPU_GENERATION).value
        key = (
            json.dumps(hf_config, sort_keys=True),
            training.model_dump_json(exclude={"checkpoint_layers"}),
            record,
            generation,
        )
        with self._lock:
            source = self._sources.get(key)
            if source is not None:
                self._sources.move_to_end(key)
        if source is None:  # one source per configuration: it remembers the streams it loaded and the ones missing
            source = self.streams(
                hf_config, training, spec.num_layers, spec.model_name, record=record, generation=generation
            )
            with self._lock:
                self._sources[key] = source
                while len(self._sources) > 256:
                    self._sources.popitem(last=False)
        return source, ""

    def curve(self, model: Any, training_in: TrainingIn, gpu_count: int = 1) -> tuple[Curve, ModelSpec, TrainingConfig]:
        """The one curve (:meth:`model.curve.MemoryPredictor.curve`) for a request's model and training.

        Raises:
            InvalidConfiguration: the model or training is invalid (field named).
        """
        c, job = self._curve(model, training_in, gpu_count)
        return c, job.spec, job.training

    def _curve(
        self, model: Any, training_in: TrainingIn, gpu_count: int, architecture_fallback: str | None = None
    ) -> tuple[Curve, Job]:
        job = resolve(model, training_in, gpu_count=gpu_count, architecture_fallback=architecture_fallback)
        return self.curves.curve(job.spec, job.training, job.hf_config), job

    def predict(self, item: PredictItem, index: int = 0) -> Prediction:
        """:meth:`_predict` with the cluster's GPU generation as the target of the traced terms
        (:func:`model.cuda_semantics.target_generation`, :mod:`model.cuda_terms`)."""
        with target_generation((item.cluster.gpu or UNNAMED_GPU_GENERATION) if item.cluster is not None else None):
            return self._predict(item, index)

    def _predict(self, item: PredictItem, index: int = 0) -> Prediction:
        """One ``/predict`` item: the curve's point at ``item.k`` (the same curve ``/recommend`` uses).

        Raises:
            InvalidConfiguration: the item is invalid; the field starts with ``items.<index>``.
        """
        try:
            check_attention(item.training.attention, item.cluster.gpu if item.cluster else None)
            c, job = self._curve(
                item.model, item.training, item.cluster.gpu_count if item.cluster else 1, item.architecture_fallback
            )
            spec, training, warnings = job.spec, job.training, job.warnings
            if item.k > spec.num_layers:
                raise InvalidConfiguration("k", f"an integer in [0, num_layers={spec.num_layers}]", item.k)
        except InvalidConfiguration as err:
            if item.cluster is None and err.field.split(".")[-1] in _PARALLEL_FIELDS:  # the cause: no cluster given
                err = InvalidConfiguration(
                    err.field,
                    err.allowed,
                    message=f"{err.message} (this item gives no cluster, so one GPU: add cluster.gpu_count)",
                )
            raise err.within(f"items.{index}") from err
        p = c.points[item.k]
        total = None
        if item.cluster is not None:  # the allowance figure /recommend's curve gives without a simulated stream
            settings = AllocatorSettings()
            blocks = parameter_block_bytes(spec, training, job.hf_config, settings)
            bounds = allocator_bounds([p.upper_bytes], blocks, self.overhead)
            ratio, source = self.overhead.allowance_ratio(settings.expandable_segments)
            outside, _ = self.overhead.outside_pytorch(item.cluster.gpu, item.cluster.gpu_count)
            total = allowance_fit(bounds, settings, 0, ratio, source, "", 0, c.floor_bytes).reserved_bytes[0] + outside
        return Prediction(
            predicted_peak_bytes=p.predicted_bytes,
            upper_bound_bytes=p.upper_bytes,
            total_upper_bytes=total,
            fit_method="allowance" if item.cluster is not None else None,
            pending=["terms"] if self.curves.waits(spec, training, job.hf_config) else [],
            breakdown=p.breakdown,
            num_layers=spec.num_layers,
            k=item.k,
            peak_phase=p.peak_phase,
            path=c.path,
            notes=[*warnings, *c.notes],
            host_memory_bytes=job.host_memory_bytes(item.cluster.ranks_per_node if item.cluster else 1),
        )

    def recommend(self, req: RecommendRequest) -> Recommendation:
        """:meth:`_recommend` with the cluster's GPU generation as the target of the traced terms
        (:data:`model.cuda_semantics.UNNAMED_GPU_GENERATION` where only the GPU's memory is given)."""
        with target_generation(req.cluster.gpu or UNNAMED_GPU_GENERATION):
            return self._recommend(req)

    def _recommend(self, req: RecommendRequest) -> Recommendation:
        """The answer to one request.

        Raises:
            InvalidConfiguration: the request describes no valid model or training (field named).
        """
        settings = allocator_settings(req)
        job = resolve(req.model, req.training, req.cluster, architecture_fallback=req.architecture_fallback)
        spec, training = job.spec, job.training
        p = self._plan(job, req)
        at = p.at
        warnings = [*job.warnings, *p.curve.notes, *self._warnings(job, training, req, p), *p.reserved.notes]
        alternatives = self._alternatives(job, req, p) if needs_alternatives(p) else []
        expandable = self._expandable_alternative(job, req, p, settings)
        if expandable is not None:  # changes no numerics: offered first
            alternatives = [expandable, *alternatives]
        reserved = p.reserved.reserved_bytes
        pending = []
        if self.curves.waits(spec, training, job.hf_config):
            pending.append("terms")
        if p.reserved.method == "allowance":
            source, _ = self._stream_source(job)
            if source is not None and not source.failed and (source.requested or source.deferred):
                pending.append("allocation streams")
        return Recommendation(
            fits=p.fits,
            k=p.k,
            layers=p.layers,
            num_layers=spec.num_layers,
            predicted_peak_bytes=at.predicted_bytes,
            upper_bound_bytes=at.upper_bytes,
            total_upper_bytes=p.total_upper_bytes[at.k],
            capacity_bytes=p.capacity_bytes,
            usable_bytes=p.usable_bytes,
            shortfall_bytes=p.shortfall_bytes,
            curve=[
                {
                    "k": c.k,
                    "predicted_bytes": c.predicted_bytes,
                    "upper_bytes": c.upper_bytes,  # CurvePointOut,
                    "total_upper_bytes": t,
                    "predicted_reserved_bytes": r,
                    "peak_phase": c.peak_phase,
                    "fits": p.reserved.runs_at(c.k),
                }  # validated in one pass with the answer
                for c, t, r in zip(p.curve.points, p.total_upper_bytes, reserved)
            ],
            predicted_reserved_bytes=reserved[at.k],
            allocator_settings=settings.conf,
            allocator_settings_assumed=settings.describe(),
            fit_method=p.reserved.method,
            pending=pending,
            allocator_cap_bytes=p.reserved.cap_bytes,
            allocator_room_bytes=p.reserved.room_bytes,
            breakdown=at.breakdown,
            peak_phase=at.peak_phase,
            path=p.curve.path,
            overhead={**p.overhead.__dict__, "total_bytes": p.overhead.total_bytes},
            recompute_overhead_fraction=round(p.recompute_fraction, 4),
            alternatives=alternatives,
            stages=_stages_out(p),
            bottleneck_stage=p.curve.pipeline.bottleneck(at.k) if p.curve.pipeline else None,
            parameters_per_rank=job.parameters_per_rank,
            host_memory_bytes=job.host_memory_bytes(req.cluster.ranks_per_node),
            model_name=spec.model_name,
            model_version=self.version,
            warnings=warnings,
            training=training.model_dump(mode="json", exclude={"checkpoint_layers"}),
        )

    def _expandable_alternative(
        self, job: Job, req: RecommendRequest, current: Plan, settings: AllocatorSettings
    ) -> Alternative | None:
        """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when the request runs without it and it lowers k or
        makes the job fit (same curve and streams, replayed with the other setting); else None."""
        if settings.expandable_segments:
            return None
        other = AllocatorSettings.from_conf(",".join(filter(None, [settings.conf, "expandable_segments:True"])))
        p = self._plan(job, req, settings=other)
        if p.reserved.method != current.reserved.method:
            return None
        better = p.fits and (not current.fits or p.k < current.k)
        if not better:
            return None
        cand = Candidate(
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts "
            "(memfit.use_expandable_segments() in the training script, or in the environment)",
            {"alloc_conf": other.conf},
            "same_training",
            0.0,
            "changes no numerics: the caching allocator grows segments instead of caching fixed ones, so a large "
            "request finds room; "
            + (
                f"k {current.k} -> {p.k}"
                if current.fits
                else f"the job fits at k = {p.k} (it does not fit with {settings.describe()} settings)"
            ),
        )
        return _alternative(cand, p, job, req)

    def _warnings(self, job: Job, training: TrainingConfig, req: RecommendRequest, p: Plan) -> list[str]:
        out = []
        if req.training.precision is None and training.finetune is FineTune.LORA:
            out.append(default_precision_note(training))
        if req.training.lora_rank is None and training.finetune is FineTune.LORA:
            out.append(
                f"lora_rank: {training.lora_rank} (LoRA without a rank): PEFT's LoraConfig default r; give "
                "lora_rank for the adapters you train"
            )
        for name, value in (
            ("total_params", job.spec.total_params),
            ("seq_len", training.seq_len),
            ("micro_batch_size", training.micro_batch_size),
        ):
            hi = self.range.get(f"max_{name}")
            if hi is not None and value > hi:
                out.append(f"extrapolating: {name}={value} is beyond the telemetry's largest ({int(hi)})")
        trained = (job.hf_config or {}).get("max_position_embeddings")
        if isinstance(trained, int) and training.seq_len > trained and not (job.hf_config or {}).get("rope_scaling"):
            out.append(  # learned position tables are refused beyond their size (memfit.hf.max_seq_len); RoPE runs
                f"seq_len={training.seq_len} is beyond the {trained} positions the model was trained on "
                "(max_position_embeddings, no rope_scaling): it runs, with quality not guaranteed; the memory answer "
                "holds"
            )
        if req.cluster.gpu is None and cuda_trace_reasons(job.hf_config or {}, training, UNNAMED_GPU_GENERATION):
            out.append(
                f"no GPU named (memory only): the kernels assumed are {UNNAMED_GPU_GENERATION.value}'s (H100/H200); "
                "name the GPU (cluster.gpu) for its own: a V100 or T4 has no FlashAttention and runs bf16 attention "
                "on the math backend"
            )
        gen = TARGET_GENERATION.get() if req.cluster.gpu else None  # the named GPU's (recommend sets it)
        if gen in PRE_AMPERE and training.precision in (
            Precision.AMP_BF16,
            Precision.BF16,
            Precision.BF16_FP32_MASTER,
        ):
            instead = {
                Precision.AMP_BF16: "precision=amp_fp16 needs the same memory with fp16 autocast",
                # memfit.describe reads DeepSpeed's fp16 block as bf16_fp32_master: the same model-state bytes
                Precision.BF16_FP32_MASTER: "the answer is for bf16_fp32_master as asked; fp16 weights with fp32 "
                "masters (DeepSpeed's or Megatron's fp16, which memfit.describe reads as this precision) hold the "
                "same states, and their attention runs the memory-efficient kernel here, not bf16's math fallback: "
                "for them the answer errs high",
            }.get(training.precision, f"the answer is for {training.precision.value} as asked")
            out.append(
                f"{gpu_catalog_name(req.cluster.gpu)} (compute capability {gen.value[2]}.{gen.value[3:]}) has no "
                "bfloat16 tensor cores: PyTorch runs bf16 "
                f"emulated, far slower; {instead}"
            )
        used = training.data_parallel_size * training.model_parallel_size
        asked = req.training.data_parallel_size
        if asked is not None and asked != training.data_parallel_size:  # default_data_parallel_size's reading
            out.append(
                f"data_parallel_size={asked} with context_parallel_size={training.context_parallel_size} on "
                f"{req.cluster.gpu_count} GPUs read as the ZeRO/FSDP sharding group over data x context-"
                f"parallel ranks: {training.data_parallel_size} data-parallel replicas x "
                f"{training.context_parallel_size} context-parallel ranks"
            )
        if used < req.cluster.gpu_count:
            out.append(
                f"data*tensor*pipeline*context parallel size = {used} uses {used} of the {req.cluster.gpu_count} GPUs"
            )
        # the allowance's test keeps the largest request free beside the total (model.reserved.allowance_fit)
        room = (p.reserved.room_bytes or 0) if p.reserved.method == "allowance" else 0
        if p.fits and p.k is not None and p.total_upper_bytes[p.k] + room > 0.97 * p.usable_bytes:
            # the smallest k that fits is often close to the line (a new user read the bare warning as noise):
            # say how close, and what one more checkpointed layer buys
            left = p.usable_bytes - p.total_upper_bytes[p.k] - room
            kept = f" and the largest request kept free ({room / GIB:.2f} GiB)" if room else ""
            msg = (
                f"headroom thin: at k={p.k} the bound plus overhead{kept} leaves {left / GIB:.2f} GiB "
                f"({100 * left / p.usable_bytes:.1f} % of usable memory, which already keeps the headroom)"
            )
            totals = p.total_upper_bytes
            nxt = next((k for k in range(p.k + 1, len(totals)) if totals[k] < totals[p.k]), None)
            if nxt is not None:
                msg += f"; k={nxt} leaves {(p.usable_bytes - totals[nxt] - room) / GIB:.2f} GiB"
            out.append(msg)
        out.append("torch.compile can erase or invert checkpointing savings; the prediction assumes eager mode")
        if not p.fits:
            out.append("no k fits: checkpointing every layer is not enough; see alternatives")
        return out

    def _alternatives(self, job: Job, req: RecommendRequest, current: Plan) -> list[Alternative]:
        """Each candidate change planned through the same curve; ranked by :func:`model.recommend.rank_alternatives`.

        A candidate the schema refuses (e.g. ZeRO on one GPU) is skipped. When no single change fits on the same
        GPUs, pairs of them are planned too (:func:`model.recommend.combined_changes`). Returned: the candidates that fit
        (with heavy recompute: only those that need less recompute than ``current``), ranked; when none
        fits, the three closest to fitting.
        """
        out = []

        def planned(candidates) -> None:
            for cand in candidates:
                fields = {k: v for k, v in cand.change.items() if k != "gpu_count"}
                gpus = cand.change.get("gpu_count", req.cluster.gpu_count)
                try:
                    t_in = TrainingIn.model_validate({**req.training.model_dump(), **fields})
                    changed = resolve(job.architecture, t_in, req.cluster, gpu_count=gpus)
                except (ValidationError, InvalidConfiguration):
                    continue
                p = self._plan(changed, req, self._alternative_curves)
                out.append(_alternative(cand, p, changed, req))

        singles = candidate_changes(job.training, job.architecture.spec, req.cluster.gpu_count)
        planned(singles)
        if not any(a.fits and a.category == "same_training" for a in out):  # two changes on the same GPUs
            planned(combined_changes(singles))
        if not current.fits and job.training.seq_len >= LONG_CONTEXT_TOKENS:
            shorter = self._shorter_sequence(job.architecture, req)
            if shorter is not None:
                out.append(shorter)
        return rank_alternatives(out, current_recompute_fraction=current.recompute_fraction if current.fits else None)

    def _shorter_sequence(self, architecture: Architecture, req: RecommendRequest) -> Alternative | None:
        """The longest shorter sequence that fits, with its k (:func:`model.recommend.longest_fitting_seq_len`), each
        length planned through the same curve as the request; None when not even the shortest step fits."""
        plans: dict[int, tuple[Plan, Job]] = {}

        def fits(seq_len: int) -> bool:
            try:
                t_in = TrainingIn.model_validate({**req.training.model_dump(), "seq_len": seq_len})
                job = resolve(architecture, t_in, req.cluster)
            except (ValidationError, InvalidConfiguration):  # e.g. not a multiple of the context-parallel size
                return False
            plans[seq_len] = (self._plan(job, req, self._alternative_curves), job)
            return plans[seq_len][0].fits

        best = longest_fitting_seq_len(req.training.seq_len, fits)
        if best is None:
            return None
        p, job = plans[best]
        cand = Candidate(
            f"seq_len {best} (the longest multiple of {SEQ_LEN_STEP_TOKENS} tokens below "
            f"{req.training.seq_len} that fits)",
            {"seq_len": best},
            "shorter_sequence",
            0.0,
            f"trains on {best}-token sequences instead of {req.training.seq_len}: a shorter context",
        )
        return _alternative(cand, p, job, req)


def allocator_settings(req: RecommendRequest) -> AllocatorSettings:
    """The request's ``alloc_conf`` (a ``PYTORCH_CUDA_ALLOC_CONF`` string) parsed as PyTorch parses it.

    Raises:
        InvalidConfiguration: a string PyTorch would refuse, or ``backend:cudaMallocAsync`` (not modelled); the
            field is ``alloc_conf``.
    """
    conf = getattr(req, "alloc_conf", None)
    try:
        settings = AllocatorSettings.from_conf(conf)
    except AllocatorConfError as err:
        raise InvalidConfiguration(
            "alloc_conf",
            "a PYTORCH_CUDA_ALLOC_CONF string",
            message=f"alloc_conf: {str(err).removeprefix('PYTORCH_CUDA_ALLOC_CONF: ')}",
        ) from err
    if settings.backend != "native":
        raise InvalidConfiguration(
            "alloc_conf",
            "the native caching allocator",
            message="alloc_conf: backend:cudaMallocAsync is not modelled; memfit models the native caching allocator",
        )
    return settings


def _missing_stream_reason(source: Any) -> str:
    failed = getattr(source, "failed", None)
    if failed:
        return f"the allocation-stream recorder failed on this model ({failed})"
    deferred = getattr(source, "deferred", None)
    if deferred and not getattr(source, "requested", None):
        return (
            f"the tracing process's queue is full ({deferred}), so this configuration's allocation streams are not "
            "being recorded yet; ask again in a minute for the fit decided by the caching-allocator simulation"
        )
    if getattr(source, "requested", None):
        how = (
            f"the full model's, as its template does not compose ({source.compose_failed})"
            if getattr(source, "compose_failed", None)
            else "a template model's, or the full model's where no template applies"
        )
        return (
            f"the allocation streams of this configuration are being recorded in the tracing process: {how}, "
            "seconds each; ask again for the fit decided by the caching-allocator simulation"
        )
    return (
        "no allocation stream recorded yet for this configuration; `memfit recommend` records it locally "
        "(a template model in about 1-3 s for an 8B model; the full model where no template applies, 3-8 s per k)"
    )


def _alternative(cand: Candidate, p: Plan, job: Job, req: RecommendRequest) -> Alternative:
    """A planned candidate change as the answer lists it."""
    spec = job.spec
    ranks = min(req.cluster.gpus_per_node or 8, job.gpu_count)
    return Alternative(
        description=cand.description,
        change=cand.change,
        fits=p.fits,
        k=p.k,
        predicted_peak_bytes=p.at.predicted_bytes,
        total_upper_bytes=p.total_upper_bytes[p.at.k],
        host_memory_bytes=job.host_memory_bytes(ranks),
        path=p.curve.path,
        fit_method=p.reserved.method,
        cost=f"{cand.cost}; recompute of {p.k or 0}/{spec.num_layers} layers ~{p.recompute_fraction:.0%}"
        " of step compute"
        if p.fits
        else cand.cost,
        category=cand.category,
        throughput_loss_fraction=round(cand.throughput_loss_fraction + p.recompute_fraction, 4),
    )
