"""Model-parallel layouts per rank: tensor-parallel parameter counts, pipeline stages, context parallel.

What is measured and what is composed:

* **Tensor (+ sequence) parallelism is measured**: :mod:`tracer.parallel` runs DTensor
  ``parallelize_module`` over a fake process group while the small models are traced, so the traced
  terms are rank 0's (:func:`model.terms.terms_key` includes the TP size). Here only the model-state
  floor needs the per-rank parameter count (:func:`model.analytic.tensor_parallel_rank_spec`).
* **Pipeline parallelism is composed** (:func:`compose_pipeline`) from the same traced terms, stage by
  stage: a stage of ``Ls`` layers is the traced composition of an ``Ls``-layer model, minus the
  embedding's states when it is not the first stage and minus the head (its states, and its
  ``fwd.head``/``bwd.head`` phases, the logits) when it is not the last; plus the saved activations of
  the other micro-batches in flight (:func:`micro_batches_in_flight`) in every phase but the optimizer
  step, and the stage's whole gradient in the forward and backward phases (gradients accumulate over
  the micro-batches, and Megatron keeps them in a contiguous buffer); stages before the last also keep
  each in-flight micro-batch's output (``b·s·h``) for its backward. Activations saved per layer and
  micro-batch are the traced per-layer increment at the end of forward less its resting bytes.
  Checked against real 1F1B runs of each stage on a tiny Llama (:mod:`training.pipeline_check`,
  ``tests/test_parallel.py``).
* **Context parallelism is composed**: each rank runs the traced step at ``seq_len / cp`` tokens
  (activations and logits divided along the sequence), plus ring-attention buffers
  (:func:`ring_attention_bytes`).

Sources: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv 2104.04473, Sec. 2.2 (1F1B holds at most ``pp`` micro-batches on the first stage,
``pp − i`` on stage i; interleaved with v chunks ``pp + (pp − 1)/v`` on the first; GPipe all ``m``);
Megatron-LM ``megatron/core/pipeline_parallel/schedules.py`` (warm-up micro-batches
``pp − rank − 1``, interleaved ``(pp − rank − 1)·2 + (v − 1)·pp``); Korthikanti et al. 2022, arXiv
2205.05198, Sec. 4.2 (TP + SP divide activations by t); Liu et al. 2023, "Ring Attention with
Blockwise Transformers", arXiv 2310.01889, Sec. 3 (each host holds its query block and one key/value
block in flight).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.hf import count_params_from_config, local_expert_config
from memfit.schema import FineTune, ModelSpec, PipelineSchedule, TrainingConfig
from model.analytic import (
    ModelStates,
    activation_dtype_bytes,
    expert_parallel_rank_spec,
    model_state_bytes,
    tensor_parallel_rank_spec,
)
from model.compose import PEAK_PHASES, compose, layer_values

#: model families whose decoder layers follow the Llama-style tensor-parallel plan of
#: :mod:`tracer.parallel` (q/k/v/o, gate/up/down projections, two norms, nothing else)
TENSOR_PARALLEL_FAMILIES = frozenset({"llama", "mistral", "qwen2"})
#: phases that only the last stage (the one with the head and the loss) has
_HEAD_PHASES = ("fwd.head", "bwd.head")
#: phases in which the head's gradient exists in a traced step (from the start of backward on)
_HEAD_GRAD_PHASES = ("bwd.head", "bwd.layers", "bwd.emb", "opt")
#: phases in which, with gradients accumulated over micro-batches, the stage's whole gradient is added to the
#: traced value (in ``bwd.layers`` this overcounts the gradients the traced micro-batch has already made:
#: conservative; without it, non-last stages came out up to 15 % low against real 1F1B runs)
_GRAD_ACCUM_PHASES = ("fwd.layers", "fwd.head", "bwd.head", "bwd.layers")
#: phases in which the embedding's gradient exists in a traced step
_EMB_GRAD_PHASES = ("bwd.emb", "opt")


def stage_layer_counts(num_layers: int, pipeline_parallel_size: int) -> list[int]:
    """Decoder layers per pipeline stage: an even split, the remainder going to the last stages (the first
    stage holds the most micro-batches in flight).

    Raises:
        ValueError: more stages than layers.
    """
    pp = pipeline_parallel_size
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} must be in [1, num_layers={num_layers}]")
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i >= pp - extra else 0) for i in range(pp)]


def micro_batches_in_flight(stage: int, training: TrainingConfig) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once (in units of one micro-batch
    through all of the stage's layers).

    * ``gpipe``: all ``m`` micro-batches run forward before any backward;
    * ``1f1b``: ``min(pp − stage, m)`` (Megatron: ``pp − rank − 1`` warm-up forwards, then one more);
    * ``interleaved_1f1b`` with v chunks per rank: ``min((pp − stage − 1)·2 + (v − 1)·pp + 1, m·v)``
      chunk-micro-batches, each 1/v of the stage's layers (Megatron's warm-up count; on the first
      stage ``pp + (pp − 1)/v``, Narayanan et al. 2021, Sec. 2.2.2).

    Raises:
        ValueError: ``stage`` outside [0, pp).
    """
    pp, m = training.pipeline_parallel_size, training.micro_batches_per_step
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must be in [0, pipeline_parallel_size={pp})")
    if pp == 1:
        return 1.0
    schedule = training.pipeline_schedule
    if schedule is PipelineSchedule.GPIPE:
        return float(m)
    if schedule is PipelineSchedule.ONE_F_ONE_B:
        return float(min(pp - stage, m))
    v = training.pipeline_chunks_per_rank
    return min((pp - stage - 1) * 2 + (v - 1) * pp + 1, m * v) / v


def ring_attention_bytes(model: ModelSpec, training: TrainingConfig) -> dict[str, float]:
    """Ring-attention buffers per rank and decoder layer in flight, by phase (bytes; 0 when cp = 1).

    Forward holds one peer's key/value block while computing on the local one: ``2·b·(s/cp)·kv·d``
    elements (kv heads split over the TP ranks). Backward circulates the peer key/value block and its
    gradient: twice that. Activation dtype (:func:`model.analytic.activation_dtype_bytes`).
    """
    cp = training.context_parallel_size
    if cp == 1:
        return {}
    d = model.head_dim or model.hidden_size // model.num_attention_heads
    kv_heads = max(1, model.num_key_value_heads // training.tensor_parallel_size)
    block = 2 * training.micro_batch_size * (training.seq_len // cp) * kv_heads * d
    block *= activation_dtype_bytes(training.precision)
    return {"fwd.layers": float(block), "bwd.layers": float(2 * block)}


@dataclass(frozen=True)
class Stage:
    """One pipeline stage, per rank: its layers, what it holds besides them, and its state bytes."""

    stage: int
    first_layer: int
    num_layers: int
    has_embedding: bool
    has_head: bool
    micro_batches_in_flight: float
    spec: ModelSpec  # parameter counts this stage's rank holds (TP applied)


def _embedding_params(model: ModelSpec, tp: int) -> tuple[int, int]:
    """(embedding, separate head) parameters per TP rank; the head is 0 when tied to the embedding."""
    emb = -(-model.vocab_size * model.hidden_size // tp)
    return emb, 0 if model.tie_word_embeddings else emb


def pipeline_stages(model: ModelSpec, training: TrainingConfig) -> list[Stage]:
    """The stages of ``training``'s pipeline with their parameter counts per rank (TP applied).

    Decoder-layer parameters are split in proportion to the layers; the embedding sits on the first stage
    and the head on the last (with tied embeddings the last stage keeps its own copy of the embedding,
    as Megatron does). Trainable parameters: all of a stage's under full fine-tuning; LoRA adapters in
    proportion to the layers.
    """
    pp = training.pipeline_parallel_size
    rank = tensor_parallel_rank_spec(model, training)
    emb, head = _embedding_params(model, training.tensor_parallel_size)
    layer_params = max(0, rank.total_params - emb - head)
    counts = stage_layer_counts(model.num_layers, pp)
    out, first = [], 0
    for i, n in enumerate(counts):
        is_first, is_last = i == 0, i == pp - 1
        total = layer_params * n // model.num_layers
        total += (emb if is_first else 0) + ((head or (emb if pp > 1 else 0)) if is_last else 0)
        if pp == 1:
            total = rank.total_params
        if model.trainable_params == model.total_params:
            trainable = total
        elif training.finetune is FineTune.LORA:
            trainable = rank.trainable_params * n // model.num_layers
        else:
            trainable = min(total, rank.trainable_params * total // max(1, rank.total_params))
        # num_layers: the stage's own, so that per-layer counts (a quantized base's decoder linears) are the stage's
        spec = model.model_copy(
            update={"total_params": max(1, total), "trainable_params": min(trainable, total), "num_layers": n}
        )
        out.append(
            Stage(
                stage=i,
                first_layer=first,
                num_layers=n,
                has_embedding=is_first,
                has_head=is_last,
                micro_batches_in_flight=micro_batches_in_flight(i, training),
                spec=spec,
            )
        )
        first += n
    return out


def expert_parallel_rank(model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None) -> ModelSpec:
    """The part of ``model`` one expert-parallel rank holds: its parameter counts with num_experts / P
    routed experts (counted on a meta build of that shard's config; from the shapes,
    :func:`model.analytic.expert_parallel_rank_spec`, when no HF config is given); ``model`` itself when P = 1.

    Full fine-tuning trains every parameter of the shard; otherwise (LoRA) the trainable count stays.
    """
    ep = training.expert_parallel_size
    if ep == 1 or model.num_experts is None:
        return model
    if hf_config is None:
        return expert_parallel_rank_spec(model, training)  # from the shapes
    local = _param_count(json.dumps(local_expert_config(hf_config, ep), sort_keys=True))
    extra = model.total_params - _param_count(json.dumps(hf_config, sort_keys=True))  # LoRA adapters in model
    total = local + max(extra, 0)
    trainable = total if model.trainable_params >= model.total_params else min(model.trainable_params, total)
    return model.model_copy(update={"total_params": total, "trainable_params": trainable})


@functools.lru_cache(maxsize=256)
def _param_count(hf_config_json: str) -> int:
    """Parameters of the model a HF config (JSON text) describes, counted on a meta build, memoised."""
    return count_params_from_config(json.loads(hf_config_json))


@dataclass(frozen=True)
class RankShare:
    """What one rank of a job holds: its expert-parallel share of the model (:func:`expert_parallel_rank`), that
    share's pipeline stages (tensor parallelism applied, :func:`pipeline_stages`) and each stage's model states
    (:func:`model.analytic.model_state_bytes`, bytes). Made by :func:`rank_share`."""

    model: ModelSpec
    stages: list[Stage]
    stage_states: list[ModelStates]

    @property
    def fullest(self) -> int:
        """Index of the stage whose rank holds the most model-state bytes (the first of equals)."""
        totals = [st.total_bytes for st in self.stage_states]
        return totals.index(max(totals))

    @property
    def fullest_spec(self) -> ModelSpec:
        """Parameter counts of the fullest stage's rank."""
        return self.stages[self.fullest].spec

    @property
    def fullest_states(self) -> ModelStates:
        """Model states of the fullest stage's rank: the floor of a per-rank peak."""
        return self.stage_states[self.fullest]


def rank_share(model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None) -> RankShare:
    """One rank's share of ``model`` under ``training``'s expert, tensor and pipeline parallelism (the one place
    the traced composition, ZeRO-1's unsharded bound and offload take their per-rank states from)."""
    ep_rank = expert_parallel_rank(model, training, hf_config)
    stages = pipeline_stages(ep_rank, training)
    return RankShare(ep_rank, stages, [model_state_bytes(st.spec, training) for st in stages])


def compose_stage(
    coef: dict[Any, Any], depths: tuple[int, int], model: ModelSpec, training: TrainingConfig, stage: Stage
) -> np.ndarray:
    """Per-phase live bytes of one stage's rank for k = 0..``stage.num_layers`` checkpointed layers.

    Returns a float64 array of shape (stage layers + 1, len(PEAK_PHASES)); phases a stage does not run
    (the head's, on all but the last stage) are ``-inf``. See the module docstring for the rules.
    """
    b, s = training.micro_batch_size, training.seq_len // training.context_parallel_size
    Ls = stage.num_layers
    phase_bytes = compose(coef, Ls, b, s, depths).phase_bytes.copy()
    v = layer_values(coef, b, s, depths)
    act_f = (v[(2, 0)]["fwd.head"] - v[(1, 0)]["fwd.head"]) - (v[(2, 0)]["rest"] - v[(1, 0)]["rest"])
    act_c = (v[(2, 2)]["fwd.head"] - v[(1, 1)]["fwd.head"]) - (v[(2, 2)]["rest"] - v[(1, 1)]["rest"])
    k = np.arange(Ls + 1, dtype=np.float64)
    act_bytes = activation_dtype_bytes(training.precision)
    sp = training.tensor_parallel_size if training.sequence_parallel else 1
    saved = (Ls - k) * max(act_f, 0.0) + k * max(act_c, 0.0)

    rank = tensor_parallel_rank_spec(model, training)
    st = model_state_bytes(rank, training)
    w = st.weights_bytes / rank.total_params
    g = st.gradients_bytes / max(1, rank.trainable_params)
    o = st.optimizer_bytes / max(1, rank.trainable_params)
    emb, head = _embedding_params(model, training.tensor_parallel_size)
    full = training.finetune is FineTune.FULL
    stage_states = model_state_bytes(stage.spec, training)
    pp = training.pipeline_parallel_size
    for j, phase in enumerate(PEAK_PHASES):
        drop = 0.0
        if pp > 1 and not stage.has_embedding and not (stage.has_head and model.tie_word_embeddings):
            drop += emb * (w + (o if full else 0)) + (emb * g if full and phase in _EMB_GRAD_PHASES else 0)
        if pp > 1 and not stage.has_head:
            drop += head * (w + (o if full else 0)) + (head * g if full and phase in _HEAD_GRAD_PHASES else 0)
        col = phase_bytes[:, j] - drop
        if phase != "opt":
            col = col + (stage.micro_batches_in_flight - 1) * saved
            if pp > 1 and not stage.has_head:  # each in-flight micro-batch's stage output, kept for its backward
                col = col + stage.micro_batches_in_flight * b * s * model.hidden_size * act_bytes / sp
            if pp > 1 and training.micro_batches_per_step > 1 and phase in _GRAD_ACCUM_PHASES:
                col = col + stage_states.gradients_bytes  # accumulated over the micro-batches
            col = col + ring_attention_bytes(model, training).get(phase, 0.0)
        if pp > 1 and not stage.has_head and phase in _HEAD_PHASES:
            col = np.full_like(col, -np.inf)
        phase_bytes[:, j] = col
    return phase_bytes


@dataclass(frozen=True)
class ParallelCurve:
    """Per-rank peak over the total number k = 0..L of checkpointed layers, with its split over stages.

    Attributes:
        peak_bytes: int64, shape (L+1,): the bottleneck stage's peak at each k.
        phase: the bottleneck stage's peak phase at each k.
        stage_k: int64, shape (L+1, pp): checkpointed layers of each stage at each k (the first ones of
            the stage, Megatron's ``block`` method).
        stage_peak_bytes: int64, shape (L+1, pp).
        stages: the stages.
        phase_bytes: float64, shape (L+1, len(PEAK_PHASES)): every phase's live bytes at each k with one stage
            (context parallelism alone: the rank holds every layer, so compositions on a base's phases apply);
            None with several stages (each holds its own share of the model states).
    """

    peak_bytes: np.ndarray
    phase: list[str]
    stage_k: np.ndarray
    stage_peak_bytes: np.ndarray
    stages: list[Stage]
    phase_bytes: np.ndarray | None = None

    def bottleneck(self, k: int) -> int:
        """The stage with the highest peak at total k."""
        return int(np.argmax(self.stage_peak_bytes[k]))

    def with_peak(self, peak_bytes: np.ndarray) -> ParallelCurve:
        """This curve with the bottleneck stage at each k raised to ``peak_bytes[k]`` where that is higher (the
        answer's peak after the model-state floor and the envelope over k, shape (L+1,)): the stage the answer
        names says the answer's peak. The split of k and the phases stay.

        Raises:
            ValueError: ``peak_bytes`` not one value per k.
        """
        peak = np.asarray(peak_bytes, dtype=np.int64)
        if peak.shape != self.peak_bytes.shape:
            raise ValueError(f"peak_bytes has shape {peak.shape}, the curve {self.peak_bytes.shape}")
        stage_peak = self.stage_peak_bytes.copy()
        rows = np.arange(len(peak))
        top = stage_peak.argmax(axis=1)
        stage_peak[rows, top] = np.maximum(stage_peak[rows, top], peak)
        return dataclasses.replace(self, peak_bytes=stage_peak.max(axis=1), stage_peak_bytes=stage_peak)

    def plus(self, stage_bytes: list[int]) -> ParallelCurve:
        """This curve with ``stage_bytes[i]`` more bytes on stage i at every k (one per stage): the peak is the new
        bottleneck's; the split of k and the phases stay.

        Raises:
            ValueError: not one value per stage.
        """
        if len(stage_bytes) != len(self.stages):
            raise ValueError(f"stage_bytes has {len(stage_bytes)} values for {len(self.stages)} stages")
        stage_peak = self.stage_peak_bytes + np.asarray(stage_bytes, dtype=np.int64)[None, :]
        phases = None if self.phase_bytes is None else self.phase_bytes + float(stage_bytes[0])
        return dataclasses.replace(
            self, peak_bytes=stage_peak.max(axis=1), stage_peak_bytes=stage_peak, phase_bytes=phases
        )


def compose_pipeline(
    coef: dict[Any, Any], depths: tuple[int, int], model: ModelSpec, training: TrainingConfig
) -> ParallelCurve:
    """Per-rank peak for every total k, k layers spread over the stages greedily: each further
    checkpointed layer goes to the stage whose peak is then highest (ties: the earlier stage), so the
    bottleneck stage's peak is what k buys down. With pp = 1 this is the traced composition at
    ``seq_len / cp`` tokens plus the ring-attention buffers.
    """
    stages = pipeline_stages(model, training)
    composed = [compose_stage(coef, depths, model, training, st) for st in stages]
    per_stage = [c.max(axis=1) for c in composed]
    phases_of = [c.argmax(axis=1) for c in composed]
    L = model.num_layers
    ks = np.zeros(len(stages), dtype=np.int64)
    stage_k, stage_peak, peak, phase = [], [], [], []
    for total in range(L + 1):
        if total:
            order = sorted(range(len(stages)), key=lambda i: (-per_stage[i][ks[i]], i))
            i = next(i for i in order if ks[i] < stages[i].num_layers)
            ks[i] += 1
        now = np.array([per_stage[i][ks[i]] for i in range(len(stages))])
        top = int(np.argmax(now))
        stage_k.append(ks.copy())
        stage_peak.append(np.ceil(now).astype(np.int64))
        peak.append(int(np.ceil(now[top])))
        phase.append(PEAK_PHASES[int(phases_of[top][ks[top]])])
    return ParallelCurve(
        peak_bytes=np.array(peak, dtype=np.int64),
        phase=phase,
        stage_k=np.array(stage_k),
        stage_peak_bytes=np.array(stage_peak),
        stages=stages,
        phase_bytes=composed[0] if len(stages) == 1 else None,
    )
