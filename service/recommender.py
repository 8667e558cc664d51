"""Turn a :class:`memfit.api.RecommendRequest` into a :class:`memfit.api.Recommendation`.

Resolves the model (catalog name, HF config, explicit fields), fills training defaults from the
cluster, asks :func:`model.recommend.plan` for the curve over k, and — when nothing fits, or it fits
only with heavy recompute (k > L/2) — answers "what fits instead": concrete changes
(:func:`model.recommend.candidate_changes`) each planned through the same curve, ranked by
:func:`model.recommend.rank_alternatives`.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections import OrderedDict
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from memfit.api import (
    Alternative,
    ArchitectureIn,
    Prediction,
    PredictItem,
    Recommendation,
    RecommendRequest,
    StageOut,
    TrainingIn,
)
from memfit.errors import InvalidConfiguration, UnknownArchitecture, pydantic_error_field
from memfit.hf import lora_trainable_params
from memfit.schema import (
    DEFAULT_LORA_RANK,
    GIB,
    FineTune,
    ModelSpec,
    Quantization,
    TrainingConfig,
    check_moe_settings,
    check_quantized_base,
    default_data_parallel_size,
    default_precision,
)
from model.allocator import AllocatorConfError, AllocatorSettings
from model.cuda_semantics import TARGET_GENERATION, target_generation
from model.cuda_terms import generation_curve
from model.curve import PROVISIONAL, Curve, MemoryPredictor, expert_parallel_rank
from model.offload import host_memory_bytes
from model.overhead import OverheadModel
from model.parallel import pipeline_stages
from model.recommend import (
    LONG_CONTEXT_TOKENS,
    SEQ_LEN_STEP_TOKENS,
    Candidate,
    Plan,
    candidate_changes,
    longest_fitting_seq_len,
    needs_alternatives,
    plan,
    rank_alternatives,
)
from model.terms import TermsCache

if TYPE_CHECKING:  # LightGBM (2 s to import) loads with a registry's model, not with the request checks
    from model.estimator import PeakMemoryRegressor


@lru_cache(maxsize=1)
def known_architectures() -> frozenset[str]:
    """``model_type`` values memfit can build: transformers' configuration registry plus the catalog's."""
    from data import catalog

    names = {e["hf_config"]["model_type"] for e in catalog.load_catalog().values()}
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:  # pragma: no cover - the service installs transformers
        return frozenset(names)
    return frozenset(names | set(CONFIG_MAPPING_NAMES))


@lru_cache(maxsize=512)
def _counted_spec(cfg_json: str) -> ModelSpec:
    """Spec of a HF config with its parameters counted by a ``meta``-device build (cached by content)."""
    from memfit.hf import model_spec

    cfg = json.loads(cfg_json)
    try:
        return model_spec(cfg)
    except InvalidConfiguration:
        raise
    except Exception as err:  # transformers refused the config: the user's input, not our bug
        named = config_value_problem(cfg, err)
        if named is not None:
            raise named from err
        raise InvalidConfiguration(
            "hf_config",
            "a config transformers can build",
            message=(
                f"hf_config: transformers cannot build this {cfg.get('model_type')!r} config "
                f"({type(err).__name__}: {_no_paths(str(err))[:300]})"
            ),
        ) from err


#: HF config keys naming an activation function (transformers.activations.ACT2FN)
_ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation_function", "act_fn", "afn")


def _kind(default: Any) -> tuple[str, tuple[type, ...]] | None:
    """The allowed values of a config key in words and as types, from the config class's default value."""
    if isinstance(default, bool):
        return "true or false", (bool,)
    if isinstance(default, (int, float)):
        return "a number", (int, float)
    if isinstance(default, str):
        return "a string", (str,)
    if isinstance(default, dict):
        return "an object (a JSON dict), or null", (dict,)
    if isinstance(default, list):
        return "a list", (list,)
    return None


def config_value_problem(cfg: dict[str, Any], err: Exception) -> InvalidConfiguration | None:
    """The key of a HF config that transformers refused to build (``err``), with its allowed values, or None when
    no key can be blamed. Looked for in this order: an activation name transformers does not have (its
    ``ACT2FN``: a bare ``KeyError: 'bogus'`` at build time); a value whose type differs from the config class's
    default for the key (a sub-config given as a string: ``'str' object has no attribute 'to_dict'``;
    ``rope_scaling`` is checked against ``rope_parameters``, its transformers 5 name; a string where the default is
    a number or flag); the field named by
    transformers' strict dataclass validation (``Validation error for field 'x'``); a ``KeyError`` whose key is a
    value of the config. The field is relative to the config (e.g. ``hidden_act``)."""
    from transformers import CONFIG_MAPPING
    from transformers.activations import ACT2FN

    cause = f" (transformers: {type(err).__name__})"
    for key in _ACTIVATION_KEYS:
        value = cfg.get(key)
        if value is not None and (not isinstance(value, str) or value not in ACT2FN):
            allowed = f"one of transformers' activations: {', '.join(sorted(ACT2FN))}"
            return InvalidConfiguration(
                key, allowed, message=f"{key}: must be {allowed}, got {repr(value)[:80]}" + cause
            )
    try:
        defaults = CONFIG_MAPPING[cfg["model_type"]]().to_dict()
    except Exception:  # noqa: BLE001 - no defaults to compare with: the other rules still apply
        defaults = {}
    defaults.setdefault("quantization_config", {})  # a sub-config every family accepts
    for key, value in cfg.items():
        default = defaults.get("rope_parameters" if key == "rope_scaling" else key)
        kind = _kind(default)
        # only mismatches no real config has (token ids given as lists where the default is one int are real)
        if (
            value is not None
            and kind is not None
            and ((isinstance(value, str) and kind[1] != (str,)) or (kind[1] == (dict,) and not isinstance(value, dict)))
        ):
            return InvalidConfiguration(
                key, kind[0], message=f"{key}: must be {kind[0]}, got {repr(value)[:80]}" + cause
            )
    found = re.search(r"field '(\w+)'", str(err))
    if found:
        key = found.group(1)
        key = "rope_scaling" if key == "rope_parameters" and key not in cfg and "rope_scaling" in cfg else key
        if key in cfg:
            allowed = "a value of the type transformers' config class declares for it"
            return InvalidConfiguration(
                key, allowed, message=f"{key}: must be {allowed}, got {repr(cfg[key])[:80]}" + cause
            )
    if isinstance(err, KeyError) and err.args:
        key = _path_of_value(cfg, err.args[0])
        if key is not None:
            allowed = "a value transformers knows for this key"
            if key.endswith("rope_type"):
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                allowed = f"one of transformers' RoPE types: {', '.join(sorted({'default', *ROPE_INIT_FUNCTIONS}))}"
            return InvalidConfiguration(
                key, allowed, message=f"{key}: must be {allowed}, got {err.args[0]!r:.80}" + cause
            )
    return None


def _path_of_value(cfg: dict[str, Any], value: Any, prefix: str = "") -> str | None:
    """The dotted key path of the first string equal to ``value`` in ``cfg`` and the objects in it, or None."""
    for key, v in cfg.items():
        if isinstance(v, str) and v == value:
            return f"{prefix}{key}"
        if isinstance(v, dict):
            found = _path_of_value(v, value, f"{prefix}{key}.")
            if found is not None:
                return found
    return None


def _no_paths(text: str) -> str:
    return re.sub(r"(?:[A-Za-z]:)?(?:/[\w.\-]+){2,}", "<path>", text)


def _spec(fields: dict[str, Any], **counts: int) -> ModelSpec:
    try:
        return ModelSpec(**fields, **counts)
    except ValidationError as err:
        e = err.errors()[0]
        field, message, allowed = pydantic_error_field(e, tuple(e["loc"]))
        if field == "body":  # a model-level error that names no field
            field, message = "hf_config", f"hf_config: {message}"
        elif not message.startswith(field):
            message = f"{field}: {message}"
        raise InvalidConfiguration(field, allowed or "consistent shapes", message=message) from err


def resolve_model(
    model: str | dict[str, Any] | ArchitectureIn, architecture_fallback: str | None = None
) -> tuple[ModelSpec, dict[str, Any], list[str]]:
    """ModelSpec, HF config dict and warnings for a catalog name, a HF config dict or explicit fields.

    A ``model_type`` outside :func:`known_architectures` is refused unless ``architecture_fallback``
    names a known family; then the model is predicted as that family and a warning says so.
    Resolved HF configs are cached by content (the ``meta`` build that counts parameters runs once).

    Raises:
        InvalidConfiguration (``UnknownModel``, ``UnknownArchitecture``): the field is relative to
        the request's ``model`` (e.g. ``num_key_value_heads``), with the allowed range.
    """
    if isinstance(model, str):
        spec, cfg = _catalog_model(model)
        return spec, cfg, []
    try:
        return _resolve_config(model, architecture_fallback)
    except UnknownArchitecture as err:
        raise err if err.field == "architecture_fallback" else err.within("model") from err
    except InvalidConfiguration as err:
        raise err.within("model") from err


@lru_cache(maxsize=256)
def _catalog_model(name: str) -> tuple[ModelSpec, dict[str, Any]]:
    """Spec and HF config of a catalog name (cached: built once per name, like resolved HF configs).

    Raises:
        UnknownModel: not in the catalog (not cached).
    """
    from data import catalog

    return catalog.spec(name), catalog.get(name)["hf_config"]


def model_shape(model: str | dict[str, Any] | ArchitectureIn) -> ModelSpec:
    """The model's shape (layers, widths, heads) without counting its parameters: a catalog name's spec, or a
    config's fields with placeholder counts (``total_params = trainable_params = 1``). No ``meta`` build, no
    transformers import: what the request checks of :func:`check_request` need.

    Raises:
        InvalidConfiguration (``UnknownModel``): the field is relative to the request's ``model``.
    """
    if isinstance(model, str):
        return _catalog_model(model)[0]
    try:
        return _spec(_config_fields(model), total_params=1, trainable_params=1)
    except InvalidConfiguration as err:
        raise err.within("model") from err


def _config_fields(model: dict[str, Any] | ArchitectureIn) -> dict[str, Any]:
    from memfit.hf import spec_fields_from_hf_config

    return spec_fields_from_hf_config(model.hf_config() if isinstance(model, ArchitectureIn) else model)


def _resolve_config(
    model: dict[str, Any] | ArchitectureIn, architecture_fallback: str | None
) -> tuple[ModelSpec, dict[str, Any], list[str]]:
    cfg = model.hf_config() if isinstance(model, ArchitectureIn) else model
    fields = _config_fields(cfg)
    warnings = []
    arch = fields["architecture"]
    if arch not in known_architectures():
        if architecture_fallback is None:
            raise UnknownArchitecture(
                "model_type" if isinstance(model, dict) else "architecture",
                "a model_type transformers knows (e.g. 'llama', 'mistral', 'gpt2'), or give "
                "architecture_fallback to predict it as one of those",
                arch,
            )
        if architecture_fallback not in known_architectures():
            raise UnknownArchitecture(
                "architecture_fallback", "a model_type transformers knows (e.g. 'llama')", architecture_fallback
            )
        warnings.append(
            f"model_type {arch!r} is unknown: predicted as {architecture_fallback!r} "
            "(architecture_fallback) with the same layer count, widths, heads and vocabulary"
        )
        cfg = {**cfg, "model_type": architecture_fallback}
        fields["architecture"] = architecture_fallback
    _spec(fields, total_params=1, trainable_params=1)  # validate shapes before any build
    if isinstance(model, ArchitectureIn) and model.total_params is not None:
        return _spec(fields, total_params=model.total_params, trainable_params=model.total_params), cfg, warnings
    if warnings:  # an unknown family is counted and traced as the fallback family
        cfg = {k: v for k, v in cfg.items() if k in _SHAPE_KEYS}
    return _counted_spec(json.dumps(cfg, sort_keys=True)), cfg, warnings


_SHAPE_KEYS = frozenset(
    {
        "model_type",
        "num_hidden_layers",
        "n_layer",
        "num_layers",
        "n_layers",
        "hidden_size",
        "n_embd",
        "d_model",
        "num_attention_heads",
        "n_head",
        "num_heads",
        "intermediate_size",
        "n_inner",
        "ffn_dim",
        "ffn_hidden_size",
        "vocab_size",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
    }
)


def warm_up(stop: threading.Event | None = None) -> int:
    """Import transformers and resolve every catalog HF config once (fills the caches); returns how many.
    ``stop``: when set, return before the next config (the application is shutting down)."""
    from data import catalog

    known_architectures()
    n = 0
    for name in catalog.names():
        if stop is not None and stop.is_set():
            break
        try:
            resolve_model(catalog.get(name)["hf_config"])
            n += 1
        except InvalidConfiguration:
            pass
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
    """The request's parallel layout against its model's shape (:func:`check_parallel` on :func:`model_shape`),
    before any predictor is loaded or any parameter counted: ``memfit recommend`` runs it first, so a
    ``--tensor-parallel`` the model cannot split is refused in about a second, not after the predictor's load.
    :meth:`Recommender.recommend` runs the same checks (in :func:`training_config`).

    Raises:
        InvalidConfiguration: the field named (e.g. ``training.tensor_parallel_size``), with the allowed values.
    """
    check_parallel(req.training, model_shape(req.model), req.cluster.gpu_count)


def tensor_parallel_sizes(spec: ModelSpec) -> list[int]:
    """Tensor-parallel sizes that split the model's attention: a divisor of ``num_attention_heads`` (Megatron-LM
    splits the query heads over the ranks: Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3) that divides
    ``num_key_value_heads`` or is a multiple of it (grouped KV heads split, or replicated over the ranks)."""
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    return [tp for tp in range(1, heads + 1) if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)]


def check_parallel(t: TrainingIn, spec: ModelSpec, gpu_count: int) -> int:
    """Data, tensor, sequence, context and pipeline parallel settings that cannot run on ``gpu_count`` GPUs or
    split this model (only its shape is read), as 422s naming the field and the allowed values. Returns the
    data-parallel size (:func:`memfit.schema.default_data_parallel_size`: the request's, read as the data x
    context-parallel sharding group where only that fits the cluster, else the GPUs left by the model-parallel
    sizes)."""
    tp, pp, cp = t.tensor_parallel_size, t.pipeline_parallel_size, t.context_parallel_size
    model_parallel = tp * pp * cp
    dp = default_data_parallel_size(gpu_count, tp, pp, cp, t.data_parallel_size)
    world = dp * model_parallel
    if world > gpu_count:  # name the size the request set too large: data parallel, else the largest model-parallel
        sizes = {
            "data_parallel_size": dp,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "context_parallel_size": cp,
        }
        field = (
            "data_parallel_size"
            if t.data_parallel_size and model_parallel <= gpu_count
            else max(list(sizes)[1:], key=sizes.get)
        )
        others = world // sizes[field]
        # the rule is in the message once; the allowed values are this field's range with the others as given
        allowed = (
            f"an integer in [1, {gpu_count // others}]"
            if others <= gpu_count
            else f"such that the product is at most cluster.gpu_count={gpu_count}"
        )
        raise InvalidConfiguration(
            f"training.{field}",
            allowed,
            message=(
                f"training: data*tensor*pipeline*context parallel size = {dp}*{tp}*{pp}*{cp} = {world} exceeds "
                f"cluster.gpu_count={gpu_count}"
            ),
        )
    if t.sequence_parallel and tp < 2:
        raise InvalidConfiguration(
            "training.sequence_parallel", "true only with tensor_parallel_size >= 2", t.sequence_parallel
        )
    if t.sequence_parallel and t.seq_len % tp:
        raise InvalidConfiguration(
            "training.tensor_parallel_size", f"a divisor of seq_len={t.seq_len} with sequence_parallel", tp
        )
    if t.seq_len % cp:
        raise InvalidConfiguration("training.context_parallel_size", f"a divisor of seq_len={t.seq_len}", cp)
    if cp > 1 and t.attention.value == "eager":
        raise InvalidConfiguration(
            "training.attention",
            "sdpa or flash with context_parallel_size > 1 (ring attention runs the fused kernels)",
            t.attention.value,
        )
    tp_sizes = tensor_parallel_sizes(spec)
    if tp not in tp_sizes:
        raise InvalidConfiguration(
            "training.tensor_parallel_size",
            f"one of {', '.join(map(str, tp_sizes))} (a "
            f"divisor of num_attention_heads={spec.num_attention_heads} that divides or is a "
            f"multiple of num_key_value_heads={spec.num_key_value_heads})",
            tp,
        )
    if pp > spec.num_layers:
        raise InvalidConfiguration(
            "training.pipeline_parallel_size", f"an integer in [1, num_layers={spec.num_layers}]", pp
        )
    if (
        t.pipeline_schedule.value == "interleaved_1f1b"
        and pp > 1
        and spec.num_layers % (pp * t.pipeline_chunks_per_rank)
    ):
        raise InvalidConfiguration(
            "training.pipeline_chunks_per_rank",
            f"such that pipeline_parallel_size × chunks divides num_layers={spec.num_layers}",
            t.pipeline_chunks_per_rank,
        )
    return dp


def training_config(
    t: TrainingIn, spec: ModelSpec, gpu_count: int, hf_config: dict[str, Any] | None = None
) -> tuple[TrainingConfig, ModelSpec]:
    """Full TrainingConfig (k = 0) and the spec with the trainable count this fine-tune implies.

    The HF config's ``quantization_config`` (bitsandbytes) sets ``quantization`` when the request leaves
    it out (:meth:`memfit.api.TrainingIn.resolved_quantization`).

    Raises:
        InvalidConfiguration: parallel sizes beyond the cluster, frozen layers beyond the model, a
            quantization without LoRA or one that contradicts the model's ``quantization_config``.
    """
    quantization = t.resolved_quantization((hf_config or {}).get("quantization_config"))
    if quantization is not Quantization.NONE and t.finetune is not FineTune.LORA:
        raise InvalidConfiguration(
            "training.quantization",
            f"'none' unless finetune='lora' (with LoRA: one of {', '.join(q.value for q in Quantization)})",
            quantization.value,
        )
    dp = check_parallel(t, spec, gpu_count)
    if t.frozen_layers > spec.num_layers:
        raise InvalidConfiguration(
            "training.frozen_layers", f"an integer in [0, num_layers={spec.num_layers}]", t.frozen_layers
        )
    if t.expert_parallel_size > dp or dp % t.expert_parallel_size:
        raise InvalidConfiguration(
            "training.expert_parallel_size",
            f"a divisor of the data-parallel size {dp} (experts are split within the data-parallel ranks)",
            t.expert_parallel_size,
        )
    trainable = t.trainable_params
    if trainable is not None and trainable > spec.total_params + (
        spec.total_params if t.finetune is FineTune.LORA else 0
    ):
        raise InvalidConfiguration(
            "training.trainable_params",
            f"an integer in [0, total_params={spec.total_params}] (LoRA adapters may add at most as many again)",
            trainable,
        )
    if trainable is None:
        if t.finetune is FineTune.LORA:
            trainable = lora_trainable_params(spec, t.lora_rank or DEFAULT_LORA_RANK, t.lora_target_modules, hf_config)
        elif t.finetune is FineTune.FROZEN:
            from model.frozen import trainable_params

            trainable = trainable_params(spec, t.frozen_layers, hf_config)  # embeddings frozen too
        else:
            trainable = spec.total_params
    total = spec.total_params + (trainable if t.finetune is FineTune.LORA and t.trainable_params is None else 0)
    spec = spec.model_copy(update={"total_params": total, "trainable_params": min(trainable, total)})
    fields = t.model_dump(exclude={"trainable_params"})
    fields["data_parallel_size"] = dp
    fields["quantization"] = quantization
    fields["precision"] = t.precision or default_precision(t.finetune, quantization)
    if t.finetune is FineTune.LORA and fields["lora_rank"] is None:
        fields["lora_rank"] = 8
    try:
        training = TrainingConfig(**fields)
    except ValidationError as err:  # pragma: no cover - TrainingIn has the same ranges
        field, message, allowed = pydantic_error_field(err.errors()[0], ("training", *err.errors()[0]["loc"]))
        raise InvalidConfiguration(field, allowed or "see the schema", message=message) from err
    check_moe_settings(spec, training)
    check_quantized_base(spec, training)
    return training, spec


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
    tracer is asked again). Least recently used entries go first beyond ``maxsize``.
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

    def curve(self, model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None = None) -> Curve:
        gen = TARGET_GENERATION.get()
        key = (
            model.model_dump_json(),
            training.model_dump_json(exclude={"checkpoint_layers"}),
            json.dumps(hf_config, sort_keys=True),
            gen.value if gen is not None else "",
        )
        now = time.monotonic()
        with self._lock:
            hit = self._curves.get(key)
            if hit is not None:
                self._curves.move_to_end(key)
        if hit is not None:
            c, checked, waiting = hit
            deferred = getattr(getattr(self.predictor, "tracer", None), "deferred", ())
            awaited = self._awaiting.get(key)
            stale = (awaited is not None and self.predictor.terms.get(awaited) is not None) or (
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
        with self._lock:
            self._curves[key] = (c, now, self._waiting(c))
            if awaited is None:
                self._awaiting.pop(key, None)
            else:
                self._awaiting[key] = awaited
            while len(self._curves) > self.maxsize:
                self._awaiting.pop(self._curves.popitem(last=False)[0], None)
        return c


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
        """``streams``: ``(hf_config, training, num_layers, model_name) -> StreamSource`` giving the full model's
        allocation stream per k (:func:`tracer.stream_source.stream_source`), for the fit decision on reserved
        memory (:mod:`model.reserved`); None: decide on the measured allocator allowance."""
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
        spec: ModelSpec,
        training: TrainingConfig,
        hf_config: dict[str, Any],
        req: RecommendRequest,
        gpu_count: int,
        curves: CurveCache | None = None,
        settings: AllocatorSettings | None = None,
    ) -> Plan:
        # alternatives replay only streams already recorded: one request must not record a dozen configurations
        source, why = self._stream_source(spec, training, hf_config, gpu_count, record=curves is None)
        p = plan(
            curves or self.curves,
            spec,
            training,
            hf_config=hf_config,
            capacity_bytes=req.cluster.memory_bytes,
            headroom_fraction=req.headroom_fraction,
            device_name=req.cluster.gpu,
            gpu_count=gpu_count,
            overhead_model=self.overhead,
            layout=req.layout,
            allocator=settings if settings is not None else allocator_settings(req),
            streams=source,
            no_stream_reason=why if source is None else _missing_stream_reason(source),
            fit_cache=self._fits,
        )
        while len(self._fits) > 4096:
            self._fits.popitem(last=False)
        return p

    def _stream_source(
        self, spec: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any], gpu_count: int, record: bool = True
    ) -> tuple[Any, str]:
        """The full model's stream source for the fit decision, or (None, why not)."""
        if self.streams is None:
            return None, "no allocation-stream recorder in this process"
        from tracer.stream_source import unsupported_reason

        why = unsupported_reason(training, gpu_count)
        if why is not None:
            return None, why
        key = (json.dumps(hf_config, sort_keys=True), training.model_dump_json(exclude={"checkpoint_layers"}), record)
        with self._lock:
            source = self._sources.get(key)
            if source is not None:
                self._sources.move_to_end(key)
        if source is None:  # one source per configuration: it remembers the streams it loaded and the ones missing
            source = self.streams(hf_config, training, spec.num_layers, spec.model_name, record=record)
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
        c, spec, training, _ = self._curve(model, training_in, gpu_count)
        return c, spec, training

    def _curve(
        self, model: Any, training_in: TrainingIn, gpu_count: int, architecture_fallback: str | None = None
    ) -> tuple[Curve, ModelSpec, TrainingConfig, list[str]]:
        spec, cfg, warnings = resolve_model(model, architecture_fallback)
        training, spec = training_config(training_in, spec, gpu_count, cfg)
        return self.curves.curve(spec, training, cfg), spec, training, warnings

    def predict(self, item: PredictItem, index: int = 0) -> Prediction:
        """:meth:`_predict` with the cluster's GPU generation as the target of the traced terms
        (:func:`model.cuda_semantics.target_generation`, :mod:`model.cuda_terms`)."""
        with target_generation(item.cluster.gpu if item.cluster is not None else None):
            return self._predict(item, index)

    def _predict(self, item: PredictItem, index: int = 0) -> Prediction:
        """One ``/predict`` item: the curve's point at ``item.k`` (the same curve ``/recommend`` uses).

        Raises:
            InvalidConfiguration: the item is invalid; the field starts with ``items.<index>``.
        """
        try:
            c, spec, training, warnings = self._curve(
                item.model, item.training, item.cluster.gpu_count if item.cluster else 1, item.architecture_fallback
            )
            if item.k > spec.num_layers:
                raise InvalidConfiguration("k", f"an integer in [0, num_layers={spec.num_layers}]", item.k)
        except InvalidConfiguration as err:
            raise err.within(f"items.{index}") from err
        p = c.points[item.k]
        total = None
        if item.cluster is not None:  # the allowance figure /recommend's curve gives without a simulated stream
            outside, _ = self.overhead.outside_pytorch(item.cluster.gpu, item.cluster.gpu_count)
            ratio, _ = self.overhead.allowance_ratio(expandable_segments=False)
            total = int((p.upper_bytes + self.overhead.cublas_workspace_bytes) * ratio) + outside
        return Prediction(
            predicted_peak_bytes=p.predicted_bytes,
            upper_bound_bytes=p.upper_bytes,
            total_upper_bytes=total,
            breakdown=p.breakdown,
            num_layers=spec.num_layers,
            k=item.k,
            peak_phase=p.peak_phase,
            path=c.path,
            notes=[*warnings, *c.notes],
            host_memory_bytes=host_memory_bytes(spec, training, item.cluster.ranks_per_node if item.cluster else 1),
        )

    def recommend(self, req: RecommendRequest) -> Recommendation:
        """:meth:`_recommend` with the cluster's GPU generation as the target of the traced terms."""
        with target_generation(req.cluster.gpu):
            return self._recommend(req)

    def _recommend(self, req: RecommendRequest) -> Recommendation:
        """The answer to one request.

        Raises:
            InvalidConfiguration: the request describes no valid model or training (field named).
        """
        settings = allocator_settings(req)
        base_spec, cfg, warnings = resolve_model(req.model, req.architecture_fallback)
        training, spec = training_config(req.training, base_spec, req.cluster.gpu_count, cfg)
        p = self._plan(spec, training, cfg, req, req.cluster.gpu_count)
        at = p.at
        warnings = [*warnings, *p.curve.notes, *self._warnings(spec, training, req, p), *p.reserved.notes]
        alternatives = self._alternatives(base_spec, training, cfg, req, p) if needs_alternatives(p) else []
        expandable = self._expandable_alternative(spec, training, cfg, req, p, settings)
        if expandable is not None:  # changes no numerics: offered first
            alternatives = [expandable, *alternatives]
        reserved = p.reserved.reserved_bytes
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
                }  # validated in one pass with the answer
                for c, t, r in zip(p.curve.points, p.total_upper_bytes, reserved)
            ],
            predicted_reserved_bytes=reserved[at.k],
            allocator_settings=settings.conf,
            allocator_settings_assumed=settings.describe(),
            fit_method=p.reserved.method,
            allocator_cap_bytes=p.reserved.cap_bytes,
            breakdown=at.breakdown,
            peak_phase=at.peak_phase,
            path=p.curve.path,
            overhead={**p.overhead.__dict__, "total_bytes": p.overhead.total_bytes},
            recompute_overhead_fraction=round(p.recompute_fraction, 4),
            alternatives=alternatives,
            stages=_stages_out(p),
            bottleneck_stage=p.curve.pipeline.bottleneck(at.k) if p.curve.pipeline else None,
            parameters_per_rank=max(
                st.spec.total_params for st in pipeline_stages(expert_parallel_rank(spec, training, cfg), training)
            ),
            host_memory_bytes=host_memory_bytes(spec, training, req.cluster.ranks_per_node),
            model_name=spec.model_name,
            model_version=self.version,
            warnings=warnings,
            training=training.model_dump(mode="json", exclude={"checkpoint_layers"}),
        )

    def _expandable_alternative(
        self,
        spec: ModelSpec,
        training: TrainingConfig,
        cfg: dict[str, Any],
        req: RecommendRequest,
        current: Plan,
        settings: AllocatorSettings,
    ) -> Alternative | None:
        """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when the request runs without it and it lowers k or
        makes the job fit (same curve and streams, replayed with the other setting); else None."""
        if settings.expandable_segments:
            return None
        other = AllocatorSettings.from_conf(",".join(filter(None, [settings.conf, "expandable_segments:True"])))
        p = self._plan(spec, training, cfg, req, req.cluster.gpu_count, settings=other)
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
        return _alternative(cand, p, spec, training, req, req.cluster.gpu_count)

    def _warnings(self, spec: ModelSpec, training: TrainingConfig, req: RecommendRequest, p: Plan) -> list[str]:
        out = []
        if req.training.precision is None and training.finetune is FineTune.LORA:
            out.append(default_precision_note(training))
        for name, value in (
            ("total_params", spec.total_params),
            ("seq_len", training.seq_len),
            ("micro_batch_size", training.micro_batch_size),
        ):
            hi = self.range.get(f"max_{name}")
            if hi is not None and value > hi:
                out.append(f"extrapolating: {name}={value} is beyond the telemetry's largest ({int(hi)})")
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
        if p.fits and p.k is not None and p.total_upper_bytes[p.k] > 0.97 * p.usable_bytes:
            # the smallest k that fits is often close to the line (a new user read the bare warning as noise):
            # say how close, and what one more checkpointed layer buys
            left = p.usable_bytes - p.total_upper_bytes[p.k]
            msg = (
                f"headroom thin: at k={p.k} the bound plus overhead leaves {left / GIB:.2f} GiB "
                f"({100 * left / p.usable_bytes:.1f} % of usable memory, which already keeps the headroom)"
            )
            totals = p.total_upper_bytes
            nxt = next((k for k in range(p.k + 1, len(totals)) if totals[k] < totals[p.k]), None)
            if nxt is not None:
                msg += f"; k={nxt} leaves {(p.usable_bytes - totals[nxt]) / GIB:.2f} GiB"
            out.append(msg)
        out.append("torch.compile can erase or invert checkpointing savings; the prediction assumes eager mode")
        if not p.fits:
            out.append("no k fits: checkpointing every layer is not enough; see alternatives")
        return out

    def _alternatives(
        self, base_spec: ModelSpec, training: TrainingConfig, cfg: dict[str, Any], req: RecommendRequest, current: Plan
    ) -> list[Alternative]:
        """Each candidate change planned through the same curve; ranked by :func:`model.recommend.rank_alternatives`.

        A candidate the schema refuses (e.g. ZeRO on one GPU) is skipped. Returned: the candidates that fit
        (with heavy recompute: only those that need less recompute than ``current``), ranked; when none
        fits, the three closest to fitting.
        """
        out = []
        for cand in candidate_changes(training, base_spec, req.cluster.gpu_count):
            fields = {k: v for k, v in cand.change.items() if k != "gpu_count"}
            gpus = cand.change.get("gpu_count", req.cluster.gpu_count)
            try:
                t_in = TrainingIn.model_validate({**req.training.model_dump(), **fields})
                t, spec = training_config(t_in, base_spec, gpus, cfg)
            except (ValidationError, InvalidConfiguration):
                continue
            p = self._plan(spec, t, cfg, req, gpus, self._alternative_curves)
            out.append(_alternative(cand, p, spec, t, req, gpus))
        if not current.fits and training.seq_len >= LONG_CONTEXT_TOKENS:
            shorter = self._shorter_sequence(base_spec, cfg, req)
            if shorter is not None:
                out.append(shorter)
        return rank_alternatives(out, current_recompute_fraction=current.recompute_fraction if current.fits else None)

    def _shorter_sequence(self, base_spec: ModelSpec, cfg: dict[str, Any], req: RecommendRequest) -> Alternative | None:
        """The longest shorter sequence that fits, with its k (:func:`model.recommend.longest_fitting_seq_len`), each
        length planned through the same curve as the request; None when not even the shortest step fits."""
        plans: dict[int, tuple[Plan, ModelSpec, TrainingConfig]] = {}

        def fits(seq_len: int) -> bool:
            try:
                t_in = TrainingIn.model_validate({**req.training.model_dump(), "seq_len": seq_len})
                t, spec = training_config(t_in, base_spec, req.cluster.gpu_count, cfg)
            except (ValidationError, InvalidConfiguration):  # e.g. not a multiple of the context-parallel size
                return False
            plans[seq_len] = (self._plan(spec, t, cfg, req, req.cluster.gpu_count, self._alternative_curves), spec, t)
            return plans[seq_len][0].fits

        best = longest_fitting_seq_len(req.training.seq_len, fits)
        if best is None:
            return None
        p, spec, t = plans[best]
        cand = Candidate(
            f"seq_len {best} (the longest multiple of {SEQ_LEN_STEP_TOKENS} tokens below "
            f"{req.training.seq_len} that fits)",
            {"seq_len": best},
            "shorter_sequence",
            0.0,
            f"trains on {best}-token sequences instead of {req.training.seq_len}: a shorter context",
        )
        return _alternative(cand, p, spec, t, req, req.cluster.gpu_count)


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
    return (
        "no allocation stream recorded yet for this configuration; `memfit recommend` records it locally "
        "(5-8 s per k for an 8B model)"
    )


def _alternative(
    cand: Candidate, p: Plan, spec: ModelSpec, t: TrainingConfig, req: RecommendRequest, gpus: int
) -> Alternative:
    """A planned candidate change as the answer lists it."""
    ranks = min(req.cluster.gpus_per_node or 8, gpus)
    return Alternative(
        description=cand.description,
        change=cand.change,
        fits=p.fits,
        k=p.k,
        predicted_peak_bytes=p.at.predicted_bytes,
        total_upper_bytes=p.total_upper_bytes[p.at.k],
        host_memory_bytes=host_memory_bytes(spec, t, ranks),
        path=p.curve.path,
        cost=f"{cand.cost}; recompute of {p.k or 0}/{spec.num_layers} layers ~{p.recompute_fraction:.0%}"
        " of step compute"
        if p.fits
        else cand.cost,
        category=cand.category,
        throughput_loss_fraction=round(cand.throughput_loss_fraction + p.recompute_fraction, 4),
    )
