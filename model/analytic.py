"""Analytic memory terms (bytes per device). Used as predictor features and as our own baseline.

Model states follow Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", arXiv 1910.02054, Sec. 3.1 and 5 (Fig. 1): mixed-precision Adam holds
2Ψ (fp16/bf16 weights) + 2Ψ (gradients) + KΨ optimizer states with K = 12 (fp32 master weights,
momentum, variance); ZeRO stage 1 divides the optimizer states by the data-parallel degree N_d,
stage 2 also the gradients, stage 3 also the weights. FSDP full-shard is stage 3; shard-grad-op
keeps the gathered parameters from forward to backward, and is counted like stage 2.

8-bit optimizers, Lion, the optimizer step in backward and quantized (QLoRA) bases follow the layouts of
bitsandbytes 0.50.2, read from its source and checked against it in ``tests/test_optim_qlora.py``
(see :mod:`tracer.bnb`): :func:`optimizer_state_bytes_per_param`, :func:`quantized_linear_bytes`.
Offload (:class:`memfit.schema.Offload`) moves states off the device: with ``offload_optimizer='cpu'``
the device holds no optimizer states (master weights included) and runs no optimizer step; with
``offload_parameters='cpu'`` it holds no resident weights or gradients either, only the layers in
flight (:func:`in_flight_bytes`). What the host holds is :func:`model.offload.host_memory_bytes`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from memfit.hf import attention_that_runs
from memfit.schema import (
    Attention,
    FineTune,
    ModelSpec,
    Offload,
    Optimizer,
    Precision,
    Quantization,
    Sharding,
    TrainingConfig,
)
from model.cuda_semantics import flash_backward_scratch

_WEIGHT_BYTES = {
    Precision.FP32: 4,
    Precision.AMP_FP16: 4,
    Precision.AMP_BF16: 4,
    Precision.BF16: 2,
    Precision.BF16_FP32_MASTER: 2,
}
# fp32 master copy held by the optimizer in bf16_fp32_master mode (the "4" of ZeRO's K = 12)
_MASTER_BYTES = {Precision.BF16_FP32_MASTER: 4}
# optimizer state tensors per trainable parameter (Adafactor's factored moments are O(rows + cols): 0 here)
_STATES = {Optimizer.ADAMW_FOREACH: 2, Optimizer.ADAMW_FUSED: 2, Optimizer.SGD_MOMENTUM: 1, Optimizer.ADAFACTOR: 0}
#: bitsandbytes optimizers: state bytes per parameter whatever the parameters' dtype. AdamW8bit: two uint8
#: states plus two fp32 absmax per 256-element block (2 + 8/256); parameters under 4096 elements keep two
#: fp32 states (8 B), which this lower bound does not count. Lion (32-bit): one fp32 state.
_BNB_STATE_BYTES = {Optimizer.ADAMW_8BIT: 2 + 8 / 256, Optimizer.PAGED_ADAMW_8BIT: 2 + 8 / 256, Optimizer.LION: 4.0}
#: bytes of PagedAdamW8bit's states that live in CUDA unified memory, outside PyTorch's allocator
_PAGED_STATE_BYTES = {Optimizer.PAGED_ADAMW_8BIT: 2.0}
BLOCK_BYTES = 512


def _blocks(nbytes: float) -> int:
    """Bytes the CUDA caching allocator gives a tensor of ``nbytes`` (512-byte blocks)."""
    return -(-int(nbytes) // BLOCK_BYTES) * BLOCK_BYTES


def weight_dtype_bytes(precision: Precision) -> int:
    """Bytes per element of the parameters as the model stores them (``memfit.hf.param_dtype``): 2 in ``bf16`` and
    ``bf16_fp32_master``, 4 otherwise (AMP keeps fp32 weights)."""
    return _WEIGHT_BYTES[precision]


def state_dtype_bytes(precision: Precision) -> int:
    """Bytes per element of a torch optimizer's states and of the tensors it steps: 2 in pure ``bf16`` (bf16
    parameters, no master copy), 4 otherwise (fp32 parameters, or the fp32 masters of ``bf16_fp32_master``)."""
    return 2 if precision is Precision.BF16 else 4


#: optimizers whose step builds one whole-list temporary in the states' dtype (module docstring of
#: :func:`step_temporary_bytes_per_param`)
_STEP_TEMPORARY_OPTIMIZERS = (Optimizer.ADAMW_FOREACH, Optimizer.ADAFACTOR)


def step_temporary_bytes_per_param(training: TrainingConfig, dtype_bytes: int | None = None) -> int:
    """Bytes per stepped parameter the optimizer step allocates at once beyond the states (the ``opt`` phase): the
    one step-temporary formula of memfit (analytic estimate, frozen layers, ZeRO-1, DeepSpeed stage 2).

    One copy in the states' dtype (``dtype_bytes``; default :func:`state_dtype_bytes`: 4, 2 in pure bf16) for the
    steps that build a whole-list temporary: foreach AdamW (``torch/optim/adamw.py`` ``_multi_tensor_adamw``:
    ``torch._foreach_sqrt`` of the variances) and Adafactor (``torch/optim/_adafactor.py``: the squared
    gradients); none for fused AdamW, SGD with momentum and the bitsandbytes optimizers (one kernel per tensor, in
    place) and for a step in backward (one parameter at a time). As the traced terms show it
    (``tests/test_step_temporaries.py``: the ``opt`` phase of each shipped configuration against the same one with
    fused AdamW, less the states' difference, per trainable parameter): foreach AdamW 4.000 (2.000 in pure bf16),
    Adafactor 4.00-4.01 (2.00), SGD, 8-bit AdamW, Lion 0.00.
    """
    if training.optimizer_in_backward or training.optimizer not in _STEP_TEMPORARY_OPTIMIZERS:
        return 0
    return state_dtype_bytes(training.precision) if dtype_bytes is None else dtype_bytes


def optimizer_state_bytes_per_param(training: TrainingConfig) -> tuple[float, float]:
    """(device, paged) optimizer-state bytes per trainable parameter, fp32 master copy included.

    torch optimizers keep their states in the parameters' dtype (fp32 unless pure ``bf16``);
    bitsandbytes ones as in ``_BNB_STATE_BYTES``; ``paged_adamw_8bit``'s uint8 states are paged (the
    second number) and only the fp32 absmax values stay in device memory.
    """
    master = _MASTER_BYTES.get(training.precision, 0)
    if training.optimizer in _BNB_STATE_BYTES:
        paged = _PAGED_STATE_BYTES.get(training.optimizer, 0.0)
        return _BNB_STATE_BYTES[training.optimizer] - paged + master, paged
    return float(_STATES[training.optimizer] * state_dtype_bytes(training.precision) + master), 0.0


def quantized_linear_bytes(out_features: int, in_features: int, quantization: Quantization) -> int:
    """Device bytes of one bitsandbytes-quantized linear weight of shape (out, in), constants included.

    * ``nf4`` (``Linear4bit``, ``quantize_4bit(blocksize=64)``): ceil(n/2) bytes of packed codes, an
      fp32 absmax per 64 weights and the 16-value fp32 NF4 code;
    * ``nf4_double_quant`` (``compress_statistics=True``): the absmax values as uint8 with an fp32
      absmax per 256 of them (``quantize_blockwise(blocksize=256)``), an fp32 offset (their mean) and the
      layer's own copy of the 256-value fp32 8-bit code (``code.to(device, copy=True)``);
      QLoRA, Dettmers et al. 2023, arXiv 2305.14314, Sec. 3 "Double Quantization";
    * ``int8`` (``Linear8bitLt``, LLM.int8, arXiv 2208.07339): int8 weights and an fp32 scale per row.

    Each tensor is rounded to the allocator's 512-byte blocks.

    Raises:
        ValueError: ``quantization`` is ``none``.
    """
    n = out_features * in_features
    if quantization is Quantization.INT8:
        return _blocks(n) + _blocks(4 * out_features)
    if quantization is Quantization.NONE:
        raise ValueError("quantization='none' has no quantized layout")
    blocks = -(-n // 64)
    packed = _blocks(-(-n // 2)) + _blocks(16 * 4)
    if quantization is Quantization.NF4:
        return packed + _blocks(4 * blocks)
    return packed + _blocks(blocks) + _blocks(4 * -(-blocks // 256)) + _blocks(4) + _blocks(256 * 4)


def decoder_linear_shapes(model: ModelSpec, tensor_parallel_size: int = 1) -> list[tuple[int, int]]:
    """(out, in) of the linear layers of one decoder layer as one tensor-parallel rank holds them: q, k, v, o and
    the MLP (gate, up, down for gated families; up, down otherwise). Biases are not weights of these shapes and
    stay unquantized.

    Megatron-LM's layout (Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3; ``megatron/core/tensor_parallel/
    layers.py``: ``ColumnParallelLinear`` splits the output dimension, ``RowParallelLinear`` the input one):
    q, k, v and gate/up are split by their output (heads, FFN columns), o and down by their input. A rank
    holds at least one KV head: with more ranks than KV heads the heads are replicated
    (``megatron/core/transformer/attention.py``, ``num_query_groups_per_partition``). Uneven splits give
    rank 0 the ceiling. With ``tensor_parallel_size`` 1 the full shapes.

    Raises:
        ValueError: ``tensor_parallel_size`` < 1.
    """
    t = tensor_parallel_size
    if t < 1:
        raise ValueError(f"tensor_parallel_size={t} must be >= 1")
    h = model.hidden_size
    d = model.head_dim or h // model.num_attention_heads
    q = -(-model.num_attention_heads // t) * d
    kv = max(1, model.num_key_value_heads // t) * d
    f = -(-model.intermediate_size // t)
    mlp = [(f, h), (f, h), (h, f)] if model.architecture in GATED_MLP_FAMILIES else [(f, h), (h, f)]
    return [(q, h), (kv, h), (kv, h), (h, q), *mlp]


def quantized_base_bytes(
    model: ModelSpec, quantization: Quantization, tensor_parallel_size: int = 1
) -> tuple[int, int]:
    """(weights quantized, their device bytes) over all decoder layers of one tensor-parallel rank
    (:func:`decoder_linear_shapes`, :func:`quantized_linear_bytes`)."""
    return _quantized_layers_bytes(
        tuple(decoder_linear_shapes(model, tensor_parallel_size)), model.num_layers, quantization
    )


@functools.lru_cache(maxsize=1024)
def _quantized_layers_bytes(
    shapes: tuple[tuple[int, int], ...], layers: int, quantization: Quantization
) -> tuple[int, int]:
    n = sum(o * i for o, i in shapes) * layers
    return n, sum(quantized_linear_bytes(o, i, quantization) for o, i in shapes) * layers


@dataclass(frozen=True)
class ModelStates:
    """Per-device bytes of weights, gradients and optimizer states (master weights included), and their sum."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes", self.weights_bytes + self.gradients_bytes + self.optimizer_bytes)


def routed_expert_params(model: ModelSpec, num_experts: int) -> int:
    """Parameters of ``num_experts`` routed experts in every decoder layer, at most ``total_params``: each expert is a
    gated MLP of ``3 · hidden · intermediate`` parameters (Mixtral, OLMoE, Qwen-MoE, DeepSeek: ``intermediate_size`` is
    the expert's width, :func:`memfit.hf.spec_fields_from_hf_config`)."""
    return min(model.num_layers * num_experts * 3 * model.hidden_size * model.intermediate_size, model.total_params)


def routed_expert_share(model: ModelSpec, training: TrainingConfig) -> float:
    """The fraction of the parameters one expert-parallel rank holds (``model``: that rank's counts,
    :func:`expert_parallel_rank_spec`) that are its ``num_experts / expert_parallel_size`` routed
    experts (:func:`routed_expert_params`); 0 without expert parallelism."""
    ep = training.expert_parallel_size
    if ep == 1 or not model.num_experts or model.total_params <= 0:
        return 0.0
    return routed_expert_params(model, model.num_experts // ep) / model.total_params


def model_state_bytes(model: ModelSpec, training: TrainingConfig, *, zero1_lower_bound: bool = False) -> ModelStates:
    """Weights, gradients and optimizer states held by one data-parallel rank.

    Args:
        model: total and trainable parameter counts are used (LoRA/frozen: states only for trainable).
        training: precision, optimizer, sharding over :attr:`~memfit.schema.TrainingConfig.sharding_group_size`
            ranks (data × context parallel; and expert-parallel size: a rank's routed
            experts are sharded over ``data_parallel_size / expert_parallel_size`` ranks only,
            :func:`routed_expert_share`).
        zero1_lower_bound: ZeRO-1 as run by ``torch.distributed.optim.ZeroRedundancyOptimizer``
            partitions whole parameters greedily, so rank 0's share of the optimizer states is not
            exactly 1/N; with True, ZeRO-1 optimizer states count as 0, a guaranteed lower bound.

    Returns:
        :class:`ModelStates` in bytes. Gradients and optimizer states exist for trainable parameters
        only; gradients have the weights' dtype, optimizer states are fp32 except in pure ``bf16``
        (:func:`optimizer_state_bytes_per_param`; paged states are not device memory and not counted).
        With ``optimizer_in_backward`` no gradient outlives its parameter's step: gradients count 0.
        A quantized base counts its decoder linears by :func:`quantized_base_bytes` and the LoRA adapters
        in fp32 (PEFT does not cast adapters to a uint8 base weight's dtype). Memoised per spec and the training
        fields it reads: one request asks for the same states many times.
    """
    t = training
    key = (
        zero1_lower_bound,
        *model.__dict__.items(),  # every ModelSpec field, by name: hashable scalars
        # the training fields read below (and by quantized_base_bytes, routed_expert_share)
        t.precision,
        t.optimizer,
        t.quantization,
        t.finetune,
        t.tensor_parallel_size,
        t.optimizer_in_backward,
        t.sharding,
        t.sharding_group_size,
        t.expert_parallel_size,
        t.offload_optimizer,
        t.offload_parameters,
    )
    states = _STATES_MEMO.get(key)
    if states is None:
        if len(_STATES_MEMO) >= _STATES_MEMO_SIZE:
            _STATES_MEMO.clear()
        states = _STATES_MEMO[key] = _model_state_bytes(model, training, zero1_lower_bound)
    return states


_STATES_MEMO: dict[tuple, ModelStates] = {}
_STATES_MEMO_SIZE = 4096


def _model_state_bytes(model: ModelSpec, training: TrainingConfig, zero1_lower_bound: bool) -> ModelStates:
    total, trainable = model.total_params, model.trainable_params
    w = weight_dtype_bytes(training.precision)
    states_per_param, _paged = optimizer_state_bytes_per_param(training)
    if training.quantization is not Quantization.NONE and training.finetune is FineTune.LORA:
        n_q, q_bytes = quantized_base_bytes(model, training.quantization, training.tensor_parallel_size)
        frozen = max(0, total - trainable)
        if n_q > frozen:  # a spec holding fewer frozen weights than the shapes say: quantize what it holds
            n_q, q_bytes = frozen, q_bytes * frozen // n_q
        weights = (frozen - n_q) * w + q_bytes + trainable * 4
        grads = trainable * 4
        # ZeRO-2 / shard-grad-op under autocast: the packed 4-bit codes are gathered as they are stored (no cast)
        gathered_half = (frozen - n_q) * 2 + q_bytes + trainable * 2
    else:
        weights = total * w
        grads = trainable * w
        gathered_half = 2 * total
    if training.optimizer_in_backward:
        grads = 0
    opt = int(trainable * states_per_param)
    n = training.sharding_group_size  # data x context-parallel ranks
    s = training.sharding
    # expert parallelism: the routed experts a rank holds are sharded only over the data-parallel ranks that hold the
    # same experts (data_parallel_size / expert_parallel_size: DeepSpeed-MoE's expert-data-parallel group, torchtitan's
    # dp_shard_mod_ep mesh), everything else over all of them; LoRA adapters are not on the experts by default
    n_expert = max(n // training.expert_parallel_size, 1)
    share = routed_expert_share(model, training)
    trainable_share = share if trainable >= total else 0.0

    def shard(x: int, f: float) -> int:
        e = int(x * f)
        return e // n_expert + (x - e) // n

    if s in (Sharding.ZERO3, Sharding.FSDP_FULL_SHARD):
        weights, grads, opt = shard(weights, share), shard(grads, trainable_share), shard(opt, trainable_share)
    elif s in (Sharding.ZERO2, Sharding.FSDP_SHARD_GRAD_OP):
        # full parameters stay gathered through backward; with autocast-style mixed precision the
        # gathered copy is half precision and the fp32 weights are a shard (FSDP2 MixedPrecisionPolicy,
        # DeepSpeed's fp16/bf16 params + partitioned fp32 master: ZeRO paper 2Ψ + 14Ψ/N)
        if training.precision in (Precision.AMP_BF16, Precision.AMP_FP16):
            weights = gathered_half + shard(weights, share)
        grads, opt = shard(grads, trainable_share), shard(opt, trainable_share)
    elif s is Sharding.ZERO1:
        opt = 0 if zero1_lower_bound else shard(opt, trainable_share)
    if training.offload_optimizer is Offload.CPU:
        opt = 0
    if training.offload_parameters is Offload.CPU:
        weights = grads = 0
    return ModelStates(weights, grads, opt)


# -- activations ------------------------------------------------------------------------------------
GATED_MLP_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo",
        "olmo2",
        "cohere",
        "granite",
    }
)


def activation_dtype_bytes(precision: Precision) -> int:
    """Bytes per activation element: 4 in fp32 training, 2 with autocast or bf16 weights."""
    return 4 if precision is Precision.FP32 else 2


def activation_bytes_per_layer(model: ModelSpec, training: TrainingConfig, *, count_scores: bool = True) -> int:
    """Activations one decoder layer saves for backward, per device (bytes).

    Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
    arXiv 2205.05198, Sec. 4.1 / Table 2: a GPT layer with 16-bit activations saves
    ``s·b·h·(34 + 5·a·s/h)`` bytes — attention block 11·sbh + 5·a·s²·b, MLP 19·sbh, two LayerNorms
    4·sbh. With tensor parallel size t and sequence parallelism everything divides by t (Sec. 4.2.2); without
    sequence parallelism ``10·sbh`` stay whole on every rank — the two LayerNorm inputs, the inputs of the QKV
    and first MLP linears, and the two dropout masks — and the rest divides by t: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``
    (Sec. 4.2.1, Eq. 2). We follow the same accounting per tensor, generalised to what modern decoders differ in:

    * no dropout (the 1-byte masks, sbh + as²b + sbh, are dropped) unless the family is GPT-2/OPT/BLOOM;
    * grouped-query attention: K and V are ``s·b·kv·d`` each instead of ``s·b·h``;
    * gated (SwiGLU/GeGLU) MLP of width f: input 2sbh + gate, up, activation and product 4·2·sbf,
      instead of 2sbh + GeLU input 8sbh + second-linear input 8sbh;
    * the ``5·a·s²·b`` score term only with eager attention, asked or the family's only one
      (:func:`memfit.hf.attention_that_runs`; SDPA/flash save an fp32 log-sum-exp ``4·a·s·b`` instead).

    Scaled by 2 in fp32 training. Shapes: s = seq_len, b = micro_batch_size, h = hidden, a = heads.
    ``count_scores=False`` counts the layer as SDPA runs it whatever runs (the per-token scale of
    :func:`model.coefficients.scales`, which keeps the score term out).
    """
    s, b, h, a = training.seq_len, training.micro_batch_size, model.hidden_size, model.num_attention_heads
    t = training.tensor_parallel_size
    d = model.head_dim or h // a
    kv = model.num_key_value_heads * d
    q = a * d
    dropout = model.architecture in ("gpt2", "opt", "bloom")
    sbh = s * b * h
    attn = 2 * sbh + 2 * s * b * q + 2 * 2 * s * b * kv + 2 * s * b * q  # QKV input, Q, K+V, out-proj input
    if count_scores and attention_that_runs(model.architecture, training.attention) is Attention.EAGER:
        attn += 5 * a * s * s * b if dropout else 4 * a * s * s * b  # softmax output (+mask) and its use
    else:
        attn += 4 * a * s * b  # fp32 log-sum-exp; the attention output is the out-proj input counted above
    f = model.intermediate_size
    if model.architecture in GATED_MLP_FAMILIES:
        mlp = 2 * sbh + 4 * 2 * s * b * f
    else:
        mlp = 2 * sbh + 2 * s * b * f + 2 * s * b * f  # first-linear input, GeLU input, second-linear input
    norms = 4 * sbh
    masks = 2 * sbh if dropout else 0
    if t == 1 or training.sequence_parallel:
        total = (attn + mlp + norms + masks) // t
    else:  # LayerNorm inputs, dropout masks and the QKV / first-MLP inputs (2·sbh each) are whole on every rank
        total = norms + masks + 4 * sbh + (attn + mlp - 4 * sbh) // t
    return total * activation_dtype_bytes(training.precision) // 2


def logits_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Logits and the fp32 copies the loss makes: half-precision logits 2·s·b·v, fp32 upcast 4·s·b·v
    and its gradient 4·s·b·v (HF ``ForCausalLMLoss`` upcasts before cross-entropy)."""
    sbv = training.seq_len * training.micro_batch_size * model.vocab_size // training.tensor_parallel_size
    return (activation_dtype_bytes(training.precision) + 8) * sbv


def largest_request_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """The step's largest single allocation per device (bytes), the request the default caching allocator must
    find room for (:func:`model.reserved.allocator_room_bytes`) where no allocation stream is recorded.

    The larger of: the fp32 logits HF ``ForCausalLMLoss`` upcasts to (and their gradient), ``4·(s/c)·b·v / t``; the
    embedding's (or untied head's) gradient under full fine-tuning, ``v·h / t`` elements in the states' dtype
    (:func:`state_dtype_bytes`: bf16 in pure bf16, fp32 otherwise, the fp32 copy of ``bf16_fp32_master``'s step);
    under autocast the half-precision copy of the head weight it casts each step, ``2·v·h / t``; and one layer's
    attention scratch: with eager attention the fp32 softmax of its scores, ``4·b·(a/t)·(s/c)·s``, else the largest of
    FlashAttention-2's backward scratch tensors (:func:`model.cuda_semantics.flash_backward_scratch`; the largest only
    for toy models). Matches the largest request of recorded streams (``tracer.stream_source``) of Qwen3-0.6B,
    Llama-3.2-1B (amp, bf16, bf16_fp32_master), GPT-2, Qwen2.5-0.5B LoRA and SmolLM2-135M fp32 exactly
    (``tests/test_largest_request.py`` checks it on a tiny Llama); under sharding it counts the gradient whole, as
    it is before its reduce-scatter. Shapes: a = num_attention_heads, d = head_dim, s = seq_len, b = micro_batch_size, v = vocab_size,
    h = hidden_size, t = tensor_parallel_size, c = context_parallel_size (each rank holds s/c tokens).
    """
    t = training.tensor_parallel_size
    vh = -(-model.vocab_size * model.hidden_size // t)
    b, s = training.micro_batch_size, training.seq_len // training.context_parallel_size
    logits = -(-4 * b * s * model.vocab_size // t)
    gradient = vh * state_dtype_bytes(training.precision) if training.finetune is FineTune.FULL else 0
    cast = 2 * vh if training.precision in (Precision.AMP_BF16, Precision.AMP_FP16) else 0
    heads = max(1, model.num_attention_heads // t)
    if attention_that_runs(model.architecture, training.attention) is Attention.EAGER:  # fp32 softmax of the scores
        attention = 4 * b * heads * s * training.seq_len
    else:  # FlashAttention-2's backward scratch, the largest of its tensors
        d = model.head_dim or model.hidden_size // model.num_attention_heads
        kv_heads = max(1, model.num_key_value_heads // t)
        attention = max(flash_backward_scratch((b, heads, s, d), (b, kv_heads, s, d), 2))
    return max(logits, gradient, cast, attention)


#: layers whose parameters are gathered at once under parameter offload: the one computing and the one
#: prefetched (FSDP2's default forward/backward prefetch of one module)
LAYERS_IN_FLIGHT = 2


def largest_unit_params(model: ModelSpec) -> int:
    """Parameters of the largest unit gathered at once: a decoder layer or the embedding table.

    A decoder layer is counted as (total − embeddings and untied head) / layers; DeepSpeed's
    ``model_to_params`` takes the largest module's parameters the same way.
    """
    emb = model.vocab_size * model.hidden_size
    outside = emb * (1 if model.tie_word_embeddings else 2)
    layer = max(0, model.total_params - outside) // model.num_layers
    return max(emb, layer)


def in_flight_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Device bytes of gathered parameters and their gradients under parameter offload (0 otherwise):
    :data:`LAYERS_IN_FLIGHT` units' half-precision weights plus one unit's gradients
    (DeepSpeed's ``largest_layer_memory = 4 × largest_layer_params`` counts one unit's fp16 weights +
    gradients; prefetching holds the next one too)."""
    if training.offload_parameters is not Offload.CPU:
        return 0
    half = 4 if training.precision is Precision.FP32 else 2
    return (LAYERS_IN_FLIGHT + 1) * largest_unit_params(model) * half


def replicated_params(model: ModelSpec) -> int:
    """Parameters every tensor-parallel rank holds whole: the norm weights, two per decoder layer plus
    the final norm, ``hidden_size`` each (Llama-style RMSNorm)."""
    return (2 * model.num_layers + 1) * model.hidden_size


def tensor_parallel_rank_spec(model: ModelSpec, training: TrainingConfig) -> ModelSpec:
    """``model`` with the parameter counts one tensor-parallel rank holds (the spec itself when tp = 1).

    The decoder linears count as the rank's Megatron shards (:func:`model.analytic.decoder_linear_shapes`: q/k/v
    and gate/up split by output, o/down by input, at least one KV head per rank, so replicated KV heads are
    counted on every rank); :func:`replicated_params` (the norms) are held whole; everything else (embedding and
    head by vocabulary, biases, further experts) is split over the ``tp`` ranks, rank 0 holding the ceiling.
    Trainable parameters split in the same proportion as the total.
    """
    tp = training.tensor_parallel_size
    if tp == 1:
        return model
    L = model.num_layers
    full = sum(o * i for o, i in decoder_linear_shapes(model)) * L
    shard = sum(o * i for o, i in decoder_linear_shapes(model, tp)) * L
    rep = min(replicated_params(model), model.total_params)
    if full > model.total_params - rep:  # shapes beyond the spec's own count (a hand-written spec): split evenly
        full = shard = 0
    total = rep + shard + -(-(model.total_params - rep - full) // tp)
    trainable = min(total, -(-model.trainable_params * total // model.total_params))
    return model.model_copy(update={"total_params": total, "trainable_params": trainable})


def expert_parallel_rank_spec(model: ModelSpec, training: TrainingConfig) -> ModelSpec:
    """``model`` with the parameter counts one expert-parallel rank holds, from the shapes alone (the spec
    itself without experts or with ``expert_parallel_size`` 1).

    A rank holds ``num_layers · num_experts / P`` routed experts (:func:`model.analytic.routed_expert_params`)
    plus everything else; trainable parameters shrink in
    proportion under full fine-tuning and stay as given otherwise (LoRA adapters are not on the experts by
    default). :func:`model.parallel.expert_parallel_rank` counts the same thing exactly on a meta build when the
    HF config is known.
    """
    ep = training.expert_parallel_size
    if ep == 1 or not model.num_experts:
        return model
    experts = routed_expert_params(model, model.num_experts)
    total = model.total_params - experts + -(-experts // ep)
    full = model.trainable_params >= model.total_params
    trainable = total if full else min(model.trainable_params, total)
    return model.model_copy(update={"total_params": total, "trainable_params": trainable})


@dataclass(frozen=True)
class AnalyticEstimate:
    """Our analytic peak, per device, with its parts (bytes); made by :func:`analytic_estimates`.

    ``backward_peak_bytes``: the start of backward, every saved activation and the logits alive. A checkpointed
    layer is re-materialised later, after the layers above it have freed theirs, so ``recompute_bytes`` (one
    layer) only matters when it exceeds what those layers held — never for k < L. ``optimizer_peak_bytes``: the
    model states and the step's temporaries. ``peak_bytes``: the larger of the two.
    """

    states: ModelStates
    activations_bytes: int  # non-checkpointed layers' saved activations
    checkpoint_inputs_bytes: int  # the k checkpointed layers' saved inputs
    recompute_bytes: int  # one layer re-materialised in backward (k > 0)
    logits_bytes: int
    optimizer_temp_bytes: int  # the optimizer step's temporaries (step_temporary_bytes_per_param)
    dequant_bytes: int  # one quantized linear's weight dequantized for its matmul (QLoRA)
    in_flight_bytes: int  # parameter offload: gathered layer parameters and gradients on the device
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    peak_bytes: int


def analytic_estimate(model: ModelSpec, training: TrainingConfig) -> AnalyticEstimate:
    """:func:`analytic_estimates` at ``training``'s own k (its ``checkpoint_layers``)."""
    return analytic_estimates(model, training, (training.num_checkpointed_layers,))[0]


def analytic_estimates(
    model: ModelSpec, training: TrainingConfig, ks: Iterable[int] | None = None
) -> list[AnalyticEstimate]:
    """Peak = max(backward, optimizer step) of model states + activations + logits (bytes per device), for each
    k of ``ks`` (the first k layers checkpointed; default 0..L; ``training.checkpoint_layers`` ignored). What does
    not depend on k is computed once.

    The k checkpointed layers each keep only their input ``s·b·h`` (activation dtype); in backward
    one of them is re-materialised at a time (Chen et al. 2016, arXiv 1604.06174, Sec. 3). The optimizer
    step's temporaries are :func:`step_temporary_bytes_per_param` per trainable parameter. A quantized base adds
    the largest decoder linear dequantized to 16 bits (``gemm_4bit``'s dequantize-then-``F.linear`` path).

    Per tensor- and expert-parallel rank: the states and optimizer temporaries of the parameters one rank
    holds (:func:`tensor_parallel_rank_spec`, :func:`expert_parallel_rank_spec`), activations and logits divided by the
    tensor-parallel size (Korthikanti et al. 2022, arXiv 2205.05198, Sec. 4.2, with sequence parallelism;
    an upper-side simplification without it).
    """
    # the spec itself when tp = ep = 1
    full, model = model, tensor_parallel_rank_spec(expert_parallel_rank_spec(model, training), training)
    states = model_state_bytes(model, training)
    L = model.num_layers
    tp = training.tensor_parallel_size
    per_layer = activation_bytes_per_layer(full, training)  # already divided by the tensor-parallel size
    sbh = training.seq_len * training.micro_batch_size * model.hidden_size * activation_dtype_bytes(training.precision)
    n = training.sharding_group_size if training.sharding is not Sharding.NONE else 1
    dequant = 0
    if training.quantization is not Quantization.NONE and training.finetune is FineTune.LORA:
        dequant = max(o * i for o, i in decoder_linear_shapes(model, tp)) * 2
    logits = logits_bytes(model, training)
    in_flight = in_flight_bytes(model, training)
    # bf16 + fp32 master: the optimizer step also holds fp32 copies of the gradients (4 B/param)
    temp = (
        0
        if training.offload_optimizer is Offload.CPU
        else model.trainable_params
        * (step_temporary_bytes_per_param(training) + _MASTER_BYTES.get(training.precision, 0))
        // n
    )
    resident = states.weights_bytes + states.optimizer_bytes + states.gradients_bytes
    optimizer_peak = resident + temp
    out = []
    for k in range(L + 1) if ks is None else ks:
        activations, inputs, recompute = (L - k) * per_layer, k * sbh // tp, per_layer if k else 0
        backward = resident + max(activations + inputs, inputs + recompute) + logits + dequant + in_flight
        out.append(
            AnalyticEstimate(
                states=states,
                activations_bytes=activations,
                checkpoint_inputs_bytes=inputs,
                recompute_bytes=recompute,
                logits_bytes=logits,
                optimizer_temp_bytes=temp,
                dequant_bytes=dequant,
                in_flight_bytes=in_flight,
                backward_peak_bytes=backward,
                optimizer_peak_bytes=optimizer_peak,
                peak_bytes=max(backward, optimizer_peak),
            )
        )
    return out
