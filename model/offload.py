"""CPU offload: the device curve of an offloaded configuration, and the host memory it needs.

Two settings (:class:`memfit.schema.Offload`):

* ``offload_optimizer='cpu'`` — ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing
  Billion-Scale Model Training", arXiv 2101.06840, Sec. 4): optimizer states, fp32 master weights and
  the fp32 gradient copy live in host memory, the optimizer step runs on the CPU, the device keeps the
  half-precision parameters and gradients (or their ZeRO shards).
* ``offload_parameters='cpu'`` — ZeRO-3 ``offload_param`` / ZeRO-Infinity (Rajbhandari et al. 2021,
  arXiv 2104.07857, Sec. 5) and FSDP2's ``CPUOffloadPolicy``: parameters, gradients and optimizer
  states all on the host; the device holds the activations and the layers in flight.

**Device peak, composed from traced terms** (:func:`offload_device_curve`, one function for both):
the curve of the configuration *without* offload is composed per phase (:func:`model.compose.compose`)
from traced terms; every phase of a primed step holds the resident model states, so

* optimizer offload: the resident optimizer states (master weights included) are subtracted from
  every phase, and the ``opt`` phase becomes what the device holds while the CPU steps: the
  half-precision parameters and gradients (the step's temporaries are on the host);
* parameter offload: the base is the FSDP2 full-shard trace over ``PARAMETER_OFFLOAD_TRACE_RANKS``
  ranks (or the user's data-parallel size when sharded), which holds exactly the gathered layers in
  flight; the resident shards of weights and optimizer states are subtracted from every phase, the
  gradient shards from ``bwd.emb`` (before it they are still being produced: leaving them in is
  conservative by at most gradients / ranks), and ``opt`` becomes 0.

On the provisional path (no traced terms) the learned base curve is scaled by the analytic ratio
offloaded / not offloaded (:func:`model.analytic.analytic_estimate`), and the answer says so. Under parameter offload
the denominator is the base's backward peak, not its peak: the offloaded device runs no optimizer phase, and the base's
peak is often its optimizer step (Llama-3-8B ZeRO-3 over 8 ranks, bf16 + fp32 master: states 16.1 GB + step
temporaries 8.0 GB, against a 21.0 GB backward), whose ratio would scale a backward peak by the step's bytes. Against the
traced composition of that job (``tests/data/terms_llama3_8b_bf16_master.jsonl``) the provisional curve is 0.94-1.14 of
it at every k. Under optimizer offload alone the device still holds the resident weights and gradients through the
host's step, as the base's optimizer step does, and the peak ratio stands (exact on the same terms).

What is measured and what is composed:

* measured: optimizer offload runs in the collector (:class:`tracer.collect.HostOffloadOptimizer`, the
  step on host tensors counted apart by :meth:`tracer.tracker.LiveStorageTracker.on_host`), under fake
  tensors and on real CPU tensors; ``python -m training.sweep --grid offload`` collected 48 rows
  (in ``data/telemetry/telemetry.parquet``; ``python -m benchmarks.offload``: gpt2, qwen2.5-0.5b, llama-3.2-1b; none / ZeRO-2 / FSDP
  sharding; full and LoRA; five optimizers and precisions);
* composed: the optimizer-offload device curve from the traced terms without offload. Against those 48
  measured rows: MAPE 0.05 %, worst −0.53 % (gpt2, FSDP over 8 ranks, LoRA), 44 of 48 within ±0.1 %;
  on a tiny Llama against a real CPU run +1.3 % to +2.5 % (the 512-byte rounding of the removed
  optimizer tensors, a constant 26,880 B), never below (``tests/test_cases_offload.py``);
* composed, not checked against a run: parameter offload (FSDP2 ``CPUOffloadPolicy`` keeps every
  resident tensor on the host, so the collector's device-only count cannot run it on a CPU; composed
  from the FSDP full-shard trace as above);
* host memory: the formula equals the measured host peak of the collector's offloaded step exactly
  (up to the step counters) with fused AdamW and SGD; a foreach AdamW step on the host adds one
  temporary copy (+25 %), Adafactor's +50 %, both inside the 1.5 buffer factor.

**Host memory per node** (:func:`host_memory_bytes`): bytes per trainable parameter held on the host
(optimizer states + master weights + an fp32 gradient copy; with parameter offload also the
half-precision weights of every parameter), divided among the data-parallel ranks that shard them,
times the ranks on the node, times DeepSpeed's ``additional_buffer_factor`` 1.5 (pinned buffers,
fragmentation), and at least DeepSpeed's per-process fp32 copy of the model at load time (4 B per
parameter per rank) except under ZeRO-3 (``zero.Init`` builds the parameters partitioned). This reproduces DeepSpeed's
``estimate_zero2_model_states_mem_needs`` (``deepspeed/runtime/zero/stage_1_and_2.py``:
``total_params × max(4 × gpus, 16) × 1.5``) and ``estimate_zero3_model_states_mem_needs``
(``deepspeed/runtime/zero/stage3.py``: ``total_params × 16 (18 with offload_param) / nodes × 1.5``, its
``zero_init=True`` case) for
mixed-precision AdamW full fine-tunes, and extends them to other optimizers, LoRA and pure bf16.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from memfit.schema import ModelSpec, Offload, Precision, Sharding, TrainingConfig
from model.analytic import _BNB_STATE_BYTES, _STATES, analytic_estimates, model_state_bytes, state_dtype_bytes
from model.compose import PEAK_PHASES
from model.derivation import Draft, Request, peak_phases
from model.parallel import rank_share

#: DeepSpeed's ``additional_buffer_factor`` default in both estimators (pinned buffers, fragmentation)
HOST_BUFFER_FACTOR = 1.5
#: data-parallel ranks of the FSDP2 full-shard trace that stands for parameter offload on fewer ranks
PARAMETER_OFFLOAD_TRACE_RANKS = 8


def offloaded(training: TrainingConfig) -> bool:
    """True when anything is offloaded."""
    return training.offload_optimizer is Offload.CPU or training.offload_parameters is Offload.CPU


def traced_base(training: TrainingConfig) -> TrainingConfig:
    """The configuration whose traced terms the offloaded device curve is composed from.

    Optimizer offload: the same configuration without offload, and without gradient accumulation (offloaded
    gradients accumulate in host memory: :attr:`memfit.schema.TrainingConfig.accumulates_gradients`).
    Parameter offload: FSDP full-shard over the user's data-parallel ranks when sharded, else over
    :data:`PARAMETER_OFFLOAD_TRACE_RANKS`. Optimizer offload under ZeRO-1: unsharded (ZeRO-1 shards only the
    optimizer states, which live on the host: the device holds what an unsharded rank holds).
    """
    base = training.model_copy(
        update={"offload_optimizer": Offload.NONE, "offload_parameters": Offload.NONE, "gradient_accumulation_steps": 1}
    )
    if training.sharding is Sharding.ZERO1 and training.offload_parameters is not Offload.CPU:
        base = base.model_copy(update={"sharding": Sharding.NONE, "data_parallel_size": 1})
    if training.offload_parameters is Offload.CPU and training.sharding is Sharding.NONE:
        base = base.model_copy(update={"sharding": Sharding.ZERO3, "data_parallel_size": PARAMETER_OFFLOAD_TRACE_RANKS})
    return base


def host_bytes_per_rank(model: ModelSpec, training: TrainingConfig) -> int:
    """Host bytes of the model states one rank offloads (no buffer factor): see the module docstring.

    Per trainable parameter, in the optimizer's dtype (fp32; bf16 in pure ``bf16``): the optimizer
    states, the copy of the weights the CPU optimizer updates (the fp32 master) and the gradient copy it
    steps on — AdamW with fp32 states: 8 + 4 + 4 = 16 B, DeepSpeed's 16; bitsandbytes optimizers with their
    own state bytes whatever the dtype (``model.analytic._BNB_STATE_BYTES``: 8-bit AdamW, paged or not,
    2 + 8/256 B; Lion 4 B). With parameter offload also
    every parameter's half-precision weights (2 B; DeepSpeed's 18 with ``offload_param``), except in
    fp32 training where the fp32 copy is those weights. Sharded over the data-parallel ranks under any
    ZeRO/FSDP sharding.
    """
    if not offloaded(training):
        return 0
    opt_dtype = state_dtype_bytes(training.precision)
    # bitsandbytes optimizers keep their states in their own layout whatever the dtype (paged ones included:
    # offloaded, all of it is on the host)
    states = _BNB_STATE_BYTES.get(training.optimizer)
    if states is None:
        states = _STATES[training.optimizer] * opt_dtype
    host = math.ceil(model.trainable_params * (states + 2 * opt_dtype))
    if training.offload_parameters is Offload.CPU and training.precision is not Precision.FP32:
        host += model.total_params * 2
    shards = training.sharding_group_size if training.sharding is not Sharding.NONE else 1
    return -(-host // shards)


def host_memory_bytes(
    model: ModelSpec, training: TrainingConfig, ranks_per_node: int = 1, buffer_factor: float = HOST_BUFFER_FACTOR
) -> int:
    """Host (CPU) memory one node needs for the offloaded model states, bytes; 0 without offload.

    ``host_bytes_per_rank × ranks_per_node × buffer_factor``, and at least DeepSpeed's fp32 model copy
    per process at load time (``4 × total_params × ranks_per_node × buffer_factor``) except under ZeRO-3, whose
    ``zero.Init`` builds the parameters partitioned (DeepSpeed's ``zero_init=True`` default; transformers'
    ``from_pretrained`` enters it whenever ZeRO-3 is configured). Sources in the module docstring.

    Raises:
        ValueError: ``ranks_per_node`` < 1 or ``buffer_factor`` < 1.
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1")
    if buffer_factor < 1:
        raise ValueError(f"buffer_factor={buffer_factor} must be >= 1")
    if not offloaded(training):
        return 0
    host = host_bytes_per_rank(model, training) * ranks_per_node
    if training.sharding is not Sharding.ZERO3:  # ZeRO-3's zero.Init builds the parameters partitioned
        host = max(host, 4 * model.total_params * ranks_per_node)
    return int(host * buffer_factor)


def offload_device_phases(phase_bytes, phase_names: list[str], model: ModelSpec, training: TrainingConfig):
    """Device bytes per phase of an offloaded configuration from the base's composed phases.

    Args:
        phase_bytes: float array (L+1, phases): :attr:`model.compose.ComposedCurve.phase_bytes` of
            :func:`traced_base` (training).
        phase_names: the column names (:data:`model.compose.PEAK_PHASES`).
        model, training: the offloaded configuration.

    Returns:
        float array of the same shape: the device's live bytes per phase (rules in the module docstring).
    """
    base = traced_base(training)
    resident = model_state_bytes(model, base)
    out = np.array(phase_bytes, dtype=np.float64, copy=True)
    opt = phase_names.index("opt")
    if training.offload_parameters is Offload.CPU:
        out -= resident.weights_bytes + resident.optimizer_bytes
        out[:, phase_names.index("bwd.emb")] -= resident.gradients_bytes
        out[:, opt] = 0.0
    else:
        out -= resident.optimizer_bytes
        out[:, opt] = resident.weights_bytes + resident.gradients_bytes
    return np.maximum(out, 0.0)


class OffloadDerivation:
    """The :class:`model.derivation.Derivation` of offloaded requests: their device curve composed from the
    curve of :func:`traced_base` (:func:`offload_device_phases` on its phases; without phases, the learned base
    curve scaled by the analytic offloaded / not ratio per k), on the base's path and margin group. The host memory
    is the job's (:meth:`model.job.Job.host_memory_bytes`), not the curve's."""

    def derive(self, predictor: Any, request: Request, draft: Draft | None) -> Draft | None:
        model, training, hf_config = request.model, request.training, request.hf_config
        if draft is not None or not offloaded(training):
            return draft
        base_training = traced_base(training)
        base = predictor.curve(model, base_training, hf_config)
        # what one rank holds: its tensor- and expert-parallel shard, the fullest pipeline stage (the base's phases
        # are a rank's: the whole model's states subtracted from them dropped a tensor-parallel rank's activations)
        share = rank_share(model, training, hf_config)
        rank = share.fullest_spec
        # the stand-in FSDP trace of parameter offload on one rank is not the user's sharding: don't say it is
        notes = [n for n in base.notes if base_training.sharding is training.sharding or not n.startswith("sharding")]
        # offloaded optimizer states live in host memory, not in CUDA unified memory: drop the paged-states note
        notes = [n for n in notes if "unified memory" not in n]
        if base.phase_bytes is not None:
            raw, phases = peak_phases(
                offload_device_phases(base.phase_bytes, list(PEAK_PHASES), rank, training), PEAK_PHASES
            )
            notes.append("offload composed from the traced phases without offload (model.offload)")
        else:
            pairs = zip(analytic_estimates(model, training), analytic_estimates(model, base_training))
            # like for like: under parameter offload the device runs no optimizer phase (offload_device_phases sets
            # it to 0), so the offloaded peak is a backward peak and is set against the base's backward peak
            params_offloaded = training.offload_parameters is Offload.CPU
            ratio = [
                off.peak_bytes / (on.backward_peak_bytes if params_offloaded else on.peak_bytes) for off, on in pairs
            ]
            raw = np.asarray(base.raw_bytes, dtype=np.float64) * np.asarray(ratio)
            phases = [None] * (model.num_layers + 1)
            notes.append("offload: the learned curve without offload scaled by the analytic offloaded/not ratio")
        return Draft(
            path=base.path,
            raw=raw,
            phases=phases,
            states=share.fullest_states,
            terms_key=base.terms_key,
            reason=base.reason,
            notes=notes,
            learned=base.learned_coefficients,
            composed_from="offload",
            margin_sharding=base_training.sharding,
            report_group=False,
        )
