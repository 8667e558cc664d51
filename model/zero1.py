"""ZeRO-1: the device curve of rank 0 composed from the traced terms of the same configuration unsharded.

ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", arXiv 1910.02054, Sec. 5.1, P_os) shards only the optimizer states over the data-parallel ranks:
weights, gradients and activations are those of unsharded training. The collector runs it as
``torch.distributed.optim.ZeroRedundancyOptimizer`` over a fake process group (``tracer/collect.py``;
rank 0 is measured), which does not split tensors: it hands *whole parameters* to ranks
(``torch/distributed/optim/zero_redundancy_optimizer.py``, ``ZeroRedundancyOptimizer._partition_parameters``,
torch 2.13): per parameter group, the parameters sorted by ``numel()`` largest first (Python's stable
``sorted``: equal sizes keep the group's order), each given to the rank with the smallest running sum of
numels (``_get_min_index``: strict ``<``, so ties go to the lowest rank). Rank 0 therefore always gets the
largest parameter (the embedding table of a small model) and holds more than 1/N of the states when one
parameter is a large share of the model: pythia-70m's 25.8 M-parameter embedding (of 70 M) is all of rank
0's share at N = 8 (36.6 % of the states, not 12.5 %). :func:`rank0_param_indices` reproduces that
partition over the trainable parameters of a meta-device build (:func:`trainable_parameters`);
``tests/test_zero1.py`` checks it against a real ``ZeroRedundancyOptimizer``.

**Composition** (:func:`device_phases`): every phase of a primed step of the unsharded base
(:func:`base_training`) holds every parameter's optimizer states; rank 0 holds only those of its own
parameters, so the states of the others (each state tensor rounded to the allocator's 512-byte block, as
allocated: :func:`state_tensor_bytes`) are subtracted from every phase. In the ``opt`` phase rank 0 also
steps only its own parameters (``ZeroRedundancyOptimizer._local_step`` steps ``self.optim``, built over
``_partition_parameters()[rank]``), so the step's temporaries of the others are subtracted too: foreach
AdamW and Adafactor hold one state-dtype copy of every stepped tensor at its peak, fused AdamW and foreach SGD
(momentum, no weight decay) none (:func:`model.analytic.step_temporary_bytes_per_param`, the one formula, checked
against the traced terms). ``_sync_params``' broadcasts write in place.

What the collector holds outside ZeroRedundancyOptimizer is not sharded: with ``bf16_fp32_master`` the
fp32 master weights and their fp32 gradients belong to ``tracer.collect.MasterWeightsOptimizer`` (one
per parameter, on every rank), so only the AdamW/SGD states of the masters are partitioned. DeepSpeed's
ZeRO-1 partitions the master weights as well: for it this curve is an upper bound by 4 B per trainable
parameter × (N − 1)/N. bitsandbytes optimizers cannot run under ZeroRedundancyOptimizer in the collector
(``tracer.collect.make_optimizer``): not composed (:func:`not_composable_reason`).

**Model states** (:func:`rank0_states`): the curve's floor and breakdown take rank 0's real share of the
optimizer states (its parameters' numel × :func:`model.analytic.optimizer_state_bytes_per_param`, the
unsharded master weights in full), not :func:`model.analytic.model_state_bytes`' even 1/N, which needs no
HF config and stays the analytic baseline's (and the provisional features') estimate.

**Validation** (``benchmarks/results/design_choices.md``, section model/zero1.py): every ZeRO-1 family of the shipped
telemetry whose base is traced, 39 families, 483 rows at every measured k: MAPE 8.6e-6 %, worst −3.6e-4 %.
An Adafactor step at the peak is not in the telemetry; on a tiny Llama (``tests/test_zero1.py``) the composed
curve equals the collector's measurement to the byte at every k. ZeRO-1 with the optimizer offloaded is not
composed here: ZeRO-1 shards nothing the device then holds, so :func:`model.offload.traced_base` takes the unsharded base.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.hf import apply_finetune, build_causal_lm, decoder_layers, param_dtype, quiet_transformers
from memfit.schema import ModelSpec, Optimizer, Precision, Quantization, Sharding, TrainingConfig
from model.analytic import (
    _MASTER_BYTES,
    ModelStates,
    model_state_bytes,
    optimizer_state_bytes_per_param,
    step_temporary_bytes_per_param,
)
from model.compose import PEAK_PHASES
from model.derivation import Draft, Request, peak_phases
from model.parallel import rank_share

#: the allocator's block (``model.analytic.BLOCK_BYTES``, ``tracer.tracker.BLOCK_BYTES``)
BLOCK_BYTES = 512
#: bytes of a torch optimizer's scalar ``step`` tensor (fp32, ``torch.optim.optimizer._get_scalar_dtype``)
_STEP_BYTES = 4
#: optimizers ZeroRedundancyOptimizer wraps in the collector (``tracer.collect.make_optimizer``)
_TORCH_OPTIMIZERS = (Optimizer.ADAMW_FOREACH, Optimizer.ADAMW_FUSED, Optimizer.SGD_MOMENTUM, Optimizer.ADAFACTOR)


def _blocks(nbytes: int) -> int:
    return -(-int(nbytes) // BLOCK_BYTES) * BLOCK_BYTES


def base_training(training: TrainingConfig) -> TrainingConfig:
    """The configuration the ZeRO-1 curve is composed from: the same without sharding, on one rank."""
    return training.model_copy(update={"sharding": Sharding.NONE, "data_parallel_size": 1})


def not_composable_reason(training: TrainingConfig) -> str | None:
    """Why a ZeRO-1 configuration is not composed from its unsharded base (None when it is).

    Not composed: bitsandbytes optimizers (not run under ``ZeroRedundancyOptimizer`` by the collector),
    tensor parallelism (the collector runs it with sharding none or FSDP only), pipeline parallelism (its curve
    carries no per-phase bytes to subtract from: each stage holds its own states), an optimizer step in backward
    (one optimizer per parameter, not partitioned) and quantized bases (collected without sharding only).
    """
    if training.optimizer not in _TORCH_OPTIMIZERS:
        return (
            f"ZeRO-1 with {training.optimizer.value} is not measured (ZeroRedundancyOptimizer wraps torch optimizers)"
        )
    if training.tensor_parallel_size > 1:
        return "ZeRO-1 with tensor parallelism is not measured"
    if training.pipeline_parallel_size > 1:
        return "ZeRO-1 with pipeline parallelism is not composed"
    if training.expert_parallel_size > 1:
        return "expert parallelism is traced with sharding=none only"
    if training.optimizer_in_backward:
        return "an optimizer step in backward is traced without sharding only"
    if training.quantization is not Quantization.NONE:
        return "a quantized base is traced without sharding only"
    return None


@dataclass(frozen=True)
class TrainableParameters:
    """The trainable parameters in the order the optimizer receives them (``model.parameters()``,
    shared tensors once, ``requires_grad`` only). ``shapes``: one tuple per parameter;
    ``state_dtype_bytes``: bytes per element of the tensors the optimizer steps (the parameter's dtype;
    fp32 for the masters of ``bf16_fp32_master``)."""

    shapes: tuple[tuple[int, ...], ...]
    state_dtype_bytes: tuple[int, ...]

    @property
    def numels(self) -> list[int]:
        return [int(np.prod(s, dtype=np.int64)) for s in self.shapes]


@functools.lru_cache(maxsize=64)
def _trainable_parameters(hf_config_json: str, training_json: str) -> TrainableParameters:
    import torch

    hf_config = json.loads(hf_config_json)
    training = TrainingConfig.model_validate_json(training_json)
    with quiet_transformers(), torch.device("meta"):
        model = build_causal_lm(hf_config, dtype=param_dtype(training.precision))
        model = apply_finetune(model, training, decoder_layers(model))
    master = training.precision is Precision.BF16_FP32_MASTER
    params = [p for p in model.parameters() if p.requires_grad]
    return TrainableParameters(
        shapes=tuple(tuple(p.shape) for p in params),
        state_dtype_bytes=tuple(4 if master else p.element_size() for p in params),
    )


def trainable_parameters(hf_config: dict[str, Any], training: TrainingConfig) -> TrainableParameters:
    """The trainable parameters of ``hf_config`` under ``training``'s fine-tuning (LoRA adapters from PEFT,
    frozen layers) from a meta-device build as the collector builds it (``memfit.hf.apply_finetune``);
    memoised per (config, fine-tuning, precision)."""
    key = TrainingConfig.model_validate(
        {
            "micro_batch_size": 1,
            "seq_len": 1,
            **{
                f: getattr(training, f)
                for f in ("precision", "finetune", "lora_rank", "lora_target_modules", "frozen_layers")
            },
        }
    )
    return _trainable_parameters(json.dumps(hf_config, sort_keys=True), key.model_dump_json())


def rank0_param_indices(numels: list[int], world_size: int) -> list[int]:
    """Indices (into ``numels``, the optimizer's parameter order) of the parameters
    ``ZeroRedundancyOptimizer`` assigns to rank 0 of ``world_size``, one parameter group.

    Sorted-greedy as in ``ZeroRedundancyOptimizer._partition_parameters`` (torch 2.13): largest first,
    stable for equal sizes; each to the rank with the smallest running numel sum, the lowest rank on ties.

    Raises:
        ValueError: ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    sizes = [0] * world_size
    mine = []
    for i in sorted(range(len(numels)), key=lambda j: numels[j], reverse=True):  # stable: ties keep order
        rank = min(range(world_size), key=lambda r: (sizes[r], r))
        sizes[rank] += numels[i]
        if rank == 0:
            mine.append(i)
    return sorted(mine)


def state_tensor_bytes(shape: tuple[int, ...], dtype_bytes: int, optimizer: Optimizer) -> int:
    """Device bytes of one parameter's optimizer states as allocated (each tensor in 512-byte blocks).

    torch 2.13 (``torch/optim/adam.py``, ``sgd.py``, ``_adafactor.py``): AdamW ``exp_avg`` and ``exp_avg_sq``
    like the parameter plus an fp32 scalar ``step``; SGD with momentum one ``momentum_buffer``; Adafactor a
    ``step`` and, for 2-D and larger, ``row_var`` (last dim 1) and ``col_var`` (second-to-last dim 1), else a
    full ``variance``.

    Raises:
        ValueError: a bitsandbytes optimizer.
    """
    n = int(np.prod(shape, dtype=np.int64))
    if optimizer in (Optimizer.ADAMW_FOREACH, Optimizer.ADAMW_FUSED):
        return 2 * _blocks(n * dtype_bytes) + _blocks(_STEP_BYTES)
    if optimizer is Optimizer.SGD_MOMENTUM:
        return _blocks(n * dtype_bytes)
    if optimizer is Optimizer.ADAFACTOR:
        if len(shape) >= 2:
            row = n // shape[-1]
            col = n // shape[-2]
            return _blocks(_STEP_BYTES) + _blocks(row * dtype_bytes) + _blocks(col * dtype_bytes)
        return _blocks(_STEP_BYTES) + _blocks(n * dtype_bytes)
    raise ValueError(f"{optimizer.value} is not a torch optimizer ZeroRedundancyOptimizer runs here")


def step_temporary_bytes(shape: tuple[int, ...], dtype_bytes: int, training: TrainingConfig) -> int:
    """Bytes one stepped parameter adds to the optimizer step's peak temporaries, as allocated:
    :func:`model.analytic.step_temporary_bytes_per_param` in the tensor's state dtype (``dtype_bytes``) per
    element, in 512-byte blocks (foreach AdamW and Adafactor one copy, 0 otherwise)."""
    per_element = step_temporary_bytes_per_param(training, dtype_bytes)
    return _blocks(int(np.prod(shape, dtype=np.int64)) * per_element) if per_element else 0


@dataclass(frozen=True)
class Zero1Split:
    """Rank 0's share of the optimizer, bytes.

    Attributes:
        rank0_params: trainable parameters (elements) rank 0 steps.
        other_state_bytes: allocated state bytes of the parameters other ranks step (removed from every phase).
        other_temporary_bytes: step temporaries of those parameters (removed from ``opt``).
    """

    rank0_params: int
    other_state_bytes: int
    other_temporary_bytes: int


def zero1_split(hf_config: dict[str, Any], training: TrainingConfig) -> Zero1Split:
    """:class:`Zero1Split` of ``training`` (ZeRO-1 over its sharding group, data × context parallel ranks:
    :attr:`memfit.schema.TrainingConfig.sharding_group_size`) for ``hf_config``."""
    tp = trainable_parameters(hf_config, training)
    numels = tp.numels
    mine = set(rank0_param_indices(numels, training.sharding_group_size))
    others = [i for i in range(len(numels)) if i not in mine]
    opt = training.optimizer
    return Zero1Split(
        rank0_params=sum(numels[i] for i in mine),
        other_state_bytes=sum(state_tensor_bytes(tp.shapes[i], tp.state_dtype_bytes[i], opt) for i in others),
        other_temporary_bytes=sum(
            step_temporary_bytes(tp.shapes[i], tp.state_dtype_bytes[i], training) for i in others
        ),
    )


def rank0_states(model: ModelSpec, training: TrainingConfig, split: Zero1Split):
    """Rank 0's :class:`model.analytic.ModelStates` under ZeRO-1: weights and gradients unsharded, optimizer
    states of its own parameters (:func:`model.analytic.optimizer_state_bytes_per_param` per element; the
    collector's fp32 masters of ``bf16_fp32_master`` for every trainable parameter)."""
    base = model_state_bytes(model, base_training(training))
    per_param, _paged = optimizer_state_bytes_per_param(training)
    master = _MASTER_BYTES.get(training.precision, 0)
    opt = int(split.rank0_params * (per_param - master) + model.trainable_params * master)
    if training.offload_optimizer.value != "none":
        opt = 0
    return ModelStates(base.weights_bytes, base.gradients_bytes, opt)


def device_phases(base_phase_bytes, phase_names: list[str], split: Zero1Split) -> np.ndarray:
    """Rank 0's live bytes per phase from the unsharded base's composed phases.

    Args:
        base_phase_bytes: float array (L+1, phases), :attr:`model.curve.Curve.phase_bytes` of
            :func:`base_training` (training).
        phase_names: the column names (:data:`model.compose.PEAK_PHASES`).
        split: :func:`zero1_split` of the ZeRO-1 configuration.

    Returns:
        float64 array of the same shape: ``other_state_bytes`` less in every phase, and
        ``other_temporary_bytes`` less again in ``opt``.
    """
    out = np.array(base_phase_bytes, dtype=np.float64, copy=True) - split.other_state_bytes
    out[:, phase_names.index("opt")] -= split.other_temporary_bytes
    return np.maximum(out, 0.0)


class Zero1Derivation:
    """The :class:`model.derivation.Derivation` of ZeRO-1 requests with an HF config: rank 0's curve from the
    phases of its unsharded base (:func:`base_training`, :func:`device_phases`, :func:`rank0_states`) on the
    base's path and margin group; no answer (the next step answers) where not composable
    (:func:`not_composable_reason`, or the base not traceable) or the base has no phases.

    Args:
        not_traceable_reason: ``(spec, training, hf_config) -> str | None``, why a configuration cannot be traced
            (:func:`model.terms.not_traceable_reason`; given, not imported: model.terms reads this module).
    """

    def __init__(self, not_traceable_reason: Any) -> None:
        self.not_traceable_reason = not_traceable_reason

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        model, training, hf_config = request.model, request.training, request.hf_config
        if draft is not None or training.sharding is not Sharding.ZERO1 or hf_config is None:
            return draft
        base_training_ = base_training(training)
        if self.not_traceable_reason(model, base_training_, hf_config):
            return None
        if not_composable_reason(training):
            return unsharded_bound(predictor, request, base_training_) if bounded_by_base(training) else None
        base = predictor.curve(model, base_training_, hf_config)  # asks the tracer for the base's key
        if base.phase_bytes is None:
            return None
        split = zero1_split(hf_config, training)
        dev = device_phases(base.phase_bytes, list(PEAK_PHASES), split)
        peak, phases = peak_phases(dev, PEAK_PHASES)
        # what the base added on top of its phases (the learned path's gradient-accumulation buffer) stays
        raw = peak + (np.asarray(base.raw_bytes, dtype=np.float64) - base.phase_bytes.max(axis=1))
        note = (
            f"ZeRO-1 over {training.sharding_group_size} ranks composed from the phases without "
            f"sharding (model.zero1): rank 0 steps {split.rank0_params:,} of "
            f"{model.trainable_params:,} trainable parameters (ZeroRedundancyOptimizer's "
            "whole-parameter partition)"
        )
        return _from_base(
            base, training, note, raw=raw, phases=phases, phase_bytes=dev, states=rank0_states(model, training, split)
        )


def _from_base(base: Any, training: TrainingConfig, note: str, **composed: Any) -> Draft:
    """The draft of a ZeRO-1 request composed from its unsharded base's curve ``base``: the base's path, key, reason,
    notes (with ``note``) and learned flag, the base's margin group (sharding none), and the ``composed`` fields."""
    return Draft(
        path=base.path,
        terms_key=base.terms_key,
        reason=base.reason,
        notes=[*base.notes, note],
        learned=base.learned_coefficients,
        composed_from="zero1",
        margin_sharding=base_training(training).sharding,
        gradients_live=training.accumulates_gradients,
        **composed,
    )


def bounded_by_base(training: TrainingConfig) -> bool:
    """Whether a ZeRO-1 configuration that is not composed (:func:`not_composable_reason`: tensor or pipeline
    parallelism, bitsandbytes optimizers, a step in backward, a quantized base) is answered by its unsharded
    base as an upper bound: always but with expert parallelism (the base, one data-parallel rank, cannot hold the
    expert-parallel split). ZeRO-1 only removes other ranks' optimizer states and their step temporaries from what
    an unsharded rank holds (module docstring), so the base's curve is never below it."""
    return not_composable_reason(training) is not None and training.expert_parallel_size == 1


def unsharded_bound(predictor: Any, request: Request, base_training_: TrainingConfig) -> Draft:
    """The unsharded base's curve (per pipeline stage where it has stages) as the answer for a ZeRO-1 request that
    is not composed (:func:`bounded_by_base`), on the base's path: traced, or provisional
    (learned coefficients composed per stage, or the ratio model) with the base's terms key, so that a service's
    cached answer is recomputed once the base's trace lands (:class:`service.recommender.CurveCache`).

    Raises:
        ValueError: the base has no path to an answer (:meth:`model.curve.MemoryPredictor.curve`).
    """
    model, training, hf_config = request.model, request.training, request.hf_config
    base = predictor.curve(model, base_training_, hf_config)  # asks the tracer for the base's key
    share = rank_share(model, base_training_, hf_config)
    note = (
        f"ZeRO-1 over {training.data_parallel_size} ranks: {not_composable_reason(training)} (model.zero1); "
        "answered as the same configuration without sharding, an upper bound (ZeRO-1 only removes the other ranks' "
        "optimizer states)"
    )
    return _from_base(
        base,
        training,
        note,
        raw=np.asarray(base.raw_bytes, dtype=np.float64),
        phases=[p.peak_phase for p in base.points],
        phase_bytes=base.phase_bytes,
        states=share.fullest_states,
        stage_states=share.stage_states,
        pipeline=base.pipeline,
    )
