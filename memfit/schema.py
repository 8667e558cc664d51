"""The one telemetry schema shared by the collector, the store, the service and the client.

A :class:`TelemetryRecord` is one measured training step: the model (:class:`ModelSpec`), the
training configuration (:class:`TrainingConfig`), the cluster (:class:`ClusterSpec`) and what was
measured (:class:`Measurement`). Every size is in bytes; names carry their unit.

Field names are unique across the four parts, so a record flattens to one row
(:meth:`TelemetryRecord.to_row`) for SQL, Parquet and CSV, and back (:meth:`TelemetryRecord.from_row`).

Bytes per parameter of each :class:`Precision` mode (weights + gradients; optimizer states are
counted by :class:`Optimizer`):

============================  =======  =====  ========================================
mode                          weights  grads  notes
============================  =======  =====  ========================================
``fp32``                      4        4      everything fp32
``amp_fp16`` / ``amp_bf16``   4        4      ``torch.autocast``: fp32 parameters, half
                                              precision activations, transient half
                                              copies of weights in forward
``bf16``                      2        2      pure bf16; optimizer states in bf16 too
``bf16_fp32_master``          2 (+4)   2 (+4) DeepSpeed/Megatron style: bf16 weights and
                                              grads plus an fp32 master copy of weights
                                              (4) and transient fp32 grads (4)
============================  =======  =====  ========================================

Optimizer state bytes per trainable parameter, in the dtype of the parameters the optimizer owns
(fp32 unless ``bf16``): AdamW 2 states (8 B fp32), SGD with momentum 1 (4 B), Adafactor factored
second moment (~0 per parameter for matrices); bitsandbytes ones whatever the parameters' dtype:
AdamW8bit 2 B + 8 B per 256 (paged: device holds only the 8/256), Lion 4 B. With mixed-precision Adam this gives the ZeRO paper's
2 + 2 + 12 = 16 bytes per parameter (Rajbhandari et al. 2020, arXiv 1910.02054, Sec. 3.1).
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from memfit.errors import InvalidConfiguration

GIB = 1 << 30

# Upper limits that reject absurd input while admitting every real model and cluster.
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 17
MAX_VOCAB = 1 << 22
MAX_PARAMS = 10**13
MAX_SEQ_LEN = 1 << 22
MAX_MICRO_BATCH = 1 << 14
MAX_WORLD = 1 << 17
MAX_GRADIENT_ACCUMULATION_STEPS = 1 << 16
MAX_DEVICE_MEMORY_BYTES = 1 << 44  # 16 TiB


class Precision(StrEnum):
    """Training numerics; see the module docstring for bytes per parameter."""

    FP32 = "fp32"
    AMP_FP16 = "amp_fp16"
    AMP_BF16 = "amp_bf16"
    BF16 = "bf16"
    BF16_FP32_MASTER = "bf16_fp32_master"


class Optimizer(StrEnum):
    """Optimizer and its kernel flavour (``torch.optim`` and bitsandbytes names).

    ``adamw_8bit`` is ``bitsandbytes.optim.AdamW8bit`` (block-wise 8-bit states: two uint8 tensors of
    the parameter's shape plus an fp32 absmax per 256-element block each; parameters under 4096
    elements keep two fp32 states; Dettmers et al. 2022, arXiv 2110.02861). ``paged_adamw_8bit`` is
    ``bitsandbytes.optim.PagedAdamW8bit``: the same states, but those of parameters with >= 1e5
    elements live in CUDA unified memory (``cudaMallocManaged``) outside PyTorch's allocator, so they
    are not in the peak allocated bytes and page out to host RAM under memory pressure. ``lion`` is
    ``bitsandbytes.optim.Lion`` (one fp32 state; Chen et al. 2023, arXiv 2302.06675).
    """

    ADAMW_FOREACH = "adamw_foreach"
    ADAMW_FUSED = "adamw_fused"
    SGD_MOMENTUM = "sgd_momentum"
    ADAFACTOR = "adafactor"
    ADAMW_8BIT = "adamw_8bit"
    PAGED_ADAMW_8BIT = "paged_adamw_8bit"
    LION = "lion"


class Quantization(StrEnum):
    """Storage of a LoRA model's frozen base linear weights (QLoRA, Dettmers et al. 2023, arXiv 2305.14314).

    bitsandbytes layouts: ``nf4`` packs two 4-bit NormalFloat codes per byte with an fp32 absmax per
    64-weight block (``Linear4bit``); ``nf4_double_quant`` quantizes those absmax values again to
    uint8 with an fp32 absmax per 256 of them ("double quantization"); ``int8`` is LLM.int8()
    (``Linear8bitLt``: int8 weights plus an fp32 scale per output row; Dettmers et al. 2022,
    arXiv 2208.07339). Embeddings, norms and ``lm_head`` stay unquantized.
    """

    NONE = "none"
    NF4 = "nf4"
    NF4_DOUBLE_QUANT = "nf4_double_quant"
    INT8 = "int8"


class PipelineSchedule(StrEnum):
    """Pipeline-parallel schedule: how many micro-batches' activations a stage holds at once.

    ``gpipe`` holds all ``num_micro_batches``; ``1f1b`` (PipeDream-Flush) holds ``pp - i`` on stage i;
    ``interleaved_1f1b`` with v model chunks per rank holds ``pp + (pp - 1) / v`` micro-batches' worth
    on the first stage (Narayanan et al. 2021, arXiv 2104.04473, Sec. 2.2).
    """

    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    GPIPE = "gpipe"


class Sharding(StrEnum):
    """Data-parallel sharding of model states.

    ``zero1`` shards optimizer states, ``zero2`` also gradients, ``zero3`` also parameters
    (arXiv 1910.02054). ``fsdp_full_shard`` re-shards parameters after forward (ZeRO-3-like);
    ``fsdp_shard_grad_op`` keeps them gathered between forward and backward and re-shards them after
    backward (FSDP's behaviour: the optimizer step holds 1/N of the weights). ``zero2`` is DeepSpeed's
    stage 2 (``deepspeed/runtime/zero/stage_1_and_2.py``): with ``bf16_fp32_master`` every 16-bit weight
    stays on the device through the step, which adds the flat 16-bit copy and the fp32 partition of the gradients, and
    backward holds the reduce bucket (:mod:`model.deepspeed_zero`); with other precisions it is answered
    like ``fsdp_shard_grad_op``. ``zero3`` with parameter offload adds DeepSpeed stage 3's device buffers.
    """

    NONE = "none"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP_FULL_SHARD = "fsdp_full_shard"
    FSDP_SHARD_GRAD_OP = "fsdp_shard_grad_op"


class Attention(StrEnum):
    """Attention kernel: ``sdpa``/``flash`` never materialise the s×s score matrix, ``eager`` does."""

    SDPA = "sdpa"
    FLASH = "flash"
    EAGER = "eager"


class FineTune(StrEnum):
    """What is trained: all weights, LoRA adapters only, or all but the first frozen layers."""

    FULL = "full"
    LORA = "lora"
    FROZEN = "frozen"


def default_precision(finetune: FineTune, quantization: Quantization = Quantization.NONE) -> Precision:
    """The precision of a job that does not give one: ``bf16`` for LoRA on an unquantized base, else ``amp_bf16``.

    A LoRA job's frozen base is loaded in bf16 by the recipes people run: PEFT's examples and TRL load the model with
    ``torch_dtype=torch.bfloat16``, torchtune's LoRA recipes build it in bf16 (``dtype: bf16``), and PEFT keeps the
    adapters in fp32 (``get_peft_model(..., autocast_adapter_dtype=True)``, peft ``mapping_func.py``), so the base
    adds 2 bytes per parameter, not autocast's 4. A QLoRA base keeps ``amp_bf16``: PEFT's
    ``prepare_model_for_kbit_training`` (peft ``utils/other.py``) casts every non-quantized fp16/bf16 parameter
    (embeddings, norms, ``lm_head``) to fp32. Full and frozen fine-tunes train under autocast with fp32 weights,
    PyTorch's and the HF Trainer's ``bf16=True`` default."""
    if finetune is FineTune.LORA and quantization is Quantization.NONE:
        return Precision.BF16
    return Precision.AMP_BF16


class Offload(StrEnum):
    """Where a part of the model states lives between uses: on the device, or in host (CPU) memory.

    ``offload_optimizer='cpu'`` is ZeRO-Offload (Ren et al. 2021, arXiv 2101.06840): optimizer states,
    fp32 master weights and the fp32 gradient copy live in host memory and the optimizer step runs on
    the CPU; the device keeps the half-precision parameters and gradients (or their shards).
    ``offload_parameters='cpu'`` is ZeRO-3 / ZeRO-Infinity parameter offload (Rajbhandari et al. 2021,
    arXiv 2104.07857) or FSDP2's ``CPUOffloadPolicy``: the device holds only the layers in flight.
    """

    NONE = "none"
    CPU = "cpu"


class CheckpointImpl(StrEnum):
    """``torch.utils.checkpoint`` flavour."""

    NON_REENTRANT = "non_reentrant"
    REENTRANT = "reentrant"


class Method(StrEnum):
    """How the peak was measured."""

    FAKE_TRACKER = "fake_tracker"  # live-storage tracker under FakeTensorMode (no allocation)
    CPU_TRACKER = "cpu_tracker"  # live-storage tracker over real CPU tensors
    CUDA = "cuda"  # torch.cuda.max_memory_allocated / max_memory_reserved


class Source(StrEnum):
    COLLECTOR = "collector"
    USER_JOB = "user_job"


class Phase(StrEnum):
    INIT = "init"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class ModelSpec(_Part):
    """Architecture of a decoder-only transformer (HF ``config.json`` terms in brackets)."""

    architecture: str = Field(min_length=1, max_length=64, description="family, HF model_type (llama, gpt2, ...)")
    model_name: str | None = Field(None, max_length=128, description="catalog name when known")
    num_layers: int = Field(ge=1, le=MAX_LAYERS, description="decoder layers [num_hidden_layers]")
    hidden_size: int = Field(ge=1, le=MAX_HIDDEN)
    num_attention_heads: int = Field(ge=1, le=4096)
    num_key_value_heads: int = Field(ge=1, le=4096, description="KV heads; < heads means GQA/MQA")
    head_dim: int | None = Field(None, ge=1, le=4096, description="set when != hidden/heads (Gemma)")
    intermediate_size: int = Field(ge=1, le=MAX_HIDDEN * 8, description="FFN width")
    vocab_size: int = Field(ge=1, le=MAX_VOCAB)
    tie_word_embeddings: bool = False
    num_experts: int | None = Field(None, ge=1, le=4096, description="MoE experts per layer")
    num_experts_per_token: int | None = Field(None, ge=1, le=4096, description="MoE top-k")
    total_params: int = Field(ge=1, le=MAX_PARAMS, description="parameters, tied weights counted once")
    trainable_params: int = Field(ge=0, le=MAX_PARAMS)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.hidden_size % self.num_attention_heads:
            raise InvalidConfiguration(
                "num_attention_heads", f"a divisor of hidden_size={self.hidden_size}", self.num_attention_heads
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidConfiguration(
                "num_key_value_heads",
                f"a divisor of num_attention_heads={self.num_attention_heads}",
                self.num_key_value_heads,
            )
        if self.trainable_params > self.total_params:
            raise InvalidConfiguration(
                "trainable_params", f"an integer in [0, total_params={self.total_params}]", self.trainable_params
            )
        if (self.num_experts is None) != (self.num_experts_per_token is None):
            raise InvalidConfiguration(
                "num_experts_per_token", "given together with num_experts (both or neither)", self.num_experts_per_token
            )
        if self.num_experts is not None and self.num_experts_per_token > self.num_experts:
            raise InvalidConfiguration(
                "num_experts_per_token",
                f"an integer in [1, num_experts={self.num_experts}]",
                self.num_experts_per_token,
            )
        return self


class TrainingConfig(_Part):
    """One training step's configuration, per data-parallel rank."""

    micro_batch_size: int = Field(ge=1, le=MAX_MICRO_BATCH, description="sequences per rank per step")
    seq_len: int = Field(ge=1, le=MAX_SEQ_LEN, description="tokens per sequence")
    precision: Precision = Precision.AMP_BF16
    optimizer: Optimizer = Optimizer.ADAMW_FOREACH
    sharding: Sharding = Sharding.NONE
    data_parallel_size: int = Field(1, ge=1, le=MAX_WORLD)
    tensor_parallel_size: int = Field(1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(1, ge=1, le=1024)
    context_parallel_size: int = Field(1, ge=1, le=1024, description="ranks splitting the sequence")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism over the TP ranks")
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    num_micro_batches: int | None = Field(
        None, ge=1, le=1 << 16, description="micro-batches per step and pipeline (default: pp)"
    )
    pipeline_chunks_per_rank: int = Field(2, ge=1, le=128, description="model chunks per rank (interleaved only)")
    expert_parallel_size: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "MoE: ranks the routed experts are split over (within the data-parallel ranks; tokens all-to-all)"
        ),
    )
    moe_imbalance_factor: float = Field(
        1.0,
        ge=1.0,
        le=4096.0,
        description=("MoE: the hottest expert's share of the routed tokens relative to balanced (1 = balanced)"),
    )
    attention: Attention = Attention.SDPA
    finetune: FineTune = FineTune.FULL
    lora_rank: int | None = Field(None, ge=1, le=4096)
    lora_target_modules: list[str] | None = None
    frozen_layers: int = Field(0, ge=0, le=MAX_LAYERS, description="leading layers (and embeddings) frozen")
    checkpoint_layers: list[int] = Field(default_factory=list, description="indices of checkpointed layers")
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NON_REENTRANT
    optimizer_in_backward: bool = Field(
        False,
        description="optimizer step fused into backward per parameter "
        "(post-accumulate-grad hooks): no full gradient buffer",
    )
    quantization: Quantization = Field(
        Quantization.NONE, description="frozen base weights' storage (QLoRA); only with finetune='lora'"
    )
    offload_optimizer: Offload = Field(
        Offload.NONE, description="optimizer states + master weights on host (ZeRO-Offload)"
    )
    offload_parameters: Offload = Field(
        Offload.NONE,
        description="parameters on host, layers gathered in flight (ZeRO-3 offload_param, FSDP2 CPUOffloadPolicy)",
    )
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        le=MAX_GRADIENT_ACCUMULATION_STEPS,
        description=(
            "micro-batches whose gradients are summed before each optimizer step; from the second micro-batch on "
            "the gradient buffer is live through forward and backward"
        ),
    )

    @property
    def num_checkpointed_layers(self) -> int:
        """k, the number of activation-checkpointed decoder layers."""
        return len(self.checkpoint_layers)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if len(set(self.checkpoint_layers)) != len(self.checkpoint_layers):
            raise InvalidConfiguration("checkpoint_layers", "distinct layer indices", self.checkpoint_layers)
        if any(i < 0 for i in self.checkpoint_layers):
            raise InvalidConfiguration("checkpoint_layers", "layer indices >= 0", self.checkpoint_layers)
        if self.finetune is FineTune.LORA and self.lora_rank is None:
            raise InvalidConfiguration(
                "lora_rank",
                "an integer in [1, 4096] when finetune='lora'",
                None,
                message="lora_rank: required when finetune='lora' (allowed: 1..4096)",
            )
        if self.finetune is not FineTune.LORA and self.lora_rank is not None:
            raise InvalidConfiguration("lora_rank", "null unless finetune='lora'", self.lora_rank)
        if self.finetune is FineTune.FROZEN and self.frozen_layers == 0:
            raise InvalidConfiguration("frozen_layers", "an integer >= 1 when finetune='frozen'", self.frozen_layers)
        if self.finetune is not FineTune.FROZEN and self.frozen_layers != 0:
            raise InvalidConfiguration("frozen_layers", "0 unless finetune='frozen'", self.frozen_layers)
        if self.sharding is not Sharding.NONE and self.sharding_group_size < 2:
            raise InvalidConfiguration(
                "sharding",
                "'none' when data_parallel_size is 1 without context parallelism "
                "(sharding needs >= 2 data x context-parallel ranks)",
                self.sharding.value,
            )
        if self.quantization is not Quantization.NONE and self.finetune is not FineTune.LORA:
            raise InvalidConfiguration(
                "quantization",
                "'none' unless finetune='lora' (a quantized base is frozen; "
                "with LoRA: one of " + ", ".join(q.value for q in Quantization) + ")",
                self.quantization.value,
            )
        if self.sequence_parallel and self.tensor_parallel_size < 2:
            raise InvalidConfiguration(
                "sequence_parallel", "true only with tensor_parallel_size >= 2", self.sequence_parallel
            )
        if self.seq_len % self.context_parallel_size:
            raise InvalidConfiguration(
                "context_parallel_size", f"a divisor of seq_len={self.seq_len}", self.context_parallel_size
            )
        if self.sequence_parallel and self.seq_len % self.tensor_parallel_size:
            raise InvalidConfiguration(
                "tensor_parallel_size",
                f"a divisor of seq_len={self.seq_len} with sequence_parallel",
                self.tensor_parallel_size,
            )
        check_offload(self.offload_optimizer, self.offload_parameters, self.sharding, self.data_parallel_size)
        self._check_pipeline()
        if self.gradient_accumulation_steps > 1 and self.optimizer_in_backward:
            raise InvalidConfiguration(
                "gradient_accumulation_steps",
                "1 with optimizer_in_backward (each parameter "
                "steps as soon as its gradient is ready: nothing accumulates)",
                self.gradient_accumulation_steps,
            )
        if self.gradient_accumulation_steps > 1 and self.pipeline_parallel_size > 1:
            raise InvalidConfiguration(
                "gradient_accumulation_steps",
                "1 with pipeline_parallel_size >= 2 (a pipeline's micro-batches per step are num_micro_batches)",
                self.gradient_accumulation_steps,
            )
        if self.data_parallel_size % self.expert_parallel_size:
            raise InvalidConfiguration(
                "expert_parallel_size",
                f"a divisor of data_parallel_size="
                f"{self.data_parallel_size} (experts are split within the data-parallel "
                "ranks)",
                self.expert_parallel_size,
            )
        return self

    def _check_pipeline(self) -> None:
        """Pipeline settings that would otherwise be ignored silently.

        Megatron-LM's interleaved schedule needs the micro-batches to be a multiple of the stages
        (``megatron/core/pipeline_parallel/schedules.py``, ``forward_backward_pipelining_with_interleaving``).
        """
        pp = self.pipeline_parallel_size
        if self.num_micro_batches is not None and pp == 1:
            raise InvalidConfiguration(
                "num_micro_batches",
                "left out unless pipeline_parallel_size >= 2 (the micro-batches a pipeline runs per step)",
                self.num_micro_batches,
            )
        if self.pipeline_chunks_per_rank != 2 and self.pipeline_schedule is not PipelineSchedule.INTERLEAVED_1F1B:
            raise InvalidConfiguration(
                "pipeline_chunks_per_rank",
                "left at its default unless pipeline_schedule='interleaved_1f1b' (model chunks per rank)",
                self.pipeline_chunks_per_rank,
            )
        if self.pipeline_schedule is PipelineSchedule.INTERLEAVED_1F1B and self.micro_batches_per_step % pp:
            raise InvalidConfiguration(
                "num_micro_batches",
                f"a multiple of pipeline_parallel_size={pp} with the interleaved schedule",
                self.micro_batches_per_step,
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans: tensor × pipeline × context parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    @property
    def sharding_group_size(self) -> int:
        """Ranks ZeRO / FSDP shard the model states over: data × context parallel size. Context-parallel ranks
        run the same micro-batch's sequence chunks and hold the same parameters, so they join the sharding group:
        torchtitan applies FSDP over the flattened ``dp_shard_cp`` mesh (``torchtitan/distributed/
        parallel_dims.py``), Megatron-LM's distributed optimizer shards over the data-parallel group with context
        parallel (``megatron/core/parallel_state.py``, ``get_data_parallel_group(with_context_parallel=True)``)."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def accumulates_gradients(self) -> bool:
        """Gradients stay on the device through the forward and backward of later micro-batches: accumulation
        over more than one micro-batch, optimizer not offloaded. With ``offload_optimizer='cpu'`` the gradients
        are accumulated in host memory (DeepSpeed ``deepspeed/runtime/zero/stage_1_and_2.py``,
        ``async_accumulate_grad_in_cpu_via_gpu``; FSDP2's ``CPUOffloadPolicy`` keeps sharded gradients on the
        host), so the device peak is that of one micro-batch."""
        return self.gradient_accumulation_steps > 1 and self.offload_optimizer is Offload.NONE

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches each pipeline runs per step (``num_micro_batches``, default the stage count)."""
        return self.num_micro_batches or self.pipeline_parallel_size


#: the LoRA rank a request or a reported job without one is taken to use: PEFT's ``LoraConfig.r`` default
#: (``peft/tuners/lora/config.py``, peft 0.21)
DEFAULT_LORA_RANK = 8


def default_data_parallel_size(
    gpu_count: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    context_parallel_size: int = 1,
    requested: int | None = None,
) -> int:
    """The data-parallel size of a job: model replicas that run different micro-batches (the one rule for the
    service, the command line, :func:`memfit.describe` and the telemetry reporter).

    ``data_parallel_size`` × tensor × pipeline × context parallel size is at most ``gpu_count``; ZeRO / FSDP
    shard over data × context-parallel ranks (:attr:`TrainingConfig.sharding_group_size`).

    * ``requested`` None: the GPUs the model-parallel sizes leave, ``gpu_count // (tp·pp·cp)`` (at least 1);
    * a ``requested`` size that already counts the context-parallel ranks — it exceeds the cluster with them
      (``requested·tp·pp·cp > gpu_count``) but not without them, and ``cp`` divides it — is the sharding group
      (``--data-parallel 4 --context-parallel 2 --gpus 4``: FSDP over 4 ranks, torchtitan's ``dp_shard_cp``, or
      DeepSpeed's data parallel over the sequence-parallel ranks): it holds ``requested / cp`` replicas;
    * any other ``requested`` is returned as given (a size beyond the cluster is the caller's error to raise,
      naming the field).

    Raises:
        ValueError: a size below 1.
    """
    tp, pp, cp = tensor_parallel_size, pipeline_parallel_size, context_parallel_size
    if min(gpu_count, tp, pp, cp, requested or 1) < 1:
        raise ValueError(
            f"parallel sizes and gpu_count must be >= 1, got gpu_count={gpu_count}, tp={tp}, pp={pp}, "
            f"cp={cp}, data_parallel_size={requested}"
        )
    if requested is None:
        return max(1, gpu_count // (tp * pp * cp))
    if cp > 1 and requested * tp * pp * cp > gpu_count >= requested * tp * pp and requested % cp == 0:
        return requested // cp
    return requested


#: sharding modes under which parameters can be offloaded (they are gathered layer by layer anyway)
PARAMETER_OFFLOAD_SHARDING = (Sharding.ZERO3, Sharding.FSDP_FULL_SHARD)


def check_offload(
    offload_optimizer: Offload, offload_parameters: Offload, sharding: Sharding, data_parallel_size: int
) -> None:
    """Validate an offload combination (the one rule, used by the schema and the API).

    Parameter offload needs the optimizer offloaded too (the optimizer step runs where the parameters
    live: DeepSpeed's ``offload_param`` with ``offload_optimizer``, FSDP2's ``CPUOffloadPolicy`` moves
    both) and parameters gathered layer by layer: ``sharding`` zero3 / fsdp_full_shard, or ``none`` on
    a single rank (ZeRO-3 on one GPU).

    Raises:
        InvalidConfiguration: naming the field and the allowed values.
    """
    if offload_parameters is Offload.CPU:
        if offload_optimizer is not Offload.CPU:
            raise InvalidConfiguration(
                "offload_optimizer",
                "'cpu' when offload_parameters='cpu'",
                message="offload_optimizer: offload_parameters='cpu' needs offload_optimizer='cpu' (allowed: 'cpu')",
            )
        if sharding not in PARAMETER_OFFLOAD_SHARDING and not (sharding is Sharding.NONE and data_parallel_size == 1):
            allowed = [s.value for s in PARAMETER_OFFLOAD_SHARDING]
            raise InvalidConfiguration(
                "sharding",
                f"one of {allowed} (or 'none' with data_parallel_size=1) when offload_parameters='cpu'",
                sharding.value,
                message=f"sharding: offload_parameters='cpu' needs sharding in {allowed} "
                f"(or 'none' with data_parallel_size=1), got {sharding.value!r}",
            )


class ClusterSpec(_Part):
    """Device and software the step ran on (or is planned for)."""

    device_name: str = Field(min_length=1, max_length=128, description="e.g. 'NVIDIA H100 80GB HBM3', 'cpu'")
    device_memory_bytes: int = Field(ge=1, le=MAX_DEVICE_MEMORY_BYTES)
    gpu_count: int = Field(1, ge=1, le=MAX_WORLD, description="devices in the job")
    torch_version: str | None = None
    transformers_version: str | None = None
    deepspeed_version: str | None = None


class Measurement(_Part):
    """What one training step used, per device. The peak is the max over the first two steps."""

    peak_allocated_bytes: int = Field(ge=0, le=1 << 50, description="max tensor bytes allocated")
    peak_reserved_bytes: int | None = Field(None, ge=0, le=1 << 50, description="CUDA caching allocator only")
    memory_after_init_bytes: int | None = Field(None, ge=0, le=1 << 50)
    memory_after_forward_bytes: int | None = Field(None, ge=0, le=1 << 50)
    peak_phase: Phase | None = None
    oom: bool = False
    step_time_s: float | None = Field(None, ge=0, description="wall time of a really executed step")
    method: Method
    source: Source = Source.COLLECTOR
    active_peak_bytes: int | None = Field(None, ge=0, le=1 << 50, description="CUDA active_bytes.all.peak")
    num_alloc_retries: int | None = Field(None, ge=0)
    outside_torch_bytes: int | None = Field(
        None, ge=0, le=1 << 50, description="device memory used outside PyTorch (context, cuBLAS, NCCL)"
    )
    recomputed_layers: int | None = Field(None, ge=0, description="layers seen recomputing in backward")
    host_peak_bytes: int | None = Field(
        None, ge=0, le=1 << 50, description="offload: peak host bytes of the offloaded states (no pinned-buffer factor)"
    )
    pipeline_stage: int | None = Field(
        None,
        ge=0,
        le=1023,
        description="pipeline parallel: the stage (0-based) of the measured device, whose peak differs by stage; "
        "None: not pipelined, or not said",
    )


def _row_fields() -> dict[str, tuple[str, Any]]:
    """Flat column name -> (part attribute, pydantic FieldInfo)."""
    out: dict[str, tuple[str, Any]] = {}
    for part, cls in (
        ("model", ModelSpec),
        ("training", TrainingConfig),
        ("cluster", ClusterSpec),
        ("measurement", Measurement),
    ):
        for name, info in cls.model_fields.items():
            assert name not in out, f"duplicate flat field {name}"
            out[name] = (part, info)
    return out


#: how far a record's ``created_at`` may lie ahead of the receiving clock (clocks of a cluster and a service differ)
CLOCK_SKEW = timedelta(days=1)


def _content_hash(parts: dict[str, Any]) -> str:
    """SHA-256 of a record's ``model``, ``training``, ``cluster`` and ``measurement`` (validated parts)."""
    body = {name: parts[name].model_dump(mode="json") for name in ("model", "training", "cluster", "measurement")}
    if body["training"]["gradient_accumulation_steps"] == 1:  # added later: hashes of older records stay valid
        del body["training"]["gradient_accumulation_steps"]
    if body["measurement"]["pipeline_stage"] is None:  # added later, likewise
        del body["measurement"]["pipeline_stage"]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class TelemetryRecord(_Part):
    """One measured training step. ``record_id`` makes ingestion idempotent: when not given it is the first 32 hex
    digits of the :meth:`content_hash`, so the same measurement sent twice (a retry) is stored once."""

    record_id: str | None = Field(
        None,
        min_length=8,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        description="the record's id; omitted or null: the first 32 hex digits of its content hash",
    )
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    model: ModelSpec
    training: TrainingConfig
    cluster: ClusterSpec
    measurement: Measurement

    @model_validator(mode="after")
    def _check(self) -> Self:
        L = self.model.num_layers
        t = self.training
        made = self.created_at if self.created_at.tzinfo is not None else self.created_at.replace(tzinfo=UTC)
        if made > datetime.now(UTC) + CLOCK_SKEW:
            raise ValueError(f"created_at={self.created_at.isoformat()} is in the future (allowed: up to now + 1 day)")
        if t.num_checkpointed_layers > L:
            raise ValueError(f"checkpointed layers k={t.num_checkpointed_layers} must be in [0, num_layers={L}]")
        if any(i >= L for i in t.checkpoint_layers):
            raise ValueError(f"checkpoint_layers indices must be in [0, {L - 1}]")
        if t.frozen_layers > L:
            raise ValueError(f"frozen_layers={t.frozen_layers} must be in [0, num_layers={L}]")
        world = t.data_parallel_size * t.model_parallel_size
        if world > self.cluster.gpu_count:
            raise ValueError(
                f"data*tensor*pipeline*context parallel size={world} exceeds gpu_count={self.cluster.gpu_count}"
            )
        if L < t.pipeline_parallel_size:
            raise ValueError(f"pipeline_parallel_size={t.pipeline_parallel_size} must be in [1, num_layers={L}]")
        stage = self.measurement.pipeline_stage
        if stage is not None and stage >= t.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_stage={stage} must be in [0, pipeline_parallel_size - 1 = {t.pipeline_parallel_size - 1}]"
            )
        if self.measurement.method is not Method.CUDA and self.measurement.peak_reserved_bytes is not None:
            raise ValueError("peak_reserved_bytes is only allowed with method='cuda'")
        if self.record_id is None:  # frozen: set once, here
            object.__setattr__(self, "record_id", self.content_hash()[:32])
        return self

    def to_row(self) -> dict[str, Any]:
        """Flatten to one dict of scalars (enums as strings, lists as JSON text)."""
        row: dict[str, Any] = {"record_id": self.record_id, "created_at": self.created_at}
        for part in ("model", "training", "cluster", "measurement"):
            for k, v in getattr(self, part).model_dump(mode="json").items():
                row[k] = json.dumps(v) if isinstance(v, list) else v
        row["num_checkpointed_layers"] = self.training.num_checkpointed_layers
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TelemetryRecord:
        """Inverse of :meth:`to_row`; raises ``pydantic.ValidationError`` naming the bad field."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "training": {}, "cluster": {}, "measurement": {}}
        for name, (part, _info) in ROW_FIELDS.items():
            if name not in row:
                continue
            v = row[name]
            if isinstance(v, float) and math.isnan(v):  # NaN from pandas means missing
                v = None
            if name in ("checkpoint_layers", "lora_target_modules") and isinstance(v, str):
                v = json.loads(v)
            if v is not None:
                parts[part][name] = v
        data: dict[str, Any] = {**parts}
        if row.get("record_id") is not None:
            data["record_id"] = row["record_id"]
        if row.get("created_at") is not None:
            data["created_at"] = row["created_at"]
        return cls.model_validate(data)

    def content_hash(self) -> str:
        """SHA-256 of everything but ``record_id`` and ``created_at``: tells a true duplicate from a conflict."""
        return _content_hash(self.__dict__)


#: flat column name -> (part, FieldInfo), for the store and Parquet/CSV
ROW_FIELDS: dict[str, tuple[str, Any]] = _row_fields()


def check_quantized_base(model: ModelSpec, training: TrainingConfig) -> None:
    """Refuse a quantized (QLoRA) base for a mixture-of-experts model: the one rule for the service (422), the
    command line (exit 2) and the tracer.

    transformers 5 holds a layer's routed experts as 3-D parameters (``MixtralExperts.gate_up_proj`` of shape
    ``(experts, 2·intermediate, hidden)``, ``models/mixtral/modeling_mixtral.py``); its bitsandbytes loader
    replaces only ``nn.Linear`` / ``Conv1D`` modules (``integrations/bitsandbytes.py``, ``replace_with_bnb_linear``;
    ``quantizers/quantizer_bnb_4bit.py`` quantizes parameters of ``Linear4bit`` modules only), bitsandbytes 0.50 has
    no 3-D 4-bit parameter type (``Params4bit`` backs ``Linear4bit``), and PEFT 0.21's ``target_parameters``
    adapts plain parameters, not 4-bit ones. So such a run keeps every expert in 16 bits and quantizes only the
    attention: not the QLoRA its users mean (transformers 4 held experts as ``nn.Linear`` modules and did quantize
    them), and no layout memfit traces.

    Raises:
        memfit.errors.InvalidConfiguration: naming ``training.quantization`` (allowed: 'none' for a MoE model).
    """
    if model.num_experts is not None and training.quantization is not Quantization.NONE:
        raise InvalidConfiguration(
            "training.quantization",
            "'none' for a mixture-of-experts model",
            training.quantization.value,
            message=f"training.quantization: {training.quantization.value!r} is not modelled for a mixture-of-experts "
            "model: transformers 5 stores the experts as 3-D parameters that bitsandbytes does not quantize "
            "(only the attention would be; allowed: 'none'; LoRA on a 16-bit base is modelled)",
        )


def check_moe_settings(model: ModelSpec, training: TrainingConfig) -> None:
    """Check the MoE settings of ``training`` against ``model`` (one rule set for the service and collector).

    Raises:
        memfit.errors.InvalidConfiguration: naming ``training.expert_parallel_size`` (must be 1 for a dense
            model, else a divisor of ``num_experts``) or ``training.moe_imbalance_factor`` (1 for a dense
            model, else in [1, num_experts / num_experts_per_token]: the hottest expert cannot receive more
            than every token).
    """
    ep, f = training.expert_parallel_size, training.moe_imbalance_factor
    E, k = model.num_experts, model.num_experts_per_token
    if E is None:
        if ep != 1:
            raise InvalidConfiguration("training.expert_parallel_size", "1 for a dense (non-MoE) model", ep)
        if f != 1.0:
            raise InvalidConfiguration("training.moe_imbalance_factor", "1 for a dense (non-MoE) model", f)
        return
    if E % ep:
        raise InvalidConfiguration("training.expert_parallel_size", f"a divisor of num_experts={E}", ep)
    if not 1.0 <= f <= E / k:
        raise InvalidConfiguration(
            "training.moe_imbalance_factor", f"a number in [1, num_experts / num_experts_per_token = {E / k:g}]", f
        )
