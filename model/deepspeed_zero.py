"""DeepSpeed ZeRO stage 2 as DeepSpeed runs it, composed on the traced FSDP2 ``SHARD_GRAD_OP`` step.

``sharding="zero2"`` names DeepSpeed's stage 2 (``deepspeed/runtime/zero/stage_1_and_2.py``,
``DeepSpeedZeroOptimizer``, deepspeed 0.19); ``sharding="fsdp_shard_grad_op"`` names FSDP2 with
``reshard_after_forward=False``, which the collector traces for both (``tracer/collect.py``). The two keep
the same weights, master partitions and optimizer-state partitions through forward and backward, but not
through the optimizer step:

* **FSDP2** reshards after backward: its step holds 1/N of the 16-bit weights, the sharded fp32 gradients and
  the optimizer's temporaries.
* **DeepSpeed stage 2** keeps every 16-bit weight on every rank for the whole step (``bit16_groups``; the
  updated partition is copied back and all-gathered into the same flat buffers). With ``contiguous_gradients``
  (default True, ``deepspeed/runtime/zero/config.py``) the reduced gradients of the rank's partition live in
  ``grads_in_partition`` (16-bit, Ψ/N elements, allocated in the first backward and kept). In ``step()`` each
  group's gradient partition is flattened into a new 16-bit buffer (``self.flatten(self.averaged_gradients[i])``)
  and converted to the fp32 partition's dtype (``flat_grad_partition.to(...)``: a new fp32 buffer of Ψ/N
  elements, the "3.14 GiB request" LLaMA-7B's ZeRO-2 job ran out of memory on over 8 V100s), the 16-bit copy is
  deleted, then the wrapped optimizer steps the fp32 partition. During backward the gradients are copied into
  an ``ipg`` bucket of ``reduce_bucket_size`` elements (default 5e8) of the gradients' dtype before they are
  reduced.

So on top of the traced phases, :func:`stage2_phases` charges

* every backward phase: the ``ipg`` bucket, ``2 * reduce_bucket_size`` bytes (16-bit gradients);
* the ``opt`` phase: at least the larger of the two moments of DeepSpeed's step, states only (activations are
  freed by then):

  - conversion: ``w·Ψ + Ψ_t/N · (master + states + 2 + 2 + 4)`` (16-bit weights, fp32 master and optimizer-state
    partitions, ``grads_in_partition``, its flat 16-bit copy, the fp32 gradient partition);
  - optimizer step: ``w·Ψ + Ψ_t/N · (master + states + 4 + temporaries)`` (the flat copy deleted and the 16-bit
    partition gradients released, ``free_grad_in_param_list``; the step's temporaries per
    :func:`model.analytic.step_temporary_bytes_per_param`).

Ψ is the rank's parameter count, Ψ_t its trainable count, N :attr:`memfit.schema.TrainingConfig.sharding_group_size`,
``w`` 2 bytes (DeepSpeed's 16-bit model). Only ``bf16_fp32_master`` is DeepSpeed's mixed precision (its
``fp16``/``bf16`` sections: 16-bit model, fp32 master partitions); other precisions with ``zero2`` keep the
FSDP2 trace and the answer says so (:func:`stage2_note`).

Checked against real DeepSpeed 0.19.8 on the CPU (``tests/ds_zero2_job.py``, run by ``tests/test_deepspeed_zero.py``:
bf16, one rank, a 426,624-parameter Llama, the second step measured with :class:`tracer.tracker.LiveStorageTracker`):
from ``engine.step()``'s start to the wrapped optimizer's step the live bytes peak at exactly 6 B per partition
element above the bytes live before it (the flat 16-bit copy and the fp32 gradient), and the wrapped optimizer
starts at exactly +2 B (the fp32 gradient, 4 B, less the released 16-bit partition gradients, 2 B), stepping an
fp32 gradient of the partition's size; every 16-bit weight is still held; the reduce bucket is 5e8 elements.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from memfit.hf import build_causal_lm
from memfit.schema import GIB, ModelSpec, Offload, Precision, Sharding, TrainingConfig
from model.analytic import optimizer_state_bytes_per_param, step_temporary_bytes_per_param
from model.compose import PEAK_PHASES
from model.derivation import Draft, Request, peak_phases
from model.snapshot import config_key, parameter_snapshot

#: DeepSpeed's ``reduce_bucket_size`` default, elements (``deepspeed/runtime/zero/config.py``,
#: ``DeepSpeedZeroConfig.reduce_bucket_size``)
REDUCE_BUCKET_ELEMENTS = 500_000_000
#: DeepSpeed's stage-3 ``prefetch_bucket_size`` and ``param_persistence_threshold`` defaults, elements (same file,
#: ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``)
PREFETCH_BUCKET_ELEMENTS = 50_000_000
PERSISTENCE_THRESHOLD_ELEMENTS = 100_000
#: bytes of an element of DeepSpeed's 16-bit model, gradients and flat gradient copies
HALF_BYTES = 2
#: bytes of an element of the fp32 gradient partition ``step()`` builds
FP32_BYTES = 4
_BACKWARD_PHASES = tuple(i for i, p in enumerate(PEAK_PHASES) if p.startswith("bwd."))
_OPT_PHASE = PEAK_PHASES.index("opt")


def deepspeed_stage2(training: TrainingConfig) -> bool:
    """True where ``training`` is DeepSpeed ZeRO stage 2 composed here: ``zero2`` over more than one rank with
    DeepSpeed's mixed precision (``bf16_fp32_master``) and a trained model."""
    return (
        training.sharding is Sharding.ZERO2
        and training.precision is Precision.BF16_FP32_MASTER
        and training.sharding_group_size > 1
        and not training.optimizer_in_backward
    )


def stage2_step_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Device bytes at the peak of DeepSpeed stage 2's ``step()`` for one rank (the module docstring's two
    moments, the larger), states only.

    Args:
        model: one rank's spec (tensor/pipeline/expert parallel already applied): ``total_params`` Ψ,
            ``trainable_params`` Ψ_t.
        training: a configuration for which :func:`deepspeed_stage2` is true.

    Returns:
        Bytes (int).
    """
    n = training.sharding_group_size
    psi, psi_t = model.total_params, model.trainable_params
    master_and_states, _paged = optimizer_state_bytes_per_param(training)  # fp32 master included
    weights = HALF_BYTES * psi
    part = psi_t / n
    conversion = part * (master_and_states + HALF_BYTES + HALF_BYTES + FP32_BYTES)
    stepping = part * (master_and_states + FP32_BYTES + step_temporary_bytes_per_param(training))
    return int(weights + max(conversion, stepping))


def reduce_bucket_bytes(model: ModelSpec) -> int:
    """Bytes of the ``ipg`` reduce bucket held through backward: ``reduce_bucket_size`` 16-bit elements (no
    more than the model has gradients)."""
    return HALF_BYTES * min(REDUCE_BUCKET_ELEMENTS, model.trainable_params)


def stage2_phases(
    phase_bytes: np.ndarray | None, raw: np.ndarray, model: ModelSpec, training: TrainingConfig
) -> tuple[np.ndarray | None, np.ndarray]:
    """DeepSpeed stage 2's per-phase bytes and peak curve from the FSDP2 ``SHARD_GRAD_OP`` ones.

    Args:
        phase_bytes: (L + 1, len(PEAK_PHASES)) bytes per k and phase of the traced (or learned) composition, or
            None on the learned-model path.
        raw: (L + 1,) peak bytes per k of the same composition (may exceed ``phase_bytes``' row maxima by what the
            caller added on top, e.g. a gradient-accumulation buffer).
        model, training: as for :func:`stage2_step_bytes`.

    Returns:
        ``(phase_bytes, raw)`` with the bucket added to the backward phases and the ``opt`` phase raised to
        :func:`stage2_step_bytes`; without phases the whole curve is raised to at least the step and the bucket
        is added to every k (an upper bound).
    """
    step = float(stage2_step_bytes(model, training))
    bucket = float(reduce_bucket_bytes(model))
    raw = np.asarray(raw, dtype=np.float64)
    if phase_bytes is None:
        return None, np.maximum(raw + bucket, step)
    dev = np.asarray(phase_bytes, dtype=np.float64).copy()
    extra = raw - dev.max(axis=1)
    dev[:, list(_BACKWARD_PHASES)] += bucket
    dev[:, _OPT_PHASE] = np.maximum(dev[:, _OPT_PHASE], step)
    return dev, dev.max(axis=1) + extra


def stage2_note(training: TrainingConfig, composed: bool) -> str | None:
    """What the answer says about ``zero2``: composed as DeepSpeed runs it, or which precision keeps FSDP2's."""
    if training.sharding is not Sharding.ZERO2:
        return None
    if composed:
        return (
            f"zero2 is DeepSpeed's stage 2: every 16-bit weight stays on each of the {training.sharding_group_size} "
            "ranks through the step, which adds the fp32 gradient partition; backward holds a reduce bucket of "
            f"{REDUCE_BUCKET_ELEMENTS:.0e} 16-bit elements (model.deepspeed_zero); use fsdp_shard_grad_op for FSDP"
        )
    return (
        f"zero2 with precision {training.precision.value} is answered as FSDP2 SHARD_GRAD_OP (resharded after "
        "backward); DeepSpeed's stage 2 is composed for bf16_fp32_master only"
    )


def persistent_parameter_elements(hf_config: dict[str, Any] | None, model: ModelSpec) -> int:
    """Elements of the parameters below ``stage3_param_persistence_threshold`` (norm weights, biases), which
    DeepSpeed's stage 3 keeps unpartitioned on every rank (``deepspeed/runtime/zero/parameter_offload.py``,
    ``persistent_parameters``): read from the shipped snapshot (:func:`model.snapshot.parameter_snapshot`,
    ``persistent``) for catalog architectures, else counted on a meta-device build of ``hf_config`` (cached per
    config); without a config, the norm weights (2 per layer and the final one) of ``hidden_size`` elements each."""
    if hf_config is None:
        h = model.hidden_size
        return (2 * model.num_layers + 1) * h if h < PERSISTENCE_THRESHOLD_ELEMENTS else 0
    hit = parameter_snapshot("persistent").get(config_key(hf_config))
    return int(hit) if hit is not None else _persistent_elements(json.dumps(hf_config, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _persistent_elements(hf_config_json: str) -> int:
    import torch

    with torch.device("meta"):
        m = build_causal_lm(json.loads(hf_config_json))
    return sum(p.numel() for p in m.parameters() if p.numel() < PERSISTENCE_THRESHOLD_ELEMENTS)


def stage3_offload_buffer_bytes(model: ModelSpec, persistent_elements: int) -> int:
    """Device bytes of DeepSpeed stage 3's own buffers under parameter offload, at its defaults
    (``deepspeed/runtime/zero/config.py``): the reduce bucket (``min(5e8, trainable)`` 16-bit elements), the
    prefetch bucket (``min(5e7, total)`` 16-bit elements), and the persistent parameters with their 16-bit
    gradients (``persistent_elements``, :func:`persistent_parameter_elements`)."""
    bucket = min(REDUCE_BUCKET_ELEMENTS, model.trainable_params) * HALF_BYTES
    prefetch = min(PREFETCH_BUCKET_ELEMENTS, model.total_params) * HALF_BYTES
    return bucket + prefetch + 2 * persistent_elements * HALF_BYTES


class DeepSpeedStage2Derivation:
    """The :class:`model.derivation.Derivation` of ``zero2`` on the request's own composition: DeepSpeed's stage 2
    (:func:`stage2_phases`) where :func:`deepspeed_stage2` holds and there is no pipeline split, and the note that
    says which (:func:`stage2_note`). Curves composed from a base already carry it from the base."""

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        training = request.training
        if draft is None or draft.composed_from is not None or training.sharding is not Sharding.ZERO2:
            return draft
        composed = deepspeed_stage2(training) and draft.pipeline is None
        if composed:
            draft.phase_bytes, draft.raw = stage2_phases(draft.phase_bytes, draft.raw, draft.rank_model, training)
            if draft.phase_bytes is not None:
                draft.phases = peak_phases(draft.phase_bytes, PEAK_PHASES)[1]
        draft.notes.append(stage2_note(training, composed))
        return draft


class DeepSpeedStage3BuffersDerivation:
    """The :class:`model.derivation.Derivation` of ZeRO-3 with parameters offloaded: DeepSpeed stage 3's device
    buffers at its defaults (:func:`stage3_offload_buffer_bytes`) added to every k of the offloaded curve."""

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        model, training = request.model, request.training
        if draft is None or draft.composed_from != "offload":
            return draft
        if training.offload_parameters is not Offload.CPU or training.sharding is not Sharding.ZERO3:
            return draft
        buffers = stage3_offload_buffer_bytes(model, persistent_parameter_elements(request.hf_config, model))
        draft.raw = draft.raw + buffers
        draft.notes.append(
            f"DeepSpeed stage 3's device buffers at its defaults added ({buffers / GIB:.2f} GiB: reduce bucket "
            "5e8 and prefetch bucket 5e7 16-bit elements, parameters below 1e5 elements with their gradients; "
            "model.deepspeed_zero)"
        )
        return draft
