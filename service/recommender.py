"""Turn a :class:`memfit.api.RecommendRequest` into a :class:`memfit.api.Recommendation`.

Resolves the model (catalog name, HF config, explicit fields), fills training defaults from the
cluster, asks :func:`model.recommend.plan` for the curve over k, and — when nothing fits — tries
concrete alternatives (higher ZeRO stage, smaller micro-batch with gradient accumulation, more GPUs)
with the same predictor.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from memfit.api import (
    Alternative, ArchitectureIn, CurvePointOut, PredictItem, Prediction, Recommendation, RecommendRequest, TrainingIn,
)
from memfit.schema import FineTune, ModelSpec, Sharding, TrainingConfig
from model.curve import Curve, MemoryPredictor
from model.estimator import PeakMemoryRegressor
from model.overhead import OverheadModel
from model.recommend import Plan, plan
from model.terms import TermsCache


def _counted_spec(cfg_json: str) -> ModelSpec:
    from data import catalog

    return catalog.spec(json.loads(cfg_json))


_counted_spec_cached = lru_cache(maxsize=256)(_counted_spec)


def resolve_model(model: str | dict[str, Any] | ArchitectureIn) -> tuple[ModelSpec, dict[str, Any]]:
    """ModelSpec and HF config dict for a catalog name, a HF config dict or explicit fields.

    Raises:
        KeyError: unknown catalog name. ValueError: invalid architecture (names the field).
    """
    from data import catalog
    from memfit.hf import spec_fields_from_hf_config

    if isinstance(model, str):
        return catalog.spec(model), catalog.get(model)["hf_config"]
    cfg = model.hf_config() if isinstance(model, ArchitectureIn) else model
    fields = spec_fields_from_hf_config(cfg)
    ModelSpec(**fields, total_params=1, trainable_params=1)  # validate shapes before any build
    if isinstance(model, ArchitectureIn) and model.total_params is not None:
        return ModelSpec(**fields, total_params=model.total_params, trainable_params=model.total_params), cfg
    return _counted_spec_cached(json.dumps(cfg, sort_keys=True)), cfg


def lora_trainable_params(spec: ModelSpec, rank: int, target_modules: list[str] | None = None) -> int:
    """Trainable parameters of LoRA: ``rank × (in + out)`` per adapted matrix per layer (Hu et al. 2021,
    arXiv 2106.09685, Sec. 4). ``target_modules`` are PEFT names of Llama-style projections; None means
    PEFT's default for Llama-style models, the query and value projections. Unknown names count as a
    hidden × hidden matrix.
    """
    h, f = spec.hidden_size, spec.intermediate_size
    d = spec.head_dim or h // spec.num_attention_heads
    q_out, kv_out = spec.num_attention_heads * d, spec.num_key_value_heads * d
    dims = {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out), "o_proj": (q_out, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    targets = target_modules or ["q_proj", "v_proj"]
    return spec.num_layers * rank * sum(sum(dims.get(t, (h, h))) for t in targets)


def training_config(t: TrainingIn, spec: ModelSpec, gpu_count: int) -> tuple[TrainingConfig, ModelSpec]:
    """Full TrainingConfig (k = 0) and the spec with the trainable count this fine-tune implies."""
    dp = t.data_parallel_size or max(1, gpu_count // (t.tensor_parallel_size * t.pipeline_parallel_size))
    if dp * t.tensor_parallel_size * t.pipeline_parallel_size > gpu_count:
        raise ValueError(f"data*tensor*pipeline parallel size = {dp * t.tensor_parallel_size * t.pipeline_parallel_size}"
                         f" exceeds cluster.gpu_count={gpu_count}")
    if t.frozen_layers > spec.num_layers:
        raise ValueError(f"training.frozen_layers={t.frozen_layers} must be in [0, num_layers={spec.num_layers}]")
    trainable = t.trainable_params
    if trainable is None:
        if t.finetune is FineTune.LORA:
            trainable = lora_trainable_params(spec, t.lora_rank or 8, t.lora_target_modules)
        elif t.finetune is FineTune.FROZEN:
            trainable = spec.total_params * (spec.num_layers - t.frozen_layers) // spec.num_layers
        else:
            trainable = spec.total_params
    total = spec.total_params + (trainable if t.finetune is FineTune.LORA and t.trainable_params is None else 0)
    spec = spec.model_copy(update={"total_params": total, "trainable_params": min(trainable, total)})
    fields = t.model_dump(exclude={"trainable_params"})
    fields["data_parallel_size"] = dp
    if t.finetune is FineTune.LORA and fields["lora_rank"] is None:
        fields["lora_rank"] = 8
    return TrainingConfig(**fields), spec


class Recommender:
    """Holds one model version and answers requests."""

    def __init__(self, est: PeakMemoryRegressor | None, version: str, overhead: OverheadModel | None = None,
                 telemetry_range: dict[str, float] | None = None, terms: TermsCache | None = None,
                 margins: dict[str, float] | None = None, tracer: Any = None) -> None:
        self.est, self.version = est, version
        self.overhead = overhead or OverheadModel()
        self.range = telemetry_range or {}
        self.predictor = MemoryPredictor(est, terms, margins, tracer)

    def _plan(self, spec: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any], req: RecommendRequest,
              gpu_count: int) -> Plan:
        return plan(self.predictor, spec, training, hf_config=hf_config, capacity_bytes=req.cluster.memory_bytes,
                    headroom_fraction=req.headroom_fraction, device_name=req.cluster.gpu, gpu_count=gpu_count,
                    overhead_model=self.overhead, layout=req.layout)

    def curve(self, model: Any, training_in: TrainingIn, gpu_count: int = 1) -> tuple[Curve, ModelSpec, TrainingConfig]:
        """The one curve (:meth:`model.curve.MemoryPredictor.curve`) for a request's model and training."""
        spec, cfg = resolve_model(model)
        training, spec = training_config(training_in, spec, gpu_count)
        return self.predictor.curve(spec, training, cfg), spec, training

    def predict(self, item: PredictItem, index: int = 0) -> Prediction:
        """One ``/predict`` item: the curve's point at ``item.k`` (the same curve ``/recommend`` uses)."""
        c, spec, _ = self.curve(item.model, item.training, item.cluster.gpu_count if item.cluster else 1)
        if item.k > spec.num_layers:
            raise ValueError(f"items.{index}.k={item.k} must be in [0, num_layers={spec.num_layers}]")
        p = c.points[item.k]
        total = None
        if item.cluster is not None:
            total = p.upper_bytes + self.overhead.overhead(p.upper_bytes, item.cluster.gpu,
                                                           item.cluster.gpu_count).total_bytes
        return Prediction(predicted_peak_bytes=p.predicted_bytes, upper_bound_bytes=p.upper_bytes,
                          total_upper_bytes=total, breakdown=p.breakdown, num_layers=spec.num_layers, k=item.k,
                          peak_phase=p.peak_phase, path=c.path, notes=c.notes)

    def recommend(self, req: RecommendRequest) -> Recommendation:
        spec, cfg = resolve_model(req.model)
        training, spec = training_config(req.training, spec, req.cluster.gpu_count)
        p = self._plan(spec, training, cfg, req, req.cluster.gpu_count)
        at = p.at
        warnings = [*p.curve.notes, *self._warnings(spec, training, req, p)]
        alternatives = [] if p.fits else self._alternatives(spec, training, cfg, req)
        return Recommendation(
            fits=p.fits, k=p.k, layers=p.layers, num_layers=spec.num_layers,
            predicted_peak_bytes=at.predicted_bytes, upper_bound_bytes=at.upper_bytes,
            total_upper_bytes=p.total_upper_bytes[at.k], capacity_bytes=p.capacity_bytes, usable_bytes=p.usable_bytes,
            shortfall_bytes=p.shortfall_bytes,
            curve=[CurvePointOut(k=c.k, predicted_bytes=c.predicted_bytes, upper_bytes=c.upper_bytes,
                                 total_upper_bytes=t, peak_phase=c.peak_phase)
                   for c, t in zip(p.curve.points, p.total_upper_bytes)],
            breakdown=at.breakdown, peak_phase=at.peak_phase, path=p.curve.path,
            overhead={**p.overhead.__dict__, "total_bytes": p.overhead.total_bytes},
            recompute_overhead_fraction=round(p.recompute_fraction, 4), alternatives=alternatives,
            model_name=spec.model_name, model_version=self.version, warnings=warnings,
            training=training.model_dump(mode="json", exclude={"checkpoint_layers"}))

    def _warnings(self, spec: ModelSpec, training: TrainingConfig, req: RecommendRequest, p: Plan) -> list[str]:
        out = []
        for name, value in (("total_params", spec.total_params), ("seq_len", training.seq_len),
                            ("micro_batch_size", training.micro_batch_size)):
            hi = self.range.get(f"max_{name}")
            if hi is not None and value > hi:
                out.append(f"extrapolating: {name}={value} is beyond the telemetry's largest ({int(hi)})")
        if training.tensor_parallel_size > 1 or training.pipeline_parallel_size > 1:
            out.append("tensor/pipeline parallelism is predicted analytically: the telemetry has none")
        if p.fits and p.k is not None and p.total_upper_bytes[p.k] > 0.97 * p.usable_bytes:
            out.append("headroom thin: the bound at k is within 3% of usable memory")
        out.append("torch.compile can erase or invert checkpointing savings; the prediction assumes eager mode")
        if not p.fits:
            out.append("no k fits: checkpointing every layer is not enough; see alternatives")
        return out

    def _alternatives(self, spec: ModelSpec, training: TrainingConfig, cfg: dict[str, Any],
                      req: RecommendRequest) -> list[Alternative]:
        tries: list[tuple[str, dict[str, Any], TrainingConfig, int]] = []
        n = req.cluster.gpu_count
        if n > 1 and training.sharding in (Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2):
            tries.append((f"ZeRO-3 / FSDP full-shard over {n} GPUs", {"sharding": "zero3", "data_parallel_size": n},
                          training.model_copy(update={"sharding": Sharding.ZERO3, "data_parallel_size": n}), n))
        mb = training.micro_batch_size
        while mb > 1:
            mb //= 2
            tries.append((f"micro_batch_size {mb} with {training.micro_batch_size // mb}x gradient accumulation",
                          {"micro_batch_size": mb, "gradient_accumulation_steps": training.micro_batch_size // mb},
                          training.model_copy(update={"micro_batch_size": mb}), n))
        for more in (2 * max(n, 1), 4 * max(n, 1), 8 * max(n, 1)):
            t = training.model_copy(update={"sharding": Sharding.ZERO3, "data_parallel_size": more})
            tries.append((f"ZeRO-3 over {more} GPUs", {"gpu_count": more, "sharding": "zero3",
                                                        "data_parallel_size": more}, t, more))
        out = []
        for desc, change, t, gpus in tries:
            p = self._plan(spec, t, cfg, req, gpus)
            out.append(Alternative(description=desc, change=change, fits=p.fits, k=p.k,
                                   predicted_peak_bytes=p.at.predicted_bytes, total_upper_bytes=p.total_upper_bytes[p.at.k]))
            if p.fits and len([a for a in out if a.fits]) >= 3:
                break
        return [a for a in out if a.fits] or out[:3]

