"""Learned phase terms: LightGBM predicts the per-phase coefficients of configurations not traced yet.

The traced path (:mod:`model.compose`) needs, per phase, the live bytes of four small models (one and
two decoder layers, none or all checkpointed) as functions of the token basis (1, b·s, s, b·s², s²).
For a configuration without traced terms, :class:`CoefficientModel` predicts them from the shipped
term sets of other architectures (``data/terms/*.jsonl``), and the normal composition makes the curve,
so the provisional answer keeps the traced path's shape: per phase, monotone in k, micro-batch and
sequence length, never below the model states.

What is learned, per phase p (:data:`model.compose.PHASES`) and per quantity q of the composition:
``dF`` = P(2,0) − P(1,0) and ``dC`` = P(2,2) − P(1,1) (what an un-checkpointed / checkpointed layer
adds), and ``f0`` = P(1,0) − dF, ``c0`` = P(1,1) − dC (the model without decoder layers: embeddings,
head, logits), depths other than (1, 2) brought to one and two layers by :func:`model.compose.layer_values`.
Each is fitted by least squares as one linear piece ``a + β·b·s (+ γ·b·s² for eager attention)`` over
the entry's traced token points (a phase's live bytes are a max over pieces; one piece loses little:
``tests/test_coefficients.py``). Each coefficient is divided by a physical scale, and LightGBM learns
the dimensionless value from dimensionless config features (:func:`config_features`):

* constant ``a``: the model-state bytes (weights + gradients + optimizer states,
  :func:`model.analytic.model_state_bytes`) of the embeddings and head (``f0``, ``c0``) or of one decoder
  layer (``dF``, ``dC``), plus their unsharded weights and gradients with sharded training
  (:func:`small_model_states`);
* ``β`` (bytes per token): the analytic activations a layer saves
  (:func:`model.analytic.activation_bytes_per_layer`) for ``dF``, ``dC``; the logits bytes
  (:func:`head_token_bytes`: no fp32 copy of logits that are fp32 already) for ``f0``, ``c0``;
  with MoE, the ``experts_per_token`` routed experts' MLPs, each token's hidden state dispatched to and gathered
  from them and the fp32 router logits; with LoRA on PEFT's attention-only default targets, without the inputs of
  the frozen out-projection and MLP linears, which no weight gradient needs (:func:`scales`);
* ``γ`` (bytes per token × sequence, eager attention scores): per head, the fp32 softmax HF's
  ``eager_attention_forward`` makes (``softmax(..., dtype=torch.float32)``) plus, for ``dF``/``dC``, its saved cast
  back to 16-bit activations (none in fp32): the traced per-layer score bytes over this are 1.0 in every
  precision (over heads × activation bytes alone: 3 with 16-bit, 1 in fp32; ``benchmarks/results/design_choices.md``);
  ``f0``/``c0``: the fp32 softmax alone.

Constants are per tensor-parallel rank (:func:`model.analytic.tensor_parallel_rank_spec`).

Token coefficients are clipped at 0 after prediction, so every composed phase is non-decreasing in
micro-batch and sequence length by construction.

Artifacts: one LightGBM booster per coefficient in LightGBM's text format plus ``coefficients.json``
(feature names, categories, target list, scales) — no pickle.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np

from memfit.hf import attention_that_runs
from memfit.schema import (
    Attention,
    FineTune,
    ModelSpec,
    Precision,
    Quantization,
    Sharding,
    TrainingConfig,
)
from model.analytic import (
    GATED_MLP_FAMILIES,
    activation_bytes_per_layer,
    activation_dtype_bytes,
    expert_parallel_rank_spec,
    logits_bytes,
    model_state_bytes,
    tensor_parallel_rank_spec,
)
from model.compose import PHASES, VARIANTS, layer_values
from model.features import CATEGORIES
from model.job import Job, parameter_split, rank_hf_config, resolve, resolve_architecture

#: the composition's quantities per phase, each a function of the small models' live bytes
QUANTITIES = ("f0", "dF", "c0", "dC")
#: coefficients of one linear piece: constant, b·s, b·s² (eager attention scores)
PIECE = ("1", "b*s", "b*s^2")
#: where each of PIECE sits in model.compose.token_basis
_BASIS_INDEX = (0, 1, 3)
#: a target whose dimensionless value stays below this in 99 % of the entries is kept as its median, not
#: learned (24 of the 72: token bytes at rest and in the optimizer step, eager score bytes outside attention);
#: 1e-3 of a layer's activations or of its model states moves no composed peak measurably, and each learned
#: target is a booster in the artifact
NEGLIGIBLE = 1e-3
#: feature rows whose booster values a fitted model keeps (:meth:`CoefficientModel._scaled_targets`)
PREDICTION_CACHE_ROWS = 4096
#: artifact format: eager-score, tensor-parallel and MoE scales; constants scaled by the exact parameters outside
#: and inside one decoder layer (:func:`model.job.parameter_split`), an expert-parallel rank's by its own experts
#: (:func:`model.job.rank_hf_config`); shared state constants as (count, fixed bytes) pairs
#: (:func:`shared_state_constants`); the parameter-split snapshot with one layer's parameter tensors.
#: Boosters fitted on the scales of an older format would predict other bytes, and :meth:`CoefficientModel.load`
#: refuses them
FORMAT = "memfit-coefficients-5"
TARGETS: tuple[tuple[str, str, str], ...] = tuple((p, q, c) for p in PHASES for q in QUANTITIES for c in PIECE)

#: families with LayerNorm (else RMSNorm)
_LAYERNORM_FAMILIES = frozenset(
    {
        "gpt2",
        "gpt_neox",
        "opt",
        "bloom",
        "falcon",
        "phi",
        "gptj",
        "stablelm",
        "gpt_bigcode",
        "starcoder2",
        "mpt",
        "codegen",
        "cohere",
        "olmo",
    }
)
#: families with learned absolute position embeddings
_LEARNED_POSITION_FAMILIES = frozenset({"gpt2", "opt", "gpt_bigcode"})
#: families with ALiBi attention biases
_ALIBI_FAMILIES = frozenset({"bloom", "mpt"})
#: families whose attention projections have biases by default
_BIAS_FAMILIES = frozenset(
    {
        "gpt2",
        "opt",
        "bloom",
        "gpt_neox",
        "phi",
        "gptj",
        "gpt_bigcode",
        "starcoder2",
        "qwen2",
        "qwen2_moe",
        "stablelm",
        "codegen",
    }
)
#: families with per-head q/k norms
_QK_NORM_FAMILIES = frozenset({"qwen3", "qwen3_moe", "olmo2", "gemma3_text", "olmoe"})

#: the ratio model's categorical settings (model.features.CATEGORIES) plus the quantized base
CATEGORICAL: dict[str, list[str]] = {**CATEGORIES, "quantization": [e.value for e in Quantization]}
NUMERIC = [
    "ffn_ratio",
    "kv_ratio",
    "head_dim",
    "vocab_ratio",
    "log2_hidden",
    "num_attention_heads",
    "tied_embeddings",
    "gated_mlp",
    "layernorm",
    "parallel_residual",
    "qk_norm",
    "alibi",
    "learned_positions",
    "attention_bias",
    "gelu_tanh",
    "logit_softcapping",
    "sliding_window",
    "num_experts",
    "experts_per_token",
    "data_parallel_size",
    "lora_rank",
    "lora_targets",
    "optimizer_in_backward",
    "tensor_parallel_size",
    "sequence_parallel",
    "expert_parallel_size",
    "grad_share",
    "optimizer_share",
    "activation_bytes",
    "autocast",
    "master_weights",
    "sharded_weights",
]
FEATURE_NAMES: list[str] = NUMERIC + list(CATEGORICAL) + ["model_type"]


def _flag(cfg: dict[str, Any], *keys: str) -> bool:
    return any(bool(cfg.get(k)) for k in keys)


def config_features(model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any]) -> list[float]:
    """One row of :data:`FEATURE_NAMES` (categoricals as their index in :data:`CATEGORICAL`).

    Only dimensionless architecture features (ratios, flags) and the training settings the terms key
    holds: the size of the model enters through the scales of the targets.
    """
    mt = model.architecture
    h = model.hidden_size
    heads = model.num_attention_heads
    head_dim = model.head_dim or h // heads
    act = str(
        hf_config.get("hidden_act") or hf_config.get("activation_function") or hf_config.get("hidden_activation") or ""
    )
    states = model_state_bytes(model, training)
    s_total = max(states.total_bytes, 1)
    row = {
        "ffn_ratio": model.intermediate_size / h,
        "kv_ratio": model.num_key_value_heads / heads,
        "head_dim": head_dim,
        "vocab_ratio": model.vocab_size / h,
        "log2_hidden": math.log2(h),
        "num_attention_heads": heads,
        "tied_embeddings": float(model.tie_word_embeddings),
        "gated_mlp": float(mt in GATED_MLP_FAMILIES),
        "layernorm": float(mt in _LAYERNORM_FAMILIES),
        "parallel_residual": float(_flag(hf_config, "use_parallel_residual", "parallel_attn") or mt in ("phi", "gptj")),
        "qk_norm": float(mt in _QK_NORM_FAMILIES or _flag(hf_config, "qk_layernorm", "use_qk_norm")),
        "alibi": float(mt in _ALIBI_FAMILIES or _flag(hf_config, "alibi")),
        "learned_positions": float(mt in _LEARNED_POSITION_FAMILIES),
        "attention_bias": float(mt in _BIAS_FAMILIES or _flag(hf_config, "attention_bias", "bias", "qkv_bias")),
        "gelu_tanh": float("tanh" in act or act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")),
        "logit_softcapping": float(_flag(hf_config, "final_logit_softcapping", "attn_logit_softcapping")),
        "sliding_window": float(
            _flag(hf_config, "sliding_window") and hf_config.get("use_sliding_window") is not False
        ),
        "num_experts": float(model.num_experts or 0),
        "experts_per_token": float(model.num_experts_per_token or 0),
        "data_parallel_size": training.data_parallel_size if training.sharding is not Sharding.NONE else 1,
        "lora_rank": training.lora_rank or 0 if training.finetune is FineTune.LORA else 0,
        "lora_targets": len(training.lora_target_modules or ()) if training.finetune is FineTune.LORA else 0,
        "optimizer_in_backward": float(training.optimizer_in_backward),
        "tensor_parallel_size": training.tensor_parallel_size,
        "sequence_parallel": float(training.sequence_parallel),
        "expert_parallel_size": training.expert_parallel_size,
        "grad_share": states.gradients_bytes / s_total,
        "optimizer_share": states.optimizer_bytes / s_total,
        # the precision as numbers: LightGBM splits a categorical only on >= min_data_per_group (100) rows per
        # side, so the ~40 fp32 entries could not be told apart from amp (same state shares) by "precision"
        "activation_bytes": float(activation_dtype_bytes(training.precision)),
        "autocast": float(training.precision in (Precision.AMP_BF16, Precision.AMP_FP16)),
        "master_weights": float(training.precision is Precision.BF16_FP32_MASTER),
        # weights sharded over the ranks and gathered per unit: the live bytes hold full (gathered) weights
        # and gradients over model states divided by the ranks
        "sharded_weights": float(training.sharding in (Sharding.FSDP_FULL_SHARD, Sharding.ZERO3)),
    }
    cats = {c: CATEGORICAL[c].index(getattr(training, c).value) for c in CATEGORICAL}
    return [float(row[c]) for c in NUMERIC] + [float(cats[c]) for c in CATEGORICAL]


def _with_family(features: list[float], model: ModelSpec, families: list[str]) -> list[float]:
    """``features`` plus the ``model_type`` feature: its index among the families seen in training, NaN
    for a family never seen (LightGBM sends missing values the learned default way)."""
    return [*features, float(families.index(model.architecture)) if model.architecture in families else math.nan]


def head_token_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the logits, their fp32 copy and its gradient (:func:`model.analytic.logits_bytes`), without the
    copy where the logits are fp32 already (fp32 training): HF ``ForCausalLMLoss`` upcasts with ``.float()``,
    a no-op on an fp32 tensor. Measured on the shipped traced terms, the head's per-token live bytes over
    ``logits_bytes`` are 1.01-1.02 with 16-bit logits and 0.67 (= 8 / 12) in fp32: this scale makes both 1.

    Shape: bytes for the configuration's micro-batch and sequence length.
    """
    full = logits_bytes(model, training)
    if activation_dtype_bytes(training.precision) < 4:
        return full
    sbv = training.seq_len * training.micro_batch_size * model.vocab_size // training.tensor_parallel_size
    return full - 4 * sbv


def small_model_states(
    model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None = None
) -> tuple[float, float]:
    """(model-state bytes of the one-layer model, of one decoder layer): the scales of the constants.

    Parameters are split into those outside the decoder layers and one decoder layer's as the model's code has
    them (:func:`model.job.parameter_split` of ``hf_config``), else, without a config that builds, into embeddings
    (vocab × hidden, twice when untied) and equal decoder layers of the published total. With that formula split
    for every entry, the constants learned leaving one model out are further off their scale than with the exact
    split (OPT-350m: 0.22 against 0.01 mean absolute error; ``benchmarks/results/design_choices.md``).
    Trainable parameters (LoRA adapters) are spread evenly over the layers. With sharded training the
    unsharded weights and gradients are added: a rank holds its shard of the states, but the gathered
    weights (FSDP full shard, ZeRO-3) and the full gradients before their reduce-scatter (every sharding)
    of the unit being computed — measured on the shipped traced terms, the embeddings' live bytes over their
    sharded states alone reach 70 over 64 ranks, where over this scale they stay near 1.
    With expert parallelism a rank holds ``num_experts / expert_parallel_size`` experts of each MoE layer
    (:func:`model.job.rank_hf_config`), as the tracer builds it (counting every expert puts the held-out MoE models
    with four expert-parallel ranks 113-202 % high).
    """
    L = model.num_layers
    split = parameter_split(rank_hf_config(hf_config, training))
    if split is not None:
        emb, layer = split.outside, split.layer
    else:
        model = expert_parallel_rank_spec(model, training)  # the formula split of the rank's experts
        emb = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
        layer = max(model.total_params - emb, L) / L
    full = model.trainable_params >= model.total_params

    def states(n: int) -> float:
        total = int(emb + n * layer)
        trainable = total if full else int(model.trainable_params * n / L)
        spec = tensor_parallel_rank_spec(
            model.model_copy(update={"num_layers": n, "total_params": total, "trainable_params": trainable}), training
        )
        held = float(model_state_bytes(spec, training).total_bytes)
        if training.sharding is Sharding.NONE:
            return held
        whole = model_state_bytes(
            spec, training.model_copy(update={"sharding": Sharding.NONE, "data_parallel_size": 1})
        )
        return held + float(whole.weights_bytes + whole.gradients_bytes)

    one = states(1)
    return max(one, 1.0), max(states(2) - one, 1.0)


#: LoRA target names that adapt an MLP linear (any other target list, and PEFT's default, adapts attention only)
_MLP_TARGETS = (
    "mlp",
    "up_proj",
    "down_proj",
    "gate_proj",
    "fc1",
    "fc2",
    "c_fc",
    "c_proj",
    "dense_h_to_4h",
    "dense_4h_to_h",
    "w1",
    "w2",
    "w3",
    "gate_up_proj",
)


def _mlp_adapted(training: TrainingConfig) -> bool:
    return any(t in _MLP_TARGETS for t in training.lora_target_modules or ())


def scales(model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None = None) -> np.ndarray:
    """The physical scale of every target in :data:`TARGETS` (bytes, bytes per token, bytes per token·s).

    Constants: the model states of the embeddings and head, or of one layer (:func:`small_model_states`).
    Per token: the analytic activations one layer saves (:func:`model.analytic.activation_bytes_per_layer`
    without the eager score term), or the logits and their fp32 copies (:func:`model.analytic.logits_bytes`).
    Per token × sequence (eager attention scores, per tensor-parallel rank's heads): 4 bytes (fp32 softmax) plus
    the activation dtype bytes of its saved 16-bit cast for a layer's increments, 4 bytes for the bases.
    """
    a = activation_dtype_bytes(training.precision)
    s_one, s_layer = small_model_states(model, training, hf_config)
    one_token = training.model_construct(
        **{**training.__dict__, "micro_batch_size": 1, "seq_len": 1, "attention": Attention.SDPA}
    )
    # MoE: every token runs through experts_per_token routed experts of width intermediate_size
    routed = model.model_copy(
        update={"intermediate_size": model.intermediate_size * (model.num_experts_per_token or 1)}
    )
    layer = float(max(activation_bytes_per_layer(routed, one_token, count_scores=False), 1))
    if training.finetune is FineTune.LORA and not _mlp_adapted(training):
        # frozen linears need no input saved for a weight gradient: with PEFT's attention-only default targets the
        # out-projection, MLP input and second-linear inputs (Korthikanti's accounting, as above) are not saved
        h = model.hidden_size
        q = model.num_attention_heads * (model.head_dim or h // model.num_attention_heads)
        # (gated MLPs: the product act(gate)·up; measured, a GeLU MLP's second-linear input stays saved)
        f = model.intermediate_size if model.architecture in GATED_MLP_FAMILIES else 0
        # (the MLP input is whole on every tensor-parallel rank without sequence parallelism: analytic, Eq. 2)
        t = training.tensor_parallel_size
        layer = max(
            layer - ((2 * q + 2 * f) / t + 2 * h / (t if training.sequence_parallel else 1)) * a / 2, 0.25 * layer
        )
    if model.num_experts:  # each token's hidden state dispatched to and gathered from its k experts, fp32 router logits
        k = model.num_experts_per_token or 1
        layer += (2 * k * model.hidden_size * a + 4 * model.num_experts) / training.tensor_parallel_size
    head = float(max(head_token_bytes(model, one_token), 1))
    s_base = max(s_one - s_layer, 1.0)
    heads = model.num_attention_heads / training.tensor_parallel_size
    # eager attention scores per element: the fp32 softmax (HF eager_attention_forward: softmax(dtype=float32))
    # plus its cast back to 16-bit activations (a no-op in fp32)
    saved_score = heads * (4 + (a if a < 4 else 0))
    transient_score = heads * 4
    per_q = {
        "f0": (s_base, head, transient_score),
        "c0": (s_base, head, transient_score),
        "dF": (s_layer, layer, saved_score),
        "dC": (s_layer, layer, saved_score),
    }
    return np.array([per_q[q][PIECE.index(c)] for _p, q, c in TARGETS], dtype=np.float64)


def fitted_pieces(terms: dict[str, Any]) -> np.ndarray:
    """One least-squares linear piece per target of :data:`TARGETS` for a traced terms entry (bytes).

    The small models' live bytes are taken at the entry's traced token points (``terms["points"]``),
    brought to one and two layers, and each quantity of :data:`QUANTITIES` is fitted on (1, b·s) —
    plus b·s² with eager attention — weighted by the inverse of the one-layer model's live bytes.
    """
    depths = tuple(terms.get("depths", (terms.get("period", 1), 2 * terms.get("period", 1))))
    points = [tuple(p) for p in terms["points"]]
    eager = terms.get("attention") == "eager"
    cols = [0, 1, 2] if eager else [0, 1]
    rows, vals = [], {t: [] for t in TARGETS}
    for b, s in points:
        v = layer_values(terms["coef"], b, s, depths)
        rows.append([1.0, b * s, b * s * s])
        for p in PHASES:
            dF, dC = v[(2, 0)][p] - v[(1, 0)][p], v[(2, 2)][p] - v[(1, 1)][p]
            q = {"f0": v[(1, 0)][p] - dF, "dF": dF, "c0": v[(1, 1)][p] - dC, "dC": dC}
            for qn in QUANTITIES:
                vals_q = q[qn]
                for c in PIECE:
                    vals[(p, qn, c)].append(vals_q)
    X = np.asarray(rows)[:, cols]
    scale = np.linalg.norm(X, axis=0)
    out = np.zeros(len(TARGETS))
    for p in PHASES:
        for qn in QUANTITIES:
            y = np.asarray(vals[(p, qn, "1")])
            sol, *_ = np.linalg.lstsq(X / scale, y, rcond=None)
            sol = sol / scale
            for j, c in enumerate(PIECE):
                out[TARGETS.index((p, qn, c))] = sol[j] if j < len(cols) else 0.0
    return out


def pieces_to_coef(pieces: np.ndarray) -> dict[str, dict[str, list[list[float]]]]:
    """Terms ``coef`` JSON (one piece per phase and small model) from :data:`TARGETS` values in bytes."""
    coef: dict[str, dict[str, list[list[float]]]] = {f"{n},{c}": {} for n, c in VARIANTS}
    val = dict(zip(TARGETS, pieces))
    for p in PHASES:
        for one, two, base, inc in (("1,0", "2,0", "f0", "dF"), ("1,1", "2,2", "c0", "dC")):
            vb = [0.0] * 5
            vi = [0.0] * 5
            for c, idx in zip(PIECE, _BASIS_INDEX):
                vb[idx] = float(val[(p, base, c)] + val[(p, inc, c)])
                vi[idx] = float(val[(p, base, c)] + 2 * val[(p, inc, c)])
            coef[one][p] = [vb]
            coef[two][p] = [vi]
    return coef


def entry_configuration(entry: dict[str, Any]) -> Job:
    """The :class:`model.job.Job` of a shipped terms entry, by ``model_name``: a catalog architecture (published
    parameter count) or a reduced MoE model (:func:`data.catalog.hf_config_of`, counted on a meta build), with the
    entry's training (micro-batch 1, sequence 1,024: the composed ones); a LoRA entry's trainable count is its
    adapters' (:meth:`model.job.Architecture.lora_trainable_params`).

    Raises:
        LookupError: ``model_name`` is neither.
    """
    from data.catalog import hf_config_of
    from memfit.errors import UnknownModel
    from model.terms import key_training_fields

    name = entry["model_name"]
    hf = hf_config_of(name)
    if hf is None:
        raise LookupError(f"terms entry {entry.get('key', '')[:12]}: no HF config for model {name!r}")
    try:
        arch = resolve_architecture(name)
    except UnknownModel:
        arch = resolve_architecture(hf, name=name)
    fields = key_training_fields(entry["training"])
    # the terms key keeps data_parallel_size 1 without sharding; expert parallelism splits experts over those ranks
    fields["data_parallel_size"] = max(fields.get("data_parallel_size", 1), fields.get("expert_parallel_size", 1))
    job = resolve(arch, TrainingConfig.model_validate({"micro_batch_size": 1, "seq_len": 1024, **fields}))
    if job.training.finetune is FineTune.LORA:
        trainable = arch.lora_trainable_params(job.training.lora_rank, job.training.lora_target_modules)
        job = dataclasses.replace(job, spec=job.spec.model_copy(update={"trainable_params": trainable}))
    return job


#: the constants of the phases that hold model states only (at rest, the optimizer step): per training setting they are
#: one value that the traced architectures share (weights, gradients, optimizer states and the step's temporaries
#: over the same states scale: 0.75 at rest and 1.25 in a foreach AdamW step with fp32 states, ...)
STATE_CONSTANTS: tuple[int, ...] = tuple(j for j, (p, _q, c) in enumerate(TARGETS) if p in ("rest", "opt") and c == "1")
#: a state constant is a setting's shared value when at least this many architectures were traced with the setting ...
SHARED_MIN_ARCHITECTURES = 3
#: ... and this share of their entries lies within :data:`SHARED_RELATIVE_TOLERANCE` of the median
SHARED_MIN_SHARE = 0.9
SHARED_RELATIVE_TOLERANCE = 1e-3


def setting_key(training: TrainingConfig) -> str:
    """The training fields traced terms depend on (:func:`model.terms.training_key_fields`), as canonical JSON."""
    from model.terms import training_key_fields

    return json.dumps(training_key_fields(training), sort_keys=True)


def _per_layer(j: int) -> bool:
    """Whether target ``j`` is a per-layer increment (``dF``, ``dC``) rather than a base (``f0``, ``c0``)."""
    return TARGETS[j][1].startswith("d")


def layer_tensors(model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None) -> int:
    """Parameter tensors of one decoder layer of what one rank builds (:func:`model.job.parameter_split` of
    :func:`model.job.rank_hf_config`); 0 where the config does not build."""
    split = parameter_split(rank_hf_config(hf_config, training))
    return 0 if split is None else split.layer_tensors


def shared_state_constants(
    names: list[str], keys: list[str], Y: np.ndarray, S: np.ndarray, T: np.ndarray
) -> dict[str, dict[int, tuple[float, float]]]:
    """Per training setting (:func:`setting_key`), the :data:`STATE_CONSTANTS` its traced architectures share.

    Args:
        names: model name of each entry; keys: its setting key; Y: its dimensionless targets, shape
            ``(len(names), len(TARGETS))``; S: their scales (:func:`scales`, bytes), the same shape; T: the
            parameter tensors of one decoder layer of each entry (:func:`layer_tensors`), shape ``(len(names),)``.

    Returns:
        ``{setting key: {target index: (count, fixed_bytes)}}`` for the targets where at least
        :data:`SHARED_MIN_ARCHITECTURES` architectures have the setting and :data:`SHARED_MIN_SHARE` of the entries
        lie within :data:`SHARED_RELATIVE_TOLERANCE` of their median. GPT-Neo's at-rest layer constant (0.787 where
        the others have 0.75) is the kind of entry the share leaves room for. A constant's bytes are ``count ×
        scale + fixed_bytes × n``: a count of the states (0.75 at rest with fp32 AdamW states over the states scale,
        1.25 in its foreach step) plus bytes that do not grow with the parameters, per parameter tensor of a layer
        for the per-layer targets (``n`` = :func:`layer_tensors`: AdamW's one-element ``step`` tensor per parameter,
        a 512-byte block each) and once for the bases (``n`` = 1: amp_fp16's gradient-scaler tensors; the
        embeddings' and final norm's ``step``). ``count`` and ``fixed_bytes`` are the Theil-Sen line (Sen 1968,
        JASA 63) of the constants over ``n / scale``; with one such value, the median and 0. On the traced
        amp_fp16 foreach-AdamW entries every layer's excess over 1.25 × its scale is exactly 512 bytes per tensor
        (9 for Llama, 12 for GPT-2 and Pythia, 16 for OPT); the median alone would charge the small models' step
        tensors in proportion to a large model's states (Llama-2-70B's step 15 MiB high, small-to-large).
    """
    from scipy.stats import theilslopes

    by_key: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for key, rows in by_key.items():
        if len({names[i] for i in rows}) < SHARED_MIN_ARCHITECTURES:
            continue
        for j in STATE_CONSTANTS:
            v = Y[rows, j]
            med = float(np.median(v))
            if np.mean(np.abs(v - med) <= SHARED_RELATIVE_TOLERANCE * abs(med)) < SHARED_MIN_SHARE:
                continue
            x = (T[rows] if _per_layer(j) else np.ones(len(rows))) / S[rows, j]
            if np.ptp(x) > 0:
                with np.errstate(invalid="ignore"):  # its confidence interval, unused, can take a root of < 0
                    fixed, count = theilslopes(v, x)[:2]
                out.setdefault(key, {})[j] = (float(count), float(fixed))
            else:
                out.setdefault(key, {})[j] = (med, 0.0)
    return out


def _booster_file(j: int, objective: str, objectives: tuple[str, ...]) -> str:
    return f"coef_{j}.txt" if objective == objectives[0] else f"coef_{j}_{objective}.txt"


class CoefficientModel:
    """LightGBM regressors of the dimensionless phase coefficients (see the module docstring).

    Args:
        n_estimators, learning_rate, num_leaves, min_child_samples: LightGBM parameters (per target and objective).
        objectives: one booster per objective and target, their predictions averaged. The default, absolute
            error (``l1``) and Huber (squared error below LightGBM's ``alpha`` 0.9, absolute above), averaged,
            has the lowest error on :mod:`benchmarks.accuracy`'s leave-architecture-out folds of the learned path:
            MAPE 2.39 %, saving median error 2.87 % (``l1`` alone 2.48 / 4.75 %). The objectives and LightGBM
            settings measured and left out are in ``benchmarks/results/design_choices.md``.

    The constants of the state-only phases are not learned where the training setting's traced architectures
    share them (:func:`shared_state_constants`): those values are counts (states and step temporaries over the
    states), and a setting seen on three or more architectures gives them exactly, where the trees' average of two
    objectives was 0.1-0.5 % off (small-to-large, Llama-2-70B, amp_fp16 foreach AdamW: the optimizer step's layer
    constant 1.2493 for 1.25, the whole curve 0.23 % low). Measured on the shipped terms in four
    architecture-held-out folds: the setting's shared value covers 59 % of these constants, with a
    median relative error of 0.002 % (the trees: 0.37 %).

    Attributes (after :meth:`fit` or :meth:`load`): ``boosters_`` (target index -> one ``lightgbm.Booster`` per
    objective;
    targets constant in the training set are kept as ``constants_``), ``shared_`` (setting key -> target index
    -> shared state constant as (count, fixed bytes), :func:`shared_state_constants`), ``settings_`` (the training
    settings seen, :meth:`covers`), ``n_entries_``.
    """

    def __init__(
        self,
        n_estimators: int = 300,
        learning_rate: float = 0.05,
        num_leaves: int = 15,
        min_child_samples: int = 5,
        objectives: tuple[str, ...] = ("l1", "huber"),
    ) -> None:
        if not objectives:
            raise ValueError("objectives must name at least one LightGBM objective")
        self.objectives = tuple(objectives)
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.num_leaves = num_leaves
        self.min_child_samples = min_child_samples

    def _params(self, objective: str) -> dict[str, Any]:
        return {
            "objective": objective,
            "learning_rate": self.learning_rate,
            "num_leaves": self.num_leaves,
            "min_child_samples": self.min_child_samples,
            "min_data_in_bin": 1,
            "verbose": -1,
            "seed": 0,
            "num_threads": 1,
            "deterministic": True,
            "force_row_wise": True,
            # categorical splits on groups as small as a leaf (LightGBM's default needs 100 rows per group:
            # with ~500 entries no precision, optimizer or sharding but the most common could be told apart)
            "min_data_per_group": self.min_child_samples,
            "cat_smooth": 1.0,
        }

    @staticmethod
    def setting(training: TrainingConfig) -> str:
        """The categorical training setting a prediction needs seen in training (precision, optimizer, ...)."""
        return "/".join(getattr(training, c).value for c in ("sharding", "finetune", "quantization"))

    def fit(self, entries: Iterable[dict[str, Any]]) -> CoefficientModel:
        """Fit on shipped terms entries (``{"model_name", "training", "terms"}``). Entries of models without an
        HF config here (:func:`entry_configuration`), with gradient accumulation, or traced with a GPU generation's
        CUDA semantics (``cuda_generation``: the coefficients learn the CPU-semantics terms, and such a line has a
        CPU twin of the same training fields) are left out and listed in ``skipped_``.

        Raises:
            ValueError: no entries.
        """
        X, Y, S, T, settings, specs, names, keys = [], [], [], [], set(), [], [], []
        self.skipped_ = []
        for e in entries:
            if e["training"].get("gradient_accumulation"):  # model.curve adds the gradient buffer to steps of one
                self.skipped_.append(f"{e['model_name']}: gradient accumulation (learned per micro-batch)")
                continue
            if e["training"].get("cuda_generation"):  # the coefficients learn the CPU-semantics terms
                self.skipped_.append(f"{e['model_name']}: {e['training']['cuda_generation']} CUDA terms (CPU learned)")
                continue
            try:
                job = entry_configuration(e)
            except (LookupError, ValueError) as err:  # no HF config here, or settings this code refuses
                self.skipped_.append(str(err))
                continue
            spec, training, hf = job.spec, job.training, job.hf_config
            specs.append(spec)
            names.append(e["model_name"])
            keys.append(setting_key(training))
            X.append(config_features(spec, training, hf))
            S.append(scales(spec, training, hf))
            T.append(layer_tensors(spec, training, hf))
            Y.append(fitted_pieces(e["terms"]) / S[-1])
            settings.add(self.setting(training))
        if not X:
            raise ValueError("CoefficientModel.fit needs at least one terms entry")
        self.families_ = sorted({m.architecture for m in specs})
        X = np.asarray([_with_family(x, m, self.families_) for x, m in zip(X, specs)])
        Y = np.asarray(Y)
        self.boosters_, self.constants_ = {}, {}
        self._prediction_cache: dict[bytes, np.ndarray] = {}  # the values of the boosters fitted here
        cat = [FEATURE_NAMES.index(c) for c in [*CATEGORICAL, "model_type"]]
        for j in range(len(TARGETS)):
            y = Y[:, j]
            if np.ptp(y) <= 1e-12 * max(1.0, float(np.abs(y).max())):
                self.constants_[j] = float(y[0])
                continue
            if float(np.quantile(np.abs(y), 0.99)) < NEGLIGIBLE:  # e.g. token bytes at rest or in the step
                self.constants_[j] = float(np.median(y))
                continue
            ds = lgb.Dataset(X, label=y, feature_name=FEATURE_NAMES, categorical_feature=cat, free_raw_data=True)
            self.boosters_[j] = [
                lgb.train(self._params(o), ds, num_boost_round=self.n_estimators) for o in self.objectives
            ]
        self.shared_ = shared_state_constants(names, keys, Y, np.asarray(S), np.asarray(T, dtype=np.float64))
        self.settings_ = sorted(settings)
        self.n_entries_ = len(X)
        return self

    def covers(self, model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any] | None) -> bool:
        """Whether the composition applies (:func:`model.terms.not_traceable_reason` is None, an HF config is
        given, no pipeline/context parallelism) and the training setting was seen in training."""
        from model.terms import not_traceable_reason

        return (
            hf_config is not None
            and not_traceable_reason(model, training, hf_config) is None
            and training.pipeline_parallel_size == 1
            and training.context_parallel_size == 1
            and self.setting(training) in self.settings_
        )

    def _scaled_targets(self, features: list[float]) -> np.ndarray:
        """The boosters' (and constants') values of one :data:`FEATURE_NAMES` row, the targets over their scales.

        Kept per row (at most :data:`PREDICTION_CACHE_ROWS`): the features hold no micro-batch size or sequence
        length, so the alternatives of one request and the requests that differ only there share them, and each
        row costs a LightGBM call per booster (a distinct /recommend planned 8 alternatives, 960 calls).
        """
        cache = self.__dict__.setdefault("_prediction_cache", {})
        key = np.asarray(features, dtype=np.float64).tobytes()
        y = cache.get(key)
        if y is None:
            x = np.asarray([features], dtype=np.float64)
            y = np.zeros(len(TARGETS))
            for j, c in self.constants_.items():
                y[j] = c
            for j, boosters in self.boosters_.items():
                y[j] = np.mean([b.predict(x, num_threads=1)[0] for b in boosters])
            y.flags.writeable = False
            if len(cache) >= PREDICTION_CACHE_ROWS:
                cache.clear()
            cache[key] = y
        return y

    def predict_pieces(self, model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any]) -> np.ndarray:
        """Predicted :data:`TARGETS` values in bytes (token coefficients clipped at 0), shape (len(TARGETS),)."""
        y = self._scaled_targets(_with_family(config_features(model, training, hf_config), model, self.families_))
        scale = scales(model, training, hf_config)
        out = y * scale
        shared = self.shared_.get(setting_key(training), {})
        n_tensors = layer_tensors(model, training, hf_config) if shared else 0
        for j, (count, fixed) in shared.items():
            out[j] = count * scale[j] + fixed * (n_tensors if _per_layer(j) else 1)
        for j, (_p, _q, c) in enumerate(TARGETS):
            if c != "1":
                out[j] = max(out[j], 0.0)
        if attention_that_runs(model.architecture, training.attention) is not Attention.EAGER:
            out[[j for j, t in enumerate(TARGETS) if t[2] == "b*s^2"]] = 0.0
        return out

    def predict_coef(
        self, model: ModelSpec, training: TrainingConfig, hf_config: dict[str, Any]
    ) -> dict[str, dict[str, list[list[float]]]]:
        """Terms ``coef`` JSON for :func:`model.compose.compose` (one piece per phase and small model)."""
        return pieces_to_coef(self.predict_pieces(model, training, hf_config))

    # -- artifacts ------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write ``coefficients.json`` and, per learned target ``j``, one booster (LightGBM text format) per objective:
        ``coef_<j>.txt`` for the first, ``coef_<j>_<objective>.txt`` for the others."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for j, boosters in self.boosters_.items():
            for o, b in zip(self.objectives, boosters):
                b.save_model(str(d / _booster_file(j, o, self.objectives)))
        meta = {
            "format": FORMAT,
            "feature_names": FEATURE_NAMES,
            "categorical": CATEGORICAL,
            "targets": ["|".join(t) for t in TARGETS],
            "constants": {str(j): c for j, c in self.constants_.items()},
            "shared": {key: {str(j): list(c) for j, c in v.items()} for key, v in self.shared_.items()},
            "boosters": sorted(self.boosters_),
            "settings": self.settings_,
            "families": self.families_,
            "n_entries": self.n_entries_,
            "params": {
                "n_estimators": self.n_estimators,
                "learning_rate": self.learning_rate,
                "num_leaves": self.num_leaves,
                "min_child_samples": self.min_child_samples,
                "objectives": list(self.objectives),
            },
        }
        path = d / "coefficients.json"
        path.write_text(json.dumps(meta, indent=1))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> CoefficientModel:
        """Read what :meth:`save` wrote.

        Raises:
            ValueError: the artifact was written in another format (other target scales), for other features or
                targets.
            FileNotFoundError: a file is missing.
        """
        d = Path(directory)
        meta = json.loads((d / "coefficients.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{d / 'coefficients.json'}: format {meta.get('format')!r}, not {FORMAT!r} (targets scaled "
                "otherwise); refit it"
            )
        if meta.get("feature_names") != FEATURE_NAMES or meta.get("targets") != ["|".join(t) for t in TARGETS]:
            raise ValueError(f"{d / 'coefficients.json'}: written for other features or targets; refit it")
        params = dict(meta["params"])
        if "objective" in params:  # coefficients.json of a single-objective model: one ``objective`` parameter
            params["objectives"] = (params.pop("objective"),)
        self = cls(**params)
        self.constants_ = {int(j): float(c) for j, c in meta["constants"].items()}
        self.shared_ = {
            key: {int(j): (float(c[0]), float(c[1])) for j, c in v.items()} for key, v in meta.get("shared", {}).items()
        }
        self.boosters_ = {
            int(j): [
                lgb.Booster(model_file=str(d / _booster_file(int(j), o, self.objectives))) for o in self.objectives
            ]
            for j in meta["boosters"]
        }
        self.settings_ = list(meta["settings"])
        self.families_ = list(meta["families"])
        self.n_entries_ = int(meta["n_entries"])
        return self
