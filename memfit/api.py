"""Request and response schema of the recommendation API, shared by the service and the client.

Sizes are bytes; ``*_gib`` inputs are accepted at the edge and converted (1 GiB = 2**30 bytes).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    WithJsonSchema,
    model_validator,
)

from memfit.errors import InvalidConfiguration, close_names
from memfit.schema import (
    MAX_DEVICE_MEMORY_BYTES,
    MAX_GRADIENT_ACCUMULATION_STEPS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_PARAMS,
    MAX_VOCAB,
    MAX_WORLD,
    Attention,
    CheckpointImpl,
    FineTune,
    Offload,
    Optimizer,
    PipelineSchedule,
    Precision,
    Quantization,
    Sharding,
    check_offload,
)

GIB = 1 << 30

#: Usable memory of a board as PyTorch sees it: the ``total`` of ``torch.cuda.mem_get_info()`` on an
#: empty device, which PyTorch's out-of-memory message prints as "GPU 0 has a total capacity of …". It is
#: below the marketed size and below nvidia-smi's "Total" (the driver keeps some). Figures read from
#: public OOM reports are used as printed; for boards without one, nvidia-smi's "Total" (MiB) times the
#: smallest usable/nvidia-smi ratio among the reported boards (A100-80GB: 79.15 GiB of 81920 MiB = 0.9894).
#: Override either with ``cluster.gpu_memory_gib`` / ``gpu_memory_bytes``.
GPU_USABLE_GIB: dict[str, tuple[float, str]] = {
    "A100-80GB": (79.15, "PyTorch OOM message"),
    "H100-80GB": (79.10, "PyTorch OOM message"),
    "V100-32GB": (31.75, "PyTorch OOM message"),
    "A100-40GB": (39.59, "PyTorch OOM message"),
    "V100-16GB": (15.78, "PyTorch OOM message"),
    "T4": (14.75, "PyTorch OOM message"),
    "RTX-4090": (23.65, "PyTorch OOM message"),
    "RTX-3090": (23.69, "PyTorch OOM message"),
}
_NVIDIA_SMI_TOTAL_MIB = {"H200": 143771, "H100-94GB": 95830, "L40S": 46068, "A10G": 23028, "L4": 23034}
_USABLE_RATIO = 79.15 * 1024 / 81920
for _name, _mib in _NVIDIA_SMI_TOTAL_MIB.items():
    GPU_USABLE_GIB[_name] = (round(_mib * _USABLE_RATIO / 1024, 2), "nvidia-smi Total x 0.9894 (no public OOM figure)")


#: GPU name -> usable device memory in bytes (see :data:`GPU_USABLE_GIB`).
GPUS: dict[str, int] = {name: int(gib * GIB) for name, (gib, _src) in GPU_USABLE_GIB.items()}


@functools.lru_cache(maxsize=256)
def gpu_catalog_name(device_name: str) -> str:
    """The :data:`GPUS` name of a board, from its catalog name or the name CUDA reports
    (``torch.cuda.get_device_name``: ``"NVIDIA H200"`` -> ``H200``, ``"NVIDIA H100 80GB HBM3"`` -> ``H100-80GB``,
    ``"NVIDIA A100-SXM4-80GB"`` -> ``A100-80GB``, ``"NVIDIA GeForce RTX 4090"`` -> ``RTX-4090``): the catalog name all
    of whose dash-separated parts are among the name's parts, the most specific when several are; the name itself,
    stripped, when none is."""
    key = device_name.strip().upper().replace("_", "-").replace(" ", "-")
    parts = {p for p in key.split("-") if p not in ("NVIDIA", "GEFORCE", "TESLA")}
    best = max(
        (known for known in GPUS if set(known.upper().split("-")) <= parts),
        key=lambda known: (len(known.split("-")), known),
        default=None,
    )
    return best if best is not None else device_name.strip()


def gpu_memory_bytes(name: str) -> int:
    """Usable memory of a known GPU as PyTorch reports it (case-insensitive; ``_``/space/``-`` alike).

    Raises:
        InvalidConfiguration (a ValueError): unknown name; the message lists the known ones and the close ones
            (:func:`memfit.errors.close_names`).
    """
    key = name.strip().upper().replace("_", "-").replace(" ", "-")
    for known, size in GPUS.items():
        if known.upper() == key:
            return size
    allowed = f"one of {', '.join(sorted(GPUS))} (or give gpu_memory_bytes / gpu_memory_gib)"
    close = close_names(name, GPUS)  # as the catalog suggests names for an unknown model (data.catalog.get)
    raise InvalidConfiguration(
        "gpu",
        allowed,
        message=f"gpu: must be {allowed}, got {name[:80]!r}"
        + (f"; close matches: {', '.join(close)}" if close else ""),
    )


#: integers in requests are strict: JSON ``true``, ``4.0`` and ``"4"`` are refused, not read as 1 or 4
StrictInt = Annotated[int, Strict()]


#: how long a client asks again, by default, for a ``/recommend`` answer whose ``pending`` is not empty, seconds
#: (:class:`memfit.client.Client`, ``memfit recommend --url``): a configuration's trace for a GPU generation and its
#: allocation streams take 3-13 s on a 2-core service (``benchmarks/results/s32_benchmark_check.txt``), longer
#: behind a queue
FINAL_WAIT_S = 120.0


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ArchitectureIn(_In):
    """Explicit architecture (when the model is neither a catalog name nor a HF config)."""

    architecture: str = Field("llama", min_length=1, max_length=64, description="HF model_type")
    num_layers: StrictInt = Field(ge=1, le=MAX_LAYERS)
    hidden_size: StrictInt = Field(ge=1, le=MAX_HIDDEN)
    num_attention_heads: StrictInt = Field(ge=1, le=4096)
    num_key_value_heads: StrictInt | None = Field(None, ge=1, le=4096)
    intermediate_size: StrictInt = Field(ge=1, le=MAX_HIDDEN * 8)
    vocab_size: StrictInt = Field(ge=1, le=MAX_VOCAB)
    tie_word_embeddings: bool = False
    total_params: StrictInt | None = Field(None, ge=1, le=MAX_PARAMS, description="counted from the shapes if omitted")

    def hf_config(self) -> dict[str, Any]:
        return {
            "model_type": self.architecture,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads or self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


def request_hf_config(model: Any) -> dict[str, Any] | None:
    """The HF config dict a request's ``model`` gives on the client, which holds no catalog configs and builds no
    model: explicit fields (:class:`ArchitectureIn`) as their config, a dict as given, None for a catalog name or
    anything else. The service resolves the same field with :func:`model.job.resolve_architecture`."""
    if isinstance(model, ArchitectureIn):
        return model.hf_config()
    return model if isinstance(model, dict) else None


#: the longest model name looked up (catalog names and HF ids are under 100 characters); a longer one is refused before
#: any lookup: the close-name search of an unknown name grows with its length (100,000 characters: seconds of CPU)
MAX_MODEL_NAME_CHARS = 200
#: bounds on a HF config given as the model: nesting of objects and arrays, characters of one string, keys of one
#: object (real config.json files nest 3 deep, hold strings under 300 characters and objects under 200 keys)
MAX_CONFIG_DEPTH, MAX_CONFIG_STRING_CHARS, MAX_CONFIG_KEYS = 16, 4096, 1024


def check_model_name(name: str) -> None:
    """Refuse a model name longer than :data:`MAX_MODEL_NAME_CHARS` without echoing it whole.

    Raises:
        ValueError: the length and the first 40 characters, with the allowed length.
    """
    if len(name) > MAX_MODEL_NAME_CHARS:
        raise ValueError(
            f"must be a catalog name or HF id of at most {MAX_MODEL_NAME_CHARS} characters, got "
            f"{len(name)} characters starting {name[:40]!r}"
        )


def _config_bounds(value: Any, path: str = "", depth: int = 1) -> None:
    """Refuse a config deeper, wider or with longer strings than :data:`MAX_CONFIG_DEPTH` etc.; the error names the
    key path (e.g. ``rope_scaling.factor``) and the bound."""
    if isinstance(value, str) and len(value) > MAX_CONFIG_STRING_CHARS:
        raise InvalidConfiguration(
            path or "model",
            f"a string of at most {MAX_CONFIG_STRING_CHARS} characters",
            message=f"{path}: must be a string of at most {MAX_CONFIG_STRING_CHARS} characters, got {len(value)}",
        )
    if not isinstance(value, (dict, list)):
        return
    if depth > MAX_CONFIG_DEPTH:
        raise InvalidConfiguration(
            path,
            f"at most {MAX_CONFIG_DEPTH} levels of nested objects and arrays",
            message=f"{path}: nested deeper than {MAX_CONFIG_DEPTH} levels of objects and "
            "arrays (a HF config.json nests 3 or 4)",
        )
    if len(value) > MAX_CONFIG_KEYS:
        raise InvalidConfiguration(
            path or "model",
            f"at most {MAX_CONFIG_KEYS} keys or items",
            message=f"{path or 'model'}: must have at most {MAX_CONFIG_KEYS} keys or items, got {len(value)}",
        )
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        name = str(key)[:64]
        _config_bounds(item, f"{path}.{name}" if path else name, depth + 1)


#: keys of a HF config.json that explicit architecture fields (:class:`ArchitectureIn`) do not have
_HF_ONLY_KEYS = frozenset(
    {
        "num_hidden_layers",
        "n_layer",
        "n_layers",
        "n_embd",
        "d_model",
        "n_head",
        "architectures",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "hidden_act",
    }
)


def _coerce_model(v: Any) -> Any:
    """A dict without ``model_type`` is explicit architecture fields: validate it as such, so errors
    name its fields instead of falling through to "not a HF config"; one with a HF config's keys
    (``num_hidden_layers``, ``architectures``, ...) is told that it lacks ``model_type``. A name or config
    beyond the bounds above is refused before any lookup."""
    if isinstance(v, str):
        check_model_name(v)
    if isinstance(v, dict):
        _config_bounds(v)
        if "model_type" not in v:
            if "architecture" not in v and "num_layers" not in v and _HF_ONLY_KEYS & set(v):
                hint = (
                    f" (its architectures say {v['architectures'][:2]!r})"
                    if isinstance(v.get("architectures"), list)
                    else ""
                )
                raise InvalidConfiguration(
                    "model_type",
                    "a HF config.json with its model_type (e.g. 'llama', 'mistral', 'gpt2'), or "
                    "explicit fields: architecture, num_layers, hidden_size, num_attention_heads, intermediate_size, "
                    "vocab_size",
                    message=f"model_type: required in a HF config.json{hint}; add it (e.g. 'llama', "
                    "'mistral', 'gpt2'), or give explicit fields: architecture, num_layers, hidden_size, "
                    "num_attention_heads, intermediate_size, vocab_size",
                )
            return ArchitectureIn.model_validate(v)
    return v


ModelIn = Annotated[str | ArchitectureIn | dict[str, Any], BeforeValidator(_coerce_model)]

#: optimizer names accepted at the API edge for an :class:`Optimizer` member: ``adamw`` is PyTorch's default
#: ``torch.optim.AdamW()`` (neither ``foreach`` nor ``fused`` given), which on CUDA runs the foreach implementation:
#: torch/optim/adam.py ``adam`` calls ``_default_to_fused_or_foreach(params, differentiable, use_fused=False)``
#: (torch/optim/optimizer.py), foreach on CUDA tensors, fused never by default
OPTIMIZER_ALIASES: dict[str, Optimizer] = {"adamw": Optimizer.ADAMW_FOREACH}


def _optimizer_alias(value: Any) -> Any:
    return OPTIMIZER_ALIASES.get(value, value) if isinstance(value, str) else value


#: an :class:`Optimizer` or an alias; the schema lists both, so a client that validates against it sends ``adamw``
OptimizerIn = Annotated[
    Optimizer,
    BeforeValidator(_optimizer_alias),
    WithJsonSchema({"type": "string", "enum": [*(o.value for o in Optimizer), *OPTIMIZER_ALIASES]}),
]


class TrainingIn(_In):
    """Training configuration without k (memfit chooses k)."""

    micro_batch_size: StrictInt = Field(ge=1, le=1 << 14)
    seq_len: StrictInt = Field(ge=1, le=1 << 22)
    precision: Precision | None = Field(
        None,
        description=(
            "default (memfit.schema.default_precision): bf16 for LoRA on an unquantized base (a bf16 frozen base, as "
            "PEFT, TRL and torchtune load it; adapters fp32), amp_bf16 otherwise (QLoRA included)"
        ),
    )
    optimizer: OptimizerIn = Field(
        Optimizer.ADAMW_FOREACH,
        description=("adamw (PyTorch's default torch.optim.AdamW) is taken as adamw_foreach, what it runs on CUDA"),
    )
    sharding: Sharding = Sharding.NONE
    data_parallel_size: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_WORLD,
        description=(
            "model replicas running different micro-batches; data x tensor x pipeline x context parallel size <= "
            "gpu_count; ZeRO/FSDP shard over data x context-parallel ranks. Default: gpu_count / (tp * pp * cp); a size "
            "that fits the cluster only as the data x context sharding group is read as that (see "
            "memfit.schema.default_data_parallel_size)"
        ),
    )
    tensor_parallel_size: StrictInt = Field(1, ge=1, le=1024)
    pipeline_parallel_size: StrictInt = Field(1, ge=1, le=1024)
    context_parallel_size: StrictInt = Field(
        1, ge=1, le=1024, description="ranks splitting the sequence; divides seq_len"
    )
    sequence_parallel: Annotated[bool, Strict()] = Field(
        False, description="Megatron sequence parallelism (needs TP > 1)"
    )
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    num_micro_batches: StrictInt | None = Field(
        None, ge=1, le=1 << 16, description="micro-batches per step through the pipeline (default: pp)"
    )
    pipeline_chunks_per_rank: StrictInt = Field(2, ge=1, le=128, description="model chunks per rank, interleaved_1f1b")
    expert_parallel_size: StrictInt = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "MoE: ranks the routed experts are split over, a divisor of num_experts and of the data-parallel size"
        ),
    )
    moe_imbalance_factor: float = Field(
        1.0,
        ge=1.0,
        le=4096.0,
        description=(
            "MoE: the hottest expert's share of routed tokens relative to balanced, in [1, num_experts / top-k]"
        ),
    )
    attention: Attention = Attention.SDPA
    finetune: FineTune = FineTune.FULL
    lora_rank: StrictInt | None = Field(None, ge=1, le=4096)
    lora_target_modules: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        None, max_length=64, description="LoRA-adapted linear layers (PEFT names); default: PEFT's for the family"
    )
    trainable_params: StrictInt | None = Field(None, ge=0, le=MAX_PARAMS, description="LoRA/frozen: trainable count")
    frozen_layers: StrictInt = Field(0, ge=0, le=MAX_LAYERS)
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NON_REENTRANT
    optimizer_in_backward: StrictBool = Field(
        False,
        description="optimizer step fused into backward per parameter "
        "(torchtune optimizer_in_bwd): no full gradient buffer",
    )
    quantization: Quantization | None = Field(
        None,
        description="frozen base weights' storage (QLoRA), only with "
        "finetune='lora'; default: the model's HF quantization_config, else "
        "'none'",
    )

    def resolved_quantization(self, quantization_config: Any = None) -> Quantization:
        """``quantization`` as given, else the one the model's HF ``quantization_config`` describes, else
        ``none`` (:func:`memfit.hf.quantization_from_hf`).

        Raises:
            InvalidConfiguration: a given value contradicts ``quantization_config`` (field
                ``training.quantization``), or the latter is not bitsandbytes (``model.quantization_config``).
        """
        from memfit.errors import InvalidConfiguration
        from memfit.hf import quantization_from_hf

        if quantization_config is None:
            return self.quantization or Quantization.NONE
        from_model = quantization_from_hf(quantization_config, field="model.quantization_config")
        if self.quantization is not None and self.quantization is not from_model:
            raise InvalidConfiguration(
                "training.quantization",
                f"{from_model.value!r} as the model's quantization_config says, or left out",
                self.quantization.value,
            )
        return from_model

    gradient_accumulation_steps: StrictInt = Field(
        1,
        ge=1,
        le=MAX_GRADIENT_ACCUMULATION_STEPS,
        description=(
            "micro-batches per optimizer step; from the second on the summed gradients stay on the device through "
            "forward and backward (not with offload_optimizer=cpu: they accumulate in host memory)"
        ),
    )
    offload_optimizer: Offload = Field(
        Offload.NONE,
        description="cpu: optimizer states, fp32 master weights and fp32 gradients in host memory (ZeRO-Offload)",
    )
    offload_parameters: Offload = Field(
        Offload.NONE,
        description="cpu: parameters in host memory, gathered layer "
        "by layer (ZeRO-3 offload_param, FSDP2 "
        "CPUOffloadPolicy); needs offload_optimizer=cpu",
    )

    @model_validator(mode="after")
    def _offload(self) -> Self:
        dp = self.data_parallel_size if self.data_parallel_size is not None else 1
        check_offload(self.offload_optimizer, self.offload_parameters, self.sharding, dp)
        return self


class ClusterIn(_In):
    gpu: str | None = Field(None, max_length=64, description=f"known GPU name: {', '.join(GPUS)}")
    gpu_memory_bytes: StrictInt | None = Field(None, ge=1 << 20, le=MAX_DEVICE_MEMORY_BYTES)
    gpu_memory_gib: float | None = Field(None, gt=0, le=MAX_DEVICE_MEMORY_BYTES / GIB)
    gpu_count: StrictInt = Field(1, ge=1, le=MAX_WORLD)
    gpus_per_node: StrictInt | None = Field(
        None, ge=1, le=1024, description="for host memory per node; default min(gpu_count, 8)"
    )

    @model_validator(mode="after")
    def _one_size(self) -> Self:
        given = [x is not None for x in (self.gpu, self.gpu_memory_bytes, self.gpu_memory_gib)]
        if sum(given) != 1:
            raise InvalidConfiguration(
                "gpu",
                "exactly one of gpu, gpu_memory_bytes, gpu_memory_gib",
                None,
                message="gpu: give exactly one of gpu, gpu_memory_bytes, gpu_memory_gib",
            )
        if self.gpu is not None:
            gpu_memory_bytes(self.gpu)
        return self

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing one host: ``gpus_per_node``, default min(gpu_count, 8)."""
        return min(self.gpus_per_node or 8, self.gpu_count)

    @property
    def memory_bytes(self) -> int:
        if self.gpu is not None:
            return gpu_memory_bytes(self.gpu)
        if self.gpu_memory_bytes is not None:
            return self.gpu_memory_bytes
        return int(self.gpu_memory_gib * GIB)


class RecommendRequest(_In):
    """``POST /recommend`` body."""

    model: ModelIn = Field(
        description="catalog name (e.g. 'llama-3-8b'), a HF config.json dict, or explicit architecture fields"
    )
    training: TrainingIn
    cluster: ClusterIn
    headroom_fraction: float = Field(0.05, ge=0, le=0.9, description="share of device memory kept free")
    layout: Literal["block", "even"] = Field("block", description="which layers: first k per stage, or spread")
    architecture_fallback: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="predict a model_type that memfit does not know as this known family (e.g. 'llama'); "
        "without it an unknown model_type is refused with 422. The answer then carries a warning",
    )
    alloc_conf: str | None = Field(
        None,
        max_length=1024,
        description="the job's PYTORCH_CUDA_ALLOC_CONF (e.g. 'expandable_segments:True'); none or '' for PyTorch's "
        "defaults. The fit is decided by replaying the step through a model of the caching allocator with it; "
        "a string PyTorch would refuse is answered 422 naming alloc_conf",
    )


class CurvePointOut(BaseModel):
    k: int
    predicted_bytes: int
    upper_bytes: int
    total_upper_bytes: int = Field(description="as the answer's total_upper_bytes, at this k")
    predicted_reserved_bytes: int | None = Field(
        None,
        description="predicted peak reserved bytes (max_memory_reserved) at k with the allocator settings assumed, "
        "on a GPU with memory to spare: the caching allocator keeps freed blocks, so this can exceed the card at a k "
        "that runs (under the cap it frees them and retries) and need not fall as k grows; `fits` is decided by "
        "the step replayed under the cap. None where the simulated fit search did not visit k",
    )
    peak_phase: str | None = Field(None, description="phase of the step where the peak falls (traced path)")
    fits: bool = Field(
        description="whether the step at k runs, by the test that chose k (the simulated caching allocator, or the "
        "allocated bound times the allowance): the answer's k is the smallest k where this is true"
    )


class Alternative(BaseModel):
    """One concrete change to the request's training or cluster, answered through the same curve."""

    description: str
    change: dict[str, Any] = Field(
        description="the changed fields (training fields, gradient_accumulation_steps among them, gpu_count, alloc_conf)"
    )
    fits: bool
    k: int | None = Field(description="smallest number of checkpointed layers that fits with the change")
    predicted_peak_bytes: int = Field(description="predicted peak allocated bytes per device at k (at L if none fits)")
    total_upper_bytes: int
    host_memory_bytes: int = Field(0, description="host (CPU) memory needed per node by offloaded states, bytes")
    path: str = Field("traced", description="traced or provisional: the path of the curve that answered")
    fit_method: str = Field(
        "allowance",
        description="simulated (the changed step replayed through the caching-allocator model) or allowance "
        "(allocated bound x the measured allocator allowance: no stream recorded for the changed configuration)",
    )
    cost: str = Field("", description="recompute / throughput cost of the change, in words")
    category: str = Field(
        "same_training",
        description="what the change gives up, in ranking order: same_training "
        "(same hardware and update), more_hardware, numerics, "
        "trained_weights (LoRA/QLoRA train other weights), "
        "shorter_sequence",
    )
    throughput_loss_fraction: float = Field(
        0.0, description="estimated throughput loss of the change plus its recompute, fraction of step time"
    )


class StageOut(BaseModel):
    """One pipeline stage's rank at the recommended k (bytes per device)."""

    stage: int
    first_layer: int
    num_layers: int
    k: int = Field(description="checkpointed layers of this stage: its first k")
    micro_batches_in_flight: float = Field(description="micro-batches whose activations the stage holds at once")
    predicted_peak_bytes: int
    parameters: int = Field(description="parameters this stage's rank holds (tensor parallelism applied)")


class Recommendation(BaseModel):
    """``POST /recommend`` answer (bytes per device)."""

    fits: bool
    k: int | None = Field(description="checkpointed layers; None when no k fits")
    layers: list[int]
    num_layers: int
    predicted_peak_bytes: int = Field(description="predicted peak allocated bytes at k")
    upper_bound_bytes: int = Field(description="calibrated upper bound of allocated bytes at k")
    total_upper_bytes: int = Field(
        description="upper bound + overhead: memory outside PyTorch, the cuBLAS workspaces and, with fit_method "
        "allowance, the allocator allowance (what must fit); with fit_method simulated the allocator's share is in "
        "predicted_reserved_bytes instead and `fits` comes from the step replayed under the cap"
    )
    capacity_bytes: int
    usable_bytes: int = Field(description="capacity x (1 - headroom)")
    shortfall_bytes: int = Field(
        0,
        description="when nothing fits: the usable memory missing at k = L (a card of capacity + shortfall / (1 - "
        "headroom) runs it); 0 when a k fits",
    )
    curve: list[CurvePointOut]
    breakdown: dict[str, int] = Field(description="parts of predicted_peak_bytes; they add up to it exactly")
    peak_phase: str | None = Field(
        None,
        description="phase where the peak falls: fwd.layers, fwd.head, bwd.head, "
        "bwd.layers, bwd.emb or opt (traced path)",
    )
    path: str = Field(
        "traced",
        description="traced (composed from traced phases), provisional (learned model), or "
        "fallback (the client's checkpoint-every-layer plan when the service gave no answer)",
    )
    overhead: dict[str, Any]
    predicted_reserved_bytes: int | None = Field(
        None,
        description="predicted peak reserved bytes at k (the caching allocator's, on a GPU with memory to spare: it "
        "can exceed the card where the step runs under the cap, see the curve's points), None where not computed",
    )
    allocator_settings: str = Field("", description="the PYTORCH_CUDA_ALLOC_CONF assumed ('' = PyTorch's defaults)")
    allocator_settings_assumed: str = Field("default", description="the allocator settings assumed, in words")
    fit_method: str = Field(
        "allowance",
        description="simulated (the step replayed through a model of PyTorch's caching allocator) or allowance "
        "(allocated bound x the measured reserved / allocated ratio, with allocator_room_bytes kept free; the "
        "warnings say why); fallback in the client's answer when the service gave none",
    )
    pending: list[Literal["terms", "allocation streams"]] = Field(
        [],
        description="what the service is still working out for this answer, which may change it: 'terms' (this "
        "configuration's trace for the GPU, queued, running or deferred by a full queue), 'allocation streams' "
        "(being recorded, or refused for now by a full queue, for the fit decision); ask again until empty. "
        "Empty: the answer is final for this model version",
    )
    allocator_cap_bytes: int | None = Field(
        None, description="what the caching allocator may reserve: usable bytes less memory outside PyTorch"
    )
    allocator_room_bytes: int | None = Field(
        None,
        description="what the step must leave free under allocator_cap_bytes: its largest request with the "
        "default allocator (capped H200 runs failed within it; the recorded stream's when simulated, else the fp32 "
        "logits or a weight's gradient), 0 with expandable segments; None where no fit was decided",
    )
    recompute_overhead_fraction: float = Field(description="extra compute per step, fraction of step compute")
    host_memory_bytes: int = Field(
        0,
        description="host (CPU) memory needed per node by offloaded model states "
        "(pinned buffers included), bytes; 0 without offload",
    )
    alternatives: list[Alternative] = []
    stages: list[StageOut] = Field([], description="per pipeline stage (pipeline/context parallel, traced path)")
    bottleneck_stage: int | None = Field(None, description="the stage whose peak is predicted_peak_bytes")
    parameters_per_rank: int | None = Field(
        None, description="parameters one rank holds (its fullest stage; tensor and expert parallelism applied)"
    )
    model_name: str | None = None
    training: dict[str, Any] | None = Field(None, description="the resolved training configuration (k excluded)")
    model_version: str
    warnings: list[str] = []


class PredictItem(_In):
    """One fully specified configuration, k included."""

    model: ModelIn
    training: TrainingIn
    k: StrictInt = Field(ge=0, le=MAX_LAYERS, description="checkpointed layers (first k of each stage)")
    cluster: ClusterIn | None = Field(None, description="for the overhead; none -> allocated bytes only")
    architecture_fallback: str | None = Field(
        None, min_length=1, max_length=64, description="as in RecommendRequest: family for an unknown model_type"
    )


class PredictRequest(_In):
    """``POST /predict`` body: a batch of configurations."""

    items: list[PredictItem] = Field(min_length=1, max_length=1024)


class Prediction(BaseModel):
    predicted_peak_bytes: int
    upper_bound_bytes: int
    total_upper_bytes: int | None = Field(
        None,
        description="when a cluster is given: upper bound + memory outside PyTorch + the cuBLAS workspaces + the "
        "allocator allowance (the allocated bound x the measured reserved/allocated ratio: fit_method allowance), "
        "as /recommend's curve gives it where it answers by allowance; where /recommend replays the step through the "
        "caching-allocator model (its fit_method simulated) its total_upper_bytes leaves the allowance out and its "
        "predicted_reserved_bytes carries the allocator. None without a cluster",
    )
    fit_method: str | None = Field(
        None, description="allowance when a cluster is given (how total_upper_bytes counts the allocator), else None"
    )
    pending: list[Literal["terms"]] = Field(
        [],
        description="as in /recommend: 'terms' while this configuration's trace (as the cluster's GPU runs it, when "
        "a cluster names one) is queued, running or deferred: the figures may change, ask again until empty. Empty "
        "when final for this model version",
    )
    breakdown: dict[str, int]
    num_layers: int
    k: int
    peak_phase: str | None = None
    path: str = "traced"
    host_memory_bytes: int = Field(0, description="host memory per node by offloaded states, bytes; 0 without offload")
    notes: list[str] = []


class PredictResponse(BaseModel):
    predictions: list[Prediction]
    model_version: str
