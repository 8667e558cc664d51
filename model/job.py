"""Resolve once: what a request's model and training are, worked out in one place and passed down.

:func:`resolve_architecture` turns a model as the API accepts it (a catalog name or alias, a HF ``config.json``
dict, explicit fields as :class:`memfit.api.ArchitectureIn`, a telemetry row's :class:`memfit.schema.ModelSpec`)
into an :class:`Architecture`: the HF config, its :class:`ModelSpec` and the facts derived from that config, each
computed once and cached on the object. :func:`resolve` adds the k-free training configuration and the cluster and
gives a :class:`Job`, with the per-rank spec, states and terms key cached on it. The service, the command line, the
evaluation, the coefficient trainer and the registry canaries resolve through here; the client, which has no
server packages, reads its own requests (:mod:`memfit.reporter`).

Errors are the domain errors of :mod:`memfit.errors` (:class:`InvalidConfiguration` and its subclasses
``UnknownModel``, ``UnknownArchitecture``), each naming the field and the allowed range; the service maps them to
HTTP 422 in one place (:mod:`service.errors`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, NamedTuple

from pydantic import ValidationError

from data import catalog
from memfit.api import ArchitectureIn, ClusterIn, TrainingIn
from memfit.errors import InvalidConfiguration, UnknownArchitecture, pydantic_error_field
from memfit.hf import (
    attention_that_runs,
    build_causal_lm,
    count_params,
    import_transformers,
    layer_period,
    local_expert_config,
    lora_trainable_params,
    max_seq_len,
    model_spec,
    num_routed_experts,
    quiet_transformers,
    small_config,
    spec_fields_from_hf_config,
)
from memfit.schema import (
    DEFAULT_LORA_RANK,
    Attention,
    FineTune,
    ModelSpec,
    Quantization,
    TrainingConfig,
    check_moe_settings,
    check_quantized_base,
    default_data_parallel_size,
    default_precision,
)
from model.analytic import ModelStates, model_state_bytes, step_temporary_bytes_per_param
from model.cuda_semantics import PRE_AMPERE, generation_of
from model.frozen import trainable_params as frozen_trainable_params
from model.offload import host_memory_bytes, offloaded
from model.parallel import RankShare, Stage, rank_share
from model.snapshot import config_key, parameter_snapshot
from model.terms import canonical_config, terms_key


@dataclass(frozen=True, eq=False)
class Architecture:
    """A resolved model: its HF config, its :class:`ModelSpec`, and the facts derived from the config, each
    computed on first use and cached on the object (one meta build or snapshot read per architecture).

    Attributes:
        hf_config: the HF ``config.json`` dict the model is built, traced and keyed from, as given (an unknown
            family predicted as its ``architecture_fallback``: its shape keys, with the fallback's
            ``model_type``); None for a telemetry row of a model neither the catalog nor the reduced MoE models
            hold.
        spec: layers, widths, heads and parameter counts (the catalog's published count for a catalog name, a
            ``meta``-device count for a config, the given count for explicit fields or a telemetry row).
        warnings: what the answer must say about how the model was read (an unknown family predicted as
            another), in words.
    """

    hf_config: dict[str, Any] | None
    spec: ModelSpec
    warnings: tuple[str, ...] = ()

    @property
    def name(self) -> str | None:
        """The catalog name (or the telemetry row's model name); None for a config or explicit fields."""
        return self.spec.model_name

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return self.spec.num_layers

    @cached_property
    def canonical_config(self) -> dict[str, Any] | None:
        """:func:`model.terms.canonical_config` of :attr:`hf_config` (None without one)."""
        return canonical_config(self.hf_config) if self.hf_config is not None else None

    @cached_property
    def key(self) -> str | None:
        """:func:`config_key` of :attr:`hf_config`: the same for a catalog name, its published config and its full
        serialisation (None without a config)."""
        return config_key(self.hf_config) if self.hf_config is not None else None

    @cached_property
    def layer_period(self) -> int:
        """Length of the repeating pattern of decoder-layer types (:func:`memfit.hf.layer_period`; 1 without a
        config)."""
        return layer_period(self.hf_config) if self.hf_config is not None else 1

    @cached_property
    def num_routed_experts(self) -> int | None:
        """Routed experts per MoE layer (:func:`memfit.hf.num_routed_experts`), None for a dense model."""
        return num_routed_experts(self.hf_config) if self.hf_config is not None else self.spec.num_experts

    @cached_property
    def parameter_split(self) -> ParameterSplit | None:
        """Parameters outside the decoder layers and in one, and one layer's parameter tensors
        (:func:`parameter_split`: the shipped snapshot, else meta builds of one and two layers); None without a
        config or where it does not build."""
        return parameter_split(self.hf_config)

    @cached_property
    def parameter_tensors(self) -> ParameterTensors | None:
        """The parameter tensors in allocation order (:func:`parameter_tensors`); None without a config or where
        it does not build."""
        return parameter_tensors(self.hf_config)

    def lora_trainable_params(self, rank: int, target_modules: list[str] | None = None) -> int:
        """LoRA adapter parameters of this model at ``rank`` (:func:`memfit.hf.lora_trainable_params`: the
        model's own adapted matrices when there is a config).

        Raises:
            InvalidConfiguration: a target name matches no linear module (field
                ``training.lora_target_modules``).
        """
        return lora_trainable_params(self.spec, rank, target_modules, self.hf_config)


@dataclass(frozen=True, eq=False)
class Job:
    """An :class:`Architecture` with its k-free training configuration on a cluster, and the facts derived
    from the three, computed on first use and cached on the object.

    Attributes:
        architecture: the resolved model.
        training: the training configuration with ``checkpoint_layers`` empty (k is the curve's variable).
        spec: the spec this job trains: :attr:`Architecture.spec` with the trainable count its fine-tune implies
            (LoRA adapters added to the total).
        gpu_count: GPUs the job runs on.
        cluster: the request's cluster, None where the caller gives none (evaluation, coefficients, canaries).
    """

    architecture: Architecture
    training: TrainingConfig
    spec: ModelSpec
    gpu_count: int = 1
    cluster: ClusterIn | None = None
    _terms_keys: dict[Any, str] = field(default_factory=dict, repr=False)

    @property
    def hf_config(self) -> dict[str, Any] | None:
        """:attr:`Architecture.hf_config`."""
        return self.architecture.hf_config

    @property
    def warnings(self) -> tuple[str, ...]:
        """:attr:`Architecture.warnings`."""
        return self.architecture.warnings

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return self.spec.num_layers

    @cached_property
    def share(self) -> RankShare:
        """What one rank holds (:func:`model.parallel.rank_share`): its expert-parallel share of :attr:`spec`, that
        share's pipeline stages (tensor parallelism applied) and their model states."""
        return rank_share(self.spec, self.training, self.hf_config)

    @property
    def rank_spec(self) -> ModelSpec:
        """What one expert-parallel rank holds (:func:`model.parallel.expert_parallel_rank`; :attr:`spec` without
        expert parallelism)."""
        return self.share.model

    @cached_property
    def rank_hf_config(self) -> dict[str, Any] | None:
        """The HF config one expert-parallel rank builds (:func:`rank_hf_config`: its share of the routed experts;
        :attr:`hf_config` without expert parallelism; None where the experts do not split that way)."""
        return rank_hf_config(self.hf_config, self.training)

    @property
    def stages(self) -> list[Stage]:
        """The pipeline stages of one rank (:func:`model.parallel.pipeline_stages` of :attr:`rank_spec`)."""
        return self.share.stages

    @cached_property
    def parameters_per_rank(self) -> int:
        """Parameters of the largest pipeline stage one rank holds."""
        return max(st.spec.total_params for st in self.stages)

    @cached_property
    def states(self) -> ModelStates:
        """Weights, gradients and optimizer states per device, bytes (:func:`model.analytic.model_state_bytes`)."""
        return model_state_bytes(self.spec, self.training)

    def host_memory_bytes(self, ranks_per_node: int) -> int:
        """Host memory one node needs for the offloaded model states, bytes (:func:`model.offload.host_memory_bytes`
        of the rank holding the fullest pipeline stage, times ``ranks_per_node``): a rank offloads its own tensor-,
        pipeline- and expert-parallel share, so tensor-parallel ranks on one node add up to one model, not one each.

        Raises:
            ValueError: ``ranks_per_node`` < 1.
        """
        if not offloaded(self.training):
            return host_memory_bytes(self.spec, self.training, ranks_per_node)  # 0, and ranks_per_node checked
        return host_memory_bytes(self.share.fullest_spec, self.training, ranks_per_node)

    @cached_property
    def step_temporary_bytes_per_param(self) -> int:
        """Bytes per parameter the optimizer step holds beyond the states
        (:func:`model.analytic.step_temporary_bytes_per_param`)."""
        return step_temporary_bytes_per_param(self.training)

    def terms_key(self, generation: Any = None) -> str:
        """:func:`model.terms.terms_key` of this job for the GPU generation ``generation`` (None: CPU-semantics
        terms), cached per generation.

        Raises:
            ValueError: the job has no HF config (a telemetry row of an unknown model).
        """
        if self.hf_config is None:
            raise ValueError(f"{self.spec.model_name!r}: no HF config, no terms key")
        if generation not in self._terms_keys:
            self._terms_keys[generation] = terms_key(self.hf_config, self.training, generation)
        return self._terms_keys[generation]


#: a model as :func:`resolve_architecture` takes it
ModelIn = str | dict[str, Any] | ArchitectureIn | ModelSpec | Architecture


def resolve(
    model: ModelIn,
    training: TrainingIn | TrainingConfig,
    cluster: ClusterIn | None = None,
    *,
    architecture_fallback: str | None = None,
    gpu_count: int | None = None,
) -> Job:
    """The :class:`Job` of a model, a training configuration and a cluster: the one resolver.

    Args:
        model: anything :func:`resolve_architecture` takes (an :class:`Architecture` is reused as is: a request's
            alternatives resolve their training only).
        training: a request's :class:`memfit.api.TrainingIn` (defaults filled and checked against the model and the
            GPUs by :func:`training_config`), or a full :class:`TrainingConfig` taken as given (a telemetry row, a
            terms entry, a canary); its ``checkpoint_layers`` are cleared either way.
        cluster: the request's cluster (its ``gpu_count``); None: one GPU unless ``gpu_count`` says otherwise.
        architecture_fallback: see :func:`resolve_architecture`.
        gpu_count: GPUs, overriding the cluster's (a candidate change that adds GPUs).

    Raises:
        InvalidConfiguration: the model (field under ``model``) or the training (field under ``training``) is
            invalid, with the allowed range.
    """
    arch = resolve_architecture(model, architecture_fallback)
    gpus = gpu_count if gpu_count is not None else (cluster.gpu_count if cluster is not None else 1)
    check_attention(training.attention, cluster.gpu if cluster is not None else None)
    if isinstance(training, TrainingIn):
        config, spec = training_config(training, arch.spec, gpus, arch.hf_config)
    else:
        config, spec = training, arch.spec
    if config.checkpoint_layers:
        config = config.model_copy(update={"checkpoint_layers": []})
    return Job(arch, config, spec, gpus, cluster)


def resolve_architecture(
    model: ModelIn, architecture_fallback: str | None = None, *, name: str | None = None
) -> Architecture:
    """The :class:`Architecture` of a model as the API, the command line or a telemetry row gives it.

    Args:
        model: a catalog name or alias (case-insensitive; the catalog's HF config and published parameter count),
            a HF ``config.json`` dict (counted on a ``meta``-device build, cached by content), explicit fields
            (:class:`memfit.api.ArchitectureIn`; counted like a config unless ``total_params`` is given), a
            telemetry row's :class:`ModelSpec` (taken as measured, with the HF config of its model name:
            :func:`data.catalog.hf_config_of`), or an :class:`Architecture` (returned as is).
        architecture_fallback: a ``model_type`` outside :func:`known_architectures` is refused unless this names
            a known family; then the model is predicted as that family and a warning says so.
        name: the model name a config dict's spec carries (a reduced MoE model's name); None for a request.

    Raises:
        InvalidConfiguration (``UnknownModel``, ``UnknownArchitecture``): the field is relative to the request's
            ``model`` (e.g. ``model.num_key_value_heads``), with the allowed range; ``architecture_fallback``
            when the fallback itself is unknown.
    """
    if isinstance(model, Architecture):
        return model
    if isinstance(model, ModelSpec):
        return Architecture(catalog.hf_config_of(model.model_name), model)
    if isinstance(model, str):
        return _catalog_architecture(catalog.get(model)["name"])  # one per catalog model, whatever alias names it
    try:
        arch = _resolve_config(model, architecture_fallback)
    except UnknownArchitecture as err:
        raise err if err.field == "architecture_fallback" else err.within("model") from err
    except InvalidConfiguration as err:
        raise err.within("model") from err
    if name is not None:
        return Architecture(arch.hf_config, arch.spec.model_copy(update={"model_name": name}), arch.warnings)
    return arch


@lru_cache(maxsize=256)
def _catalog_architecture(name: str) -> Architecture:
    """The catalog entry of a name or alias (cached: built once per name).

    Raises:
        UnknownModel: not in the catalog (not cached); its field is ``model``.
    """
    return Architecture(catalog.get(name)["hf_config"], catalog.spec(name))


def model_shape(model: str | dict[str, Any] | ArchitectureIn) -> ModelSpec:
    """The model's shape (layers, widths, heads) without counting its parameters: a catalog name's spec, or a
    config's fields with placeholder counts (``total_params = trainable_params = 1``). No ``meta`` build, no
    transformers import: what the request checks of :func:`check_parallel` need before a predictor is loaded.

    Raises:
        InvalidConfiguration (``UnknownModel``): the field is relative to the request's ``model``.
    """
    if isinstance(model, str):
        return resolve_architecture(model).spec
    try:
        return _spec(_config_fields(model), total_params=1, trainable_params=1)
    except InvalidConfiguration as err:
        raise err.within("model") from err


def _config_fields(model: dict[str, Any] | ArchitectureIn) -> dict[str, Any]:
    return spec_fields_from_hf_config(model.hf_config() if isinstance(model, ArchitectureIn) else model)


def _resolve_config(model: dict[str, Any] | ArchitectureIn, architecture_fallback: str | None) -> Architecture:
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
        spec = _spec(fields, total_params=model.total_params, trainable_params=model.total_params)
        return Architecture(cfg, spec, tuple(warnings))
    if warnings:  # an unknown family is counted and traced as the fallback family
        cfg = {k: v for k, v in cfg.items() if k in _SHAPE_KEYS}
    return Architecture(cfg, _counted_spec(json.dumps(cfg, sort_keys=True)), tuple(warnings))


class ParameterSplit(NamedTuple):
    """:func:`parameter_split`: parameters outside the decoder layers and in one, and one layer's parameter tensors."""

    outside: int
    layer: int
    layer_tensors: int


def _meta_counts(cfg: dict[str, Any]) -> tuple[int, int]:
    """(parameters, parameter tensors) of a ``meta``-device build of ``cfg`` (tied weights once)."""
    import torch

    with torch.device("meta"):
        model = build_causal_lm(cfg)
    return count_params(model)[0], sum(1 for _ in model.parameters())


@lru_cache(maxsize=1024)
def _parameter_split(config_json: str) -> ParameterSplit | None:
    cfg = json.loads(config_json)
    try:
        with quiet_transformers():
            (one, t_one), (two, t_two) = (_meta_counts(small_config(cfg, n)) for n in (1, 2))
    except Exception:  # noqa: BLE001 - a config transformers cannot build here: the caller's formula split
        return None
    layer = two - one
    return ParameterSplit(one - layer, layer, t_two - t_one) if layer > 0 and one > layer else None


def parameter_split(hf_config: dict[str, Any] | None) -> ParameterSplit | None:
    """(parameters outside the decoder layers, parameters of one decoder layer, parameter tensors of one decoder
    layer) of the model ``hf_config`` describes, counted on ``meta``-device builds of it with one and with two
    decoder layers (tied weights once); None without a config or where it does not build. Cached per config.

    Outside the layers are the token embeddings and head, and what a vocabulary-times-hidden count misses:
    learned position tables (OPT-125m, GPT-Neo-125m: 1.6 M, 3.9 % of their embeddings), the input and output
    projections of OPT-350m (its embeddings are 512 wide, not 1,024: the count is 78 % high) and final norms.
    Catalog architectures are read from the shipped snapshot (:data:`PARAMETER_SPLITS_PATH`).
    """
    if not hf_config:
        return None
    hit = parameter_snapshot("splits").get(config_key(hf_config))
    if hit is not None:
        return ParameterSplit(*(int(x) for x in hit))
    # built from the config as given: the canonical one leaves out its class's defaults, which the layer count may be
    return _parameter_split(json.dumps(hf_config, sort_keys=True))


class ParameterTensors(NamedTuple):
    """Element counts of a model's parameter tensors in the order its constructor allocates them: those registered
    before the decoder layers, one decoder layer's, and those after (tied weights once)."""

    before: tuple[int, ...]
    layer: tuple[int, ...]
    after: tuple[int, ...]

    def in_order(self, num_layers: int) -> list[int]:
        """Every tensor's element count of the ``num_layers``-layer model, in allocation order."""
        return [*self.before, *self.layer * num_layers, *self.after]


@lru_cache(maxsize=256)
def _parameter_tensors(config_json: str) -> ParameterTensors | None:
    import torch

    from memfit.hf import decoder_layers

    try:
        with quiet_transformers(), torch.device("meta"):
            model = build_causal_lm(small_config(json.loads(config_json), 2))
    except Exception:  # noqa: BLE001 - a config transformers cannot build here: no tensor list
        return None
    layers = decoder_layers(model)
    if layers is None or len(layers) != 2:
        return None
    second = {id(p) for p in layers[1].parameters()}
    in_layers = second | {id(p) for p in layers[0].parameters()}
    before: list[int] = []
    layer: list[int] = []
    after: list[int] = []
    for p in model.parameters():  # registration order: the order the constructor allocated them
        if id(p) in second:
            layer.append(p.numel())
        elif id(p) not in in_layers:
            (after if layer else before).append(p.numel())
    return ParameterTensors(tuple(before), tuple(layer), tuple(after))


def parameter_tensors(hf_config: dict[str, Any] | None) -> ParameterTensors | None:
    """The parameter tensors of the model ``hf_config`` describes, in the order its constructor allocates them
    (:class:`ParameterTensors`, from a ``meta``-device build with two decoder layers, the second one's tensors
    standing for every layer's); catalog architectures from the shipped snapshot (:data:`PARAMETER_SPLITS_PATH`).
    None without a config or where it does not build."""
    if not hf_config:
        return None
    hit = parameter_snapshot("tensors").get(config_key(hf_config))
    if hit is not None:
        return ParameterTensors(*(tuple(int(n) for n in part) for part in hit))
    return _parameter_tensors(json.dumps(hf_config, sort_keys=True))


def rank_hf_config(hf_config: dict[str, Any] | None, training: TrainingConfig) -> dict[str, Any] | None:
    """The HF config of what one expert-parallel rank builds: ``hf_config`` with ``num_experts /
    expert_parallel_size`` routed experts (:func:`memfit.hf.local_expert_config`, the tracer's shard); ``hf_config``
    itself without expert parallelism, and None when there is no config or its experts do not split that way."""
    if not hf_config or training.expert_parallel_size == 1:
        return hf_config
    try:
        return local_expert_config(hf_config, training.expert_parallel_size)
    except ValueError:
        return None


@lru_cache(maxsize=1)
def known_architectures() -> frozenset[str]:
    """``model_type`` values memfit can build: transformers' configuration registry plus the catalog's."""
    names = {e["hf_config"]["model_type"] for e in catalog.load_catalog().values()}
    try:
        import_transformers()
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:  # pragma: no cover - the service installs transformers
        return frozenset(names)
    return frozenset(names | set(CONFIG_MAPPING_NAMES))


@lru_cache(maxsize=512)
def _counted_spec(cfg_json: str) -> ModelSpec:
    """Spec of a HF config with its parameters counted by a ``meta``-device build (cached by content); catalog
    architectures' counts are read from the shipped snapshot (:data:`PARAMETER_SPLITS_PATH`, ``params``)."""
    cfg = json.loads(cfg_json)
    try:
        return model_spec(cfg, total_params=parameter_snapshot("params").get(config_key(cfg)))
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


def tensor_parallel_sizes(spec: ModelSpec) -> list[int]:
    """Tensor-parallel sizes that split the model's attention: a divisor of ``num_attention_heads`` (Megatron-LM
    splits the query heads over the ranks: Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3) that divides
    ``num_key_value_heads`` or is a multiple of it (grouped KV heads split, or replicated over the ranks)."""
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    return [tp for tp in range(1, heads + 1) if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)]


def check_attention(attention: Attention, gpu: str | None) -> None:
    """FlashAttention-2 runs on Ampere (sm80) and newer GPUs only (``Dao-AILab/flash-attention`` README: Ampere, Ada,
    Hopper); transformers refuses ``flash_attention_2`` elsewhere (:data:`model.cuda_semantics.PRE_AMPERE`).

    Raises:
        InvalidConfiguration: ``training.attention`` flash on a named pre-Ampere GPU (a V100, a T4).
    """
    if attention is Attention.FLASH and gpu is not None and generation_of(gpu) in PRE_AMPERE:
        raise InvalidConfiguration(
            "training.attention",
            f"'sdpa' or 'eager' on a {gpu} ({generation_of(gpu).value}): FlashAttention-2 needs sm80 (A100) or newer",
            attention.value,
        )


def check_parallel(t: TrainingIn, spec: ModelSpec, gpu_count: int) -> int:
    """Data, tensor, sequence, context and pipeline parallel settings that cannot run on ``gpu_count`` GPUs or
    split this model (only its shape and family are read), as 422s naming the field and the allowed values. Returns the
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
    if cp > 1 and attention_that_runs(spec.architecture, Attention(t.attention.value)) is Attention.EAGER:
        raise InvalidConfiguration(
            "training.context_parallel_size",
            f"1 for {spec.architecture}: transformers has no SDPA for it, so it runs eager attention, and ring "
            "attention runs the fused kernels",
            cp,
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
        InvalidConfiguration: parallel sizes beyond the cluster, frozen layers beyond the model, a sequence
            longer than a learned position table (:func:`memfit.hf.max_seq_len`), a quantization without LoRA or one
            that contradicts the model's ``quantization_config``.
    """
    quantization = t.resolved_quantization((hf_config or {}).get("quantization_config"))
    if quantization is not Quantization.NONE and t.finetune is not FineTune.LORA:
        allowed = f"'none' unless finetune='lora' (with LoRA: one of {', '.join(q.value for q in Quantization)})"
        raise InvalidConfiguration(
            "training.quantization",
            allowed,
            quantization.value,
            # not the request's: its model's bitsandbytes quantization_config (helper 40 never gave a quantization)
            message=None
            if t.quantization is not None
            else f"training.quantization: {quantization.value}, read from the model's quantization_config, trains "
            "LoRA adapters only (QLoRA): give finetune='lora' (a LoRA rank), or the model's config without "
            "quantization_config",
        )
    dp = check_parallel(t, spec, gpu_count)
    if t.frozen_layers > spec.num_layers:
        raise InvalidConfiguration(
            "training.frozen_layers", f"an integer in [0, num_layers={spec.num_layers}]", t.frozen_layers
        )
    limit = max_seq_len(hf_config or {})
    if limit is not None and t.seq_len > limit:
        raise InvalidConfiguration(
            "training.seq_len", f"an integer in [1, {limit}] (this model's learned position embeddings)", t.seq_len
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
            trainable = frozen_trainable_params(spec, t.frozen_layers, hf_config)  # embeddings frozen too
        else:
            trainable = spec.total_params
    total = spec.total_params + (trainable if t.finetune is FineTune.LORA and t.trainable_params is None else 0)
    spec = spec.model_copy(update={"total_params": total, "trainable_params": min(trainable, total)})
    fields = t.model_dump(exclude={"trainable_params"})
    fields["data_parallel_size"] = dp
    fields["quantization"] = quantization
    fields["precision"] = t.precision or default_precision(t.finetune, quantization)
    if t.finetune is FineTune.LORA and fields["lora_rank"] is None:
        fields["lora_rank"] = DEFAULT_LORA_RANK
    try:
        training = TrainingConfig(**fields)
    except ValidationError as err:  # pragma: no cover - TrainingIn has the same ranges
        field, message, allowed = pydantic_error_field(err.errors()[0], ("training", *err.errors()[0]["loc"]))
        raise InvalidConfiguration(field, allowed or "see the schema", message=message) from err
    check_moe_settings(spec, training)
    check_quantized_base(spec, training)
    return training, spec
