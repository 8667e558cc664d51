"""The provisional path of learned phase coefficients (model.coefficients): one-piece fit of the traced
terms, leave-architecture-out accuracy on measured telemetry, artifacts round trip, curve invariants."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from data import catalog
from memfit.schema import ModelSpec, TrainingConfig
from model.coefficients import (
    FORMAT,
    TARGETS,
    CoefficientModel,
    entry_configuration,
    fitted_pieces,
    pieces_to_coef,
)
from model.compose import compose
from model.curve import PROVISIONAL, PROVISIONAL_COEFFICIENTS, MemoryPredictor, margin_group
from model.terms import TermsCache, shipped_entries

ROOT = Path(__file__).resolve().parent.parent
#: held out of the coefficient model's training set in the accuracy test: three families' members whose
#: other sizes stay in training, as a new size of a known family would come to the service
HELD_OUT = ("pythia-410m", "qwen2.5-1.5b", "llama-3.2-3b")


@pytest.fixture(scope="module")
def entries():
    return shipped_entries()


@pytest.fixture(scope="module")
def held_out_model(entries):
    return CoefficientModel().fit([e for e in entries if e["model_name"] not in HELD_OUT])


@pytest.fixture(scope="module")
def scaled_targets(entries):
    """(spec, training, targets over :func:`model.coefficients.scales`) per shipped entry: what the trees learn."""
    from model.coefficients import scales

    out = []
    for e in entries:
        job = entry_configuration(e)
        spec, training, hf = job.spec, job.training, job.hf_config
        out.append((spec, training, fitted_pieces(e["terms"]) / scales(spec, training, hf)))
    return out


def _entry(entries, name, **training):
    for e in entries:
        if e["model_name"] == name and all(e["training"].get(k) == v for k, v in training.items()):
            return e
    raise LookupError(name)


def test_one_piece_per_phase_reproduces_the_traced_composition(entries):
    """The learned targets are one linear piece per phase; on the traced terms themselves that loses little:
    measured over all 462 shipped entries, every k, at (1, shortest traced s) and (largest traced b and s):
    mean 0.08 %, p95 0.02 %, worst 13.5 % (pieces that cross inside the traced range). Here: three
    architectures, each k, within their traced token range."""
    for name in ("llama-3.2-1b", "gpt2-medium", "bloom-560m"):
        e = _entry(entries, name, precision="amp_bf16", sharding="none", finetune="full")
        spec = entry_configuration(e).spec
        t = e["terms"]
        depths = tuple(t.get("depths", (t.get("period", 1), 2 * t.get("period", 1))))
        pts = t["points"]
        for b, s in ((1, min(p[1] for p in pts)), (max(p[0] for p in pts), max(p[1] for p in pts))):
            true = compose(t["coef"], spec.num_layers, b, s, depths).peak_bytes
            one = compose(pieces_to_coef(fitted_pieces(t)), spec.num_layers, b, s).peak_bytes
            rel = np.abs(one / true - 1)
            assert rel.max() < 0.03, (name, b, s, rel.max())


def test_leave_architecture_out_accuracy_on_measured_rows(held_out_model):
    """Curves of three architectures whose terms (and nothing else of them) the model never saw, against their
    measured telemetry rows (317 rows of the settings the model covers): MAPE measured 2.9 % (pythia-410m 2.7,
    qwen2.5-1.5b 0.3, llama-3.2-3b 10.5: its 13 amp_fp16 rows 11 % low) with the fp32 head scale, numeric
    precision features and the gathered-weights scale of sharded training; 3.2 % (3.3, 0.8, 4.8) before. Over
    all 54 architectures (5-fold leave-architecture-out) these changes took the composed curve from 7.5 to 3.4 %. The
    LightGBM-ratio path's leave-architecture-out MAPE over all architectures is 7.6 %
    (benchmarks/results/accuracy.txt)."""
    from model.evaluate import FAMILY_COLUMNS, load_rows, row_configuration

    df, _ = load_rows(files=[ROOT / "data" / "telemetry" / "telemetry.parquet"])
    df = df[df["model_name"].isin(HELD_OUT)].reset_index(drop=True)
    predictor = MemoryPredictor(None, TermsCache(shipped_dir=None), coefficients=held_out_model)
    errors: dict[str, list[float]] = {n: [] for n in HELD_OUT}
    for _key, g in df.groupby([c for c in FAMILY_COLUMNS if c in df.columns], dropna=False, sort=False):
        job = row_configuration(g.iloc[0].to_dict())
        spec, training, hf = job.spec, job.training, job.hf_config
        if not held_out_model.covers(spec, training, hf):
            continue
        c = predictor.curve(spec, training, hf)
        assert c.learned_coefficients and c.path == PROVISIONAL
        for k, y in zip(g["num_checkpointed_layers"].astype(int), g["peak_allocated_bytes"]):
            errors[spec.model_name].append(abs(c.points[k].predicted_bytes / y - 1))
    assert all(len(v) >= 10 for v in errors.values()), {n: len(v) for n, v in errors.items()}
    mape = 100 * np.mean([x for v in errors.values() for x in v])
    assert mape < 3.2, mape
    per_architecture = {n: 100 * np.mean(v) for n, v in errors.items()}
    # session 6 (the s5/s6 small-model rows and the frozen / ZeRO-1 bases traced: 891 entries): pythia-410m 1.6,
    # qwen2.5-1.5b 1.1 (was 0.3), llama-3.2-3b 7.9 (was 12.8 after the session-5 terms joined, 10.5 before)
    # session 7 (eager-score, tensor-parallel, MoE and LoRA scales; 300 rounds at 0.05, 5 entries per leaf): 1.8 % overall,
    # pythia-410m 1.7, qwen2.5-1.5b 0.2, llama-3.2-3b 7.7; with the 52 session-7 small-model entries (943):
    # pythia-410m 1.2, qwen2.5-1.5b 0.3, llama-3.2-3b 9.8. llama-3.2-3b has moved between 7.7 and 12.8 % with every
    # set of new entries (its 13 amp_fp16 rows, about 11 % low): its bound is the worst seen, the others' are tight
    assert per_architecture["pythia-410m"] < 3.0 and per_architecture["qwen2.5-1.5b"] < 1.5, per_architecture
    assert per_architecture["llama-3.2-3b"] < 13.0, per_architecture


def test_artifacts_round_trip(tmp_path, entries):
    """LightGBM text boosters + JSON metadata (no pickle); the loaded model predicts the same coefficients."""
    m = CoefficientModel(n_estimators=30).fit(
        [e for e in entries if e["model_name"] in ("gpt2", "opt-125m", "pythia-160m", "llama-3.2-1b")]
    )
    path = m.save(tmp_path)
    meta = json.loads(path.read_text())
    assert meta["format"] == FORMAT and len(meta["targets"]) == len(TARGETS)
    assert {p.suffix for p in tmp_path.iterdir()} == {".json", ".txt"}
    # one booster per objective and learned target: the first objective's under the name a one-objective model used
    assert meta["params"]["objectives"] == ["l1", "huber"]
    assert {p.name for p in tmp_path.glob("coef_*.txt")} == {
        f"coef_{j}{s}.txt" for j in meta["boosters"] for s in ("", "_huber")
    }
    loaded = CoefficientModel.load(tmp_path)
    assert m.shared_ and loaded.shared_ == m.shared_  # the four share amp_bf16 / foreach AdamW, unsharded
    spec = catalog.spec("qwen2.5-0.5b")
    hf = catalog.get("qwen2.5-0.5b")["hf_config"]
    training = TrainingConfig(micro_batch_size=2, seq_len=2048, precision="amp_bf16", optimizer="adamw_fused")
    np.testing.assert_array_equal(m.predict_pieces(spec, training, hf), loaded.predict_pieces(spec, training, hf))
    meta["targets"] = meta["targets"][:-1]
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="other features or targets"):
        CoefficientModel.load(tmp_path)
    # boosters fitted on format 1's scales (eager scores per head x activation bytes) would predict other bytes
    path.write_text(json.dumps({**meta, "format": "memfit-coefficients-1"}))
    with pytest.raises(ValueError, match="format 'memfit-coefficients-1'"):
        CoefficientModel.load(tmp_path)


def test_one_objective_artifacts_still_load(tmp_path, entries):
    # written before session 11 ("objective": "l1", one coef_<j>.txt per target): loaded as a one-objective model that
    # predicts what it predicted
    m = CoefficientModel(n_estimators=20, objectives=("l1",)).fit(
        [e for e in entries if e["model_name"] in ("gpt2", "opt-125m", "llama-3.2-1b")]
    )
    path = m.save(tmp_path)
    meta = json.loads(path.read_text())
    meta["params"]["objective"] = meta["params"].pop("objectives")[0]
    path.write_text(json.dumps(meta))
    loaded = CoefficientModel.load(tmp_path)
    assert loaded.objectives == ("l1",) and all(len(b) == 1 for b in loaded.boosters_.values())
    spec, hf = catalog.spec("qwen2.5-0.5b"), catalog.get("qwen2.5-0.5b")["hf_config"]
    training = TrainingConfig(micro_batch_size=2, seq_len=2048, precision="bf16", optimizer="adamw_foreach")
    np.testing.assert_array_equal(m.predict_pieces(spec, training, hf), loaded.predict_pieces(spec, training, hf))
    with pytest.raises(ValueError, match="objectives must name"):
        CoefficientModel(objectives=())


def _monotone(values, increasing: bool) -> bool:
    d = np.diff(np.asarray(values, dtype=np.float64))
    return bool((d >= 0).all() if increasing else (d <= 0).all())


def test_learned_curve_invariants(held_out_model):
    """On the learned path: monotone in k, micro-batch and seq_len, never below the state floor, breakdown
    adding up, a peak phase per k, the provisional-coefficients margin group; 200 random configurations."""
    margins = {PROVISIONAL_COEFFICIENTS: 0.11, PROVISIONAL: 0.5}
    predictor = MemoryPredictor(None, TermsCache(shipped_dir=None), margins, coefficients=held_out_model)
    rng = random.Random(8)
    names = ["pythia-410m", "qwen2.5-1.5b", "llama-3.2-3b", "gpt2-xl", "opt-1.3b", "mistral-7b-v0.1", "phi-4"]
    checked = 0
    for _ in range(200):
        name = rng.choice(names)
        spec: ModelSpec = catalog.spec(name)
        hf = catalog.get(name)["hf_config"]
        base = {
            "precision": rng.choice(["amp_bf16", "bf16", "fp32", "bf16_fp32_master", "amp_fp16"]),
            "optimizer": rng.choice(["adamw_fused", "adamw_foreach", "sgd_momentum", "adafactor"]),
            "attention": rng.choice(["sdpa", "eager"]),
        }
        b, s = rng.choice([1, 2, 4]), rng.choice([512, 1024, 2048])
        curves = [
            predictor.curve(spec, TrainingConfig(micro_batch_size=mb, seq_len=sl, **base), hf)
            for mb, sl in ((b, s), (2 * b, s), (b, 2 * s))
        ]
        c = curves[0]
        if not held_out_model.covers(spec, TrainingConfig(micro_batch_size=b, seq_len=s, **base), hf):
            continue
        checked += 1
        assert c.learned_coefficients and margin_group(c.path, "none", True) == PROVISIONAL_COEFFICIENTS
        assert all(p.upper_bytes == math.ceil(p.predicted_bytes * 1.11) for p in c.points)
        pts = [p.predicted_bytes for p in c.points]
        assert _monotone(pts, increasing=False)
        assert min(pts) >= c.floor_bytes
        for other in curves[1:]:
            assert all(o.predicted_bytes >= p.predicted_bytes for o, p in zip(other.points, c.points))
        for p in c.points:
            assert sum(p.breakdown.values()) == p.predicted_bytes
            assert p.peak_phase is not None
    assert checked >= 150


def test_uncovered_settings_fall_back_to_the_ratio_model(held_out_model):
    """Frozen fine-tuning is not composable itself (layers differ): the coefficient model does not answer it. Where
    model.frozen applies, it is composed from the coefficients of its full fine-tune base; where not (GPT-2: the
    learned position table stays trainable), only the ratio model answers."""
    predictor = MemoryPredictor(None, TermsCache(shipped_dir=None), coefficients=held_out_model)
    spec = catalog.spec("llama-3.2-1b")
    hf = catalog.get("llama-3.2-1b")["hf_config"]
    frozen = TrainingConfig(micro_batch_size=1, seq_len=1024, finetune="frozen", frozen_layers=4)
    assert not held_out_model.covers(spec, frozen, hf)
    c = predictor.curve(spec.model_copy(update={"trainable_params": spec.total_params // 2}), frozen, hf)
    assert c.path == "provisional" and c.learned_coefficients and any("model.frozen" in n for n in c.notes)
    gpt2, gpt2_hf = catalog.spec("gpt2"), catalog.get("gpt2")["hf_config"]
    assert not held_out_model.covers(gpt2, frozen, gpt2_hf)
    with pytest.raises(ValueError, match="no provisional model loaded"):
        predictor.curve(gpt2, frozen, gpt2_hf)


def test_scales_make_targets_order_one_across_precision_and_sharding(scaled_targets):
    """The fault behind the fp32 and sharded losses (issue 8): the head's per-token bytes over the analytic
    logits bytes were 0.67 in fp32 (no fp32 copy of fp32 logits) and 1.01 otherwise, and the embeddings'
    constants over their sharded model states reached 70 on 64 ranks (the gathered weights and full gradients
    are not sharded). With :func:`model.coefficients.head_token_bytes` and the gathered scale, both targets sit
    near 1 in every precision and sharding, so the trees need not learn the scale from a handful of entries."""
    head = TARGETS.index(("fwd.head", "f0", "b*s"))
    emb = TARGETS.index(("bwd.emb", "f0", "1"))
    by_precision: dict[str, list[float]] = {}
    sharded_emb = []
    for spec, training, y in scaled_targets:
        if (
            training.sharding.value == "none"
            and training.finetune.value == "full"
            and training.tensor_parallel_size == 1
            and spec.num_experts is None
        ):
            by_precision.setdefault(training.precision.value, []).append(y[head])
        if training.sharding.value != "none":
            sharded_emb.append(y[emb])
    medians = {p: float(np.median(v)) for p, v in by_precision.items()}
    assert set(medians) >= {"fp32", "amp_bf16", "bf16"}, medians
    assert all(0.9 < m < 1.1 for m in medians.values()), medians
    assert len(sharded_emb) > 20 and float(np.max(sharded_emb)) < 3.0, (len(sharded_emb), max(sharded_emb))


def test_eager_score_and_moe_scales_make_targets_order_one(scaled_targets):
    """Session 7: an un-checkpointed layer's eager score bytes per (token x sequence) over heads x activation bytes
    were 3.0 with 16-bit activations and 1.0 in fp32 (HF eager attention saves its fp32 softmax and, only when
    activations are 16-bit, the cast back), the fp32 leave-architecture-out losses (fp32/adamw_fused 10.8 %); over
    the fp32 softmax plus the saved cast both are 1.0. MoE layers' per-token bytes over a dense layer's
    activations were 3-9.6 (olmoe, qwen3-moe: 8 of 64-128 experts per token); counting the routed experts'
    MLPs, the dispatched hidden states and the router logits they are 1.0-2.7."""
    score = TARGETS.index(("fwd.head", "dF", "b*s^2"))
    token = TARGETS.index(("fwd.head", "dF", "b*s"))
    by_bytes: dict[int, list[float]] = {}
    moe = []
    for spec, training, y in scaled_targets:
        if spec.num_experts:
            moe.append(y[token])
        # GPT-2, GPT-Neo, OPT and BLOOM compute their eager scores their own way (dropout, fp32 scores)
        if (
            training.attention.value == "eager"
            and training.tensor_parallel_size == 1
            and spec.architecture not in ("gpt2", "gpt_neo", "opt", "bloom")
        ):
            by_bytes.setdefault(4 if training.precision.value == "fp32" else 2, []).append(y[score])
    medians = {a: float(np.median(v)) for a, v in by_bytes.items()}
    assert set(medians) == {2, 4} and all(0.95 < m < 1.05 for m in medians.values()), medians
    assert len(moe) >= 12 and 0.9 < min(moe) and max(moe) < 3.0, sorted(moe)


def test_state_constants_shared_by_a_setting_are_used_exactly(entries, held_out_model):
    """The state-only phases' constants (at rest, the optimizer step) are counts: where three or more traced
    architectures of a training setting share one value, a held-out architecture gets exactly that value, not the
    trees' average (which put Llama-2-70B's amp_fp16 step 0.23 % low, session 14)."""
    from model.coefficients import (
        SHARED_RELATIVE_TOLERANCE,
        STATE_CONSTANTS,
        scales,
        setting_key,
        shared_state_constants,
    )

    Y = np.ones((6, len(TARGETS)))
    S = np.full_like(Y, 1e9)
    T = np.full(6, 9.0)
    names = ["a", "b", "c", "d", "e", "f"]
    j = STATE_CONSTANTS[0]
    Y[:, j] = [1.25, 1.25, 1.25, 1.25, 1.25, 1.3]
    shared = shared_state_constants(names, ["s"] * 6, Y, S, T)
    assert j not in shared["s"] and len(shared["s"]) == len(STATE_CONSTANTS) - 1  # five of six agree: 83 % < 90 %
    Y[5, j] = 1.25
    assert shared_state_constants(names, ["s"] * 6, Y, S, T)["s"][j] == (1.25, 0.0)
    assert shared_state_constants(["a", "a", "b", "b", "b", "b"], ["s"] * 6, Y, S, T) == {}  # two architectures
    # a count plus bytes that do not grow with the parameters: once for a base (2 KiB of gradient-scaler tensors), per
    # parameter tensor for a layer (a 512-byte step tensor each: 9 for Llama, 16 for OPT); the median would charge a
    # large model the small models' bytes in proportion to its states
    layer = next(k for k in STATE_CONSTANTS if TARGETS[k][1] == "dF")
    S[:, j] = S[:, layer] = [1e8, 2e8, 5e8, 1e9, 4e9, 2e10]
    T[:] = [16, 12, 9, 9, 16, 9]
    Y[:, j] = 1.25 + 2048 / S[:, j]
    Y[:, layer] = 1.25 + 512 * T / S[:, layer]
    shared = shared_state_constants(names, ["s"] * 6, Y, S, T)["s"]
    assert shared[j] == pytest.approx((1.25, 2048), rel=1e-9) and shared[layer] == pytest.approx((1.25, 512), rel=1e-9)
    errors = []
    for name in HELD_OUT:
        for e in entries:
            if e["model_name"] != name or e["training"].get("gradient_accumulation"):
                continue
            job = entry_configuration(e)
            spec, training, hf = job.spec, job.training, job.hf_config
            y = fitted_pieces(e["terms"]) / scales(spec, training, hf)
            p = held_out_model.predict_pieces(spec, training, hf) / scales(spec, training, hf)
            for k in held_out_model.shared_.get(setting_key(training), {}):
                errors.append(abs(p[k] / y[k] - 1))
                # a shared value lies within the tolerance of most of its entries (Adafactor's factored states
                # differ by architecture in the fourth digit)
                assert errors[-1] <= 2 * SHARED_RELATIVE_TOLERANCE, (name, e["training"], TARGETS[k], p[k], y[k])
    assert len(errors) >= 40 and float(np.median(errors)) < 1e-5, (len(errors), np.median(errors))


def test_expert_parallel_constants_are_scaled_by_the_rank_experts(entries, scaled_targets):
    """Session 13's worst learned-path rows: the MoE models with four expert-parallel ranks, held out, were predicted
    113-202 % high, because their constants' scales counted every expert while a rank builds E / 4 of them (their
    dimensionless constants were near 0.4 where every other entry's are near 1, so the trees could not learn them
    from three entries). Scaled by the rank's own experts (model.job.rank_hf_config), the at-rest and
    optimizer-step constants of the expert-parallel entries equal those of the same model without it."""
    from model.coefficients import small_model_states
    from model.job import rank_hf_config

    keys = [TARGETS.index((p, q, "1")) for p in ("rest", "opt") for q in ("f0", "dF")]
    by_model: dict[str, dict[int, np.ndarray]] = {}
    for e, (spec, training, y) in zip(entries, scaled_targets):
        if (
            spec.num_experts
            and training.precision.value == "bf16"
            and training.sharding.value == "none"
            and training.finetune.value == "full"
        ):
            by_model.setdefault(e["model_name"], {})[training.expert_parallel_size] = y[keys]
    paired = {name: v for name, v in by_model.items() if 4 in v and 1 in v}
    assert len(paired) == 4, sorted(by_model)
    for name, v in paired.items():
        assert np.allclose(v[4], v[1], rtol=0.01), (name, v)
        assert np.all((v[1] > 0.7) & (v[1] < 1.3)), (name, v[1])  # at rest no gradients: 12 of 16 bytes
    job = entry_configuration(_entry(entries, "mixtral-reduced", expert_parallel_size=4))
    spec, training, hf = job.spec, job.training, job.hf_config
    local = rank_hf_config(hf, training)
    assert local["num_local_experts"] * 4 == hf["num_local_experts"]
    _one, layer = small_model_states(spec, training, hf)
    _whole_one, whole_layer = small_model_states(spec, training.model_copy(update={"expert_parallel_size": 1}), hf)
    assert 2.5 < whole_layer / layer < 4.0  # mostly experts: a quarter of them per rank
    # experts that do not split over the ranks: the formula split of expert_parallel_rank_spec, not every expert
    assert rank_hf_config(hf, training.model_copy(update={"expert_parallel_size": 3})) is None


@pytest.mark.parametrize("name", ["opt-125m", "opt-350m", "gpt-neo-125m", "llama-3.2-1b", "qwen2.5-0.5b"])
def test_parameter_split_counts_what_the_model_code_builds(name):
    """The constants' scales split the parameters as the model's code does (model.job.parameter_split):
    outside the decoder layers plus num_layers times one layer is the published count (OPT-125m's published count is
    1,536 lower: a final norm). The vocab x hidden formula
    missed OPT's and GPT-Neo's learned position tables (1.6 M) and OPT-350m's 512-wide embeddings with their
    input and output projections (a base 78 % too large)."""
    from model.job import parameter_split

    entry = catalog.get(name)
    spec = catalog.spec(name)
    base, layer, tensors = parameter_split(entry["hf_config"])
    # parameter tensors of a layer: 2 norms + q, k, v, o + 3 gated-MLP linears (Llama); biases and 2 MLP linears (OPT)
    assert tensors == {"llama-3.2-1b": 9, "opt-125m": 16}.get(name, tensors)
    assert spec.total_params == int(entry["published_params"])
    assert abs(base + spec.num_layers * layer - spec.total_params) <= (1536 if name == "opt-125m" else 0)
    formula = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    if name == "opt-350m":
        assert formula / base > 1.7
    elif name in ("opt-125m", "gpt-neo-125m"):
        assert base - formula == (2048 + (2 if name == "opt-125m" else 0)) * 768 + 2 * 768  # positions, final norm
    assert parameter_split(None) is None


def test_parameter_split_snapshot_covers_the_catalog_and_matches_meta_builds():
    """The shipped snapshot (scripts/parameter_splits.py) answers every catalog architecture without building it;
    sampled entries equal the meta builds under the installed transformers (run the script when this fails)."""
    import json

    from model.job import _parameter_split, parameter_split
    from model.snapshot import config_key, parameter_snapshot

    snapshot = parameter_snapshot("splits")
    names = catalog.names()
    assert all(config_key(catalog.get(n)["hf_config"]) in snapshot for n in names)
    from data.reduced_moe import REDUCED_MOE
    from memfit.hf import local_expert_config

    assert all(config_key(local_expert_config(cfg, 4)) in snapshot for cfg in REDUCED_MOE.values())
    misses = _parameter_split.cache_info().misses
    parameter_split(catalog.get("mistral-7b-v0.1")["hf_config"])
    assert _parameter_split.cache_info().misses == misses  # read, not built
    for name in random.Random(0).sample(names, 4) + ["opt-350m"]:
        cfg = catalog.get(name)["hf_config"]
        built = _parameter_split(json.dumps(cfg, sort_keys=True))
        assert list(built) == snapshot[config_key(cfg)], name
    # and the parameter tensors in allocation order (model.recommend.parameter_block_bytes), the same way
    from model.job import _parameter_tensors, parameter_tensors

    tensors = parameter_snapshot("tensors")
    assert all(config_key(catalog.get(n)["hf_config"]) in tensors for n in names)
    for name in random.Random(1).sample(names, 3) + ["gpt2-large"]:
        cfg = catalog.get(name)["hf_config"]
        built = _parameter_tensors(json.dumps(cfg, sort_keys=True))
        assert parameter_tensors(cfg) == built, name
        # the split counts the same parameters: outside = before + after, one layer = the layer's tensors
        split = snapshot[config_key(cfg)]
        assert (sum(built.before) + sum(built.after), sum(built.layer), len(built.layer)) == tuple(split), name
    # and the parameter counts of resolved architectures: every catalog one read, sampled ones equal to a meta build
    from memfit.hf import count_params_from_config
    from model.job import _counted_spec, resolve_architecture

    counts = parameter_snapshot("params")
    assert all(config_key(catalog.get(n)["hf_config"]) in counts for n in names)
    for name in random.Random(2).sample(names, 3) + ["opt-350m", "gemma-3-1b"]:
        cfg = catalog.get(name)["hf_config"]
        assert counts[config_key(cfg)] == count_params_from_config(cfg), name
    _counted_spec.cache_clear()
    import memfit.hf

    def no_build(cfg):
        raise AssertionError("a catalog architecture was built to count its parameters")

    original, memfit.hf.count_params_from_config = memfit.hf.count_params_from_config, no_build
    try:
        spec = resolve_architecture(catalog.get("llama-3-8b")["hf_config"]).spec
    finally:
        memfit.hf.count_params_from_config = original
    assert spec.total_params == spec.trainable_params == counts[config_key(catalog.get("llama-3-8b")["hf_config"])]
    # and DeepSpeed stage 3's persistent parameter elements: every catalog one read, sampled ones equal to a meta build
    from model.deepspeed_zero import _persistent_elements, persistent_parameter_elements

    persistent = parameter_snapshot("persistent")
    assert all(config_key(catalog.get(n)["hf_config"]) in persistent for n in names)
    for name in random.Random(3).sample(names, 2) + ["llama-3-8b", "mixtral-8x7b"]:
        cfg = catalog.get(name)["hf_config"]
        assert persistent[config_key(cfg)] == _persistent_elements(json.dumps(cfg, sort_keys=True)) > 0, name
    misses = _persistent_elements.cache_info().misses
    persistent_parameter_elements(catalog.get("mistral-7b-v0.1")["hf_config"], catalog.spec("mistral-7b-v0.1"))
    assert _persistent_elements.cache_info().misses == misses  # read, not built


def test_cuda_generation_terms_are_not_learned_as_cpu_terms(entries):
    """The sm90 lines share their CPU twins' training fields (model.terms.key_training_fields drops the generation):
    fitted as CPU terms they gave one configuration two targets. They are left out, and say so."""
    names = ("gpt2", "opt-125m", "llama-3.2-1b")
    chosen = [e for e in entries if e["model_name"] in names]
    cuda = [e for e in chosen if e["training"].get("cuda_generation")]
    assert cuda, "the shipped sm90 terms hold gpt2 lines"
    m = CoefficientModel(n_estimators=20, objectives=("l1",)).fit(chosen)
    cpu_only = CoefficientModel(n_estimators=20, objectives=("l1",)).fit([e for e in chosen if e not in cuda])
    assert m.n_entries_ == cpu_only.n_entries_ and len(m.skipped_) == len(cpu_only.skipped_) + len(cuda)
    assert sum("sm90 CUDA terms" in s for s in m.skipped_) == len(cuda)
    spec, hf = catalog.spec("qwen2.5-0.5b"), catalog.get("qwen2.5-0.5b")["hf_config"]
    training = TrainingConfig(micro_batch_size=2, seq_len=2048, precision="amp_bf16", optimizer="adamw_foreach")
    np.testing.assert_array_equal(m.predict_pieces(spec, training, hf), cpu_only.predict_pieces(spec, training, hf))


def test_booster_values_are_kept_per_feature_row(entries):
    """The features hold no micro-batch size or sequence length: a second configuration that differs only there
    calls no booster, and answers what a model without the kept values answers."""
    chosen = [e for e in entries if e["model_name"] in ("gpt2", "opt-125m", "llama-3.2-1b")]
    m = CoefficientModel(n_estimators=20, objectives=("l1",)).fit(chosen)
    spec, hf = catalog.spec("qwen2.5-0.5b"), catalog.get("qwen2.5-0.5b")["hf_config"]
    short = TrainingConfig(micro_batch_size=2, seq_len=2048, precision="amp_bf16", optimizer="adamw_foreach")
    long = short.model_copy(update={"micro_batch_size": 4, "seq_len": 8192})
    first = m.predict_pieces(spec, short, hf)
    calls = []
    for boosters in m.boosters_.values():
        for b in boosters:
            original = b.predict
            b.predict = lambda *a, _o=original, **k: calls.append(1) or _o(*a, **k)
    again, other = m.predict_pieces(spec, short, hf), m.predict_pieces(spec, long, hf)
    assert not calls
    np.testing.assert_array_equal(first, again)
    m._prediction_cache.clear()
    np.testing.assert_array_equal(other, m.predict_pieces(spec, long, hf))
    assert len(calls) == sum(len(b) for b in m.boosters_.values())  # one row: one call per booster
    # a setting the features hold (the optimizer) is another row
    m.predict_pieces(spec, TrainingConfig(**{**short.model_dump(), "optimizer": "adamw_fused"}), hf)
    assert len(calls) == 2 * sum(len(b) for b in m.boosters_.values())


@pytest.mark.parametrize(
    "parallel",
    [{"pipeline_parallel_size": 2, "num_micro_batches": 4}, {"context_parallel_size": 2}],
    ids=["pipeline", "context"],
)
def test_pipeline_and_context_parallel_requests_are_composed_per_stage_from_learned_coefficients(
    entries, held_out_model, parallel
):
    """An untraced pipeline- or context-parallel request (the service's first answer while it traces) went to the
    ratio model, which holds no parallel layout: a rank with every layer, Llama-3-8B on 4 stages "does not fit"
    until the trace came. The learned coefficients of the one-stage configuration are composed per stage as traced
    terms are; on a held-out architecture the curve is checked against the shipped terms' composition
    (within 2.4 % at every k here)."""
    entry = _entry(entries, "llama-3.2-3b", precision="amp_bf16", sharding="none")
    job = entry_configuration(entry)
    training = job.training.model_copy(update={"micro_batch_size": 2, "seq_len": 8192, **parallel})
    learned = MemoryPredictor(None, TermsCache(shipped_dir=None), coefficients=held_out_model).curve(
        job.spec, training, job.hf_config
    )
    traced = MemoryPredictor(None, TermsCache()).curve(job.spec, training, job.hf_config)
    assert traced.path == "traced" and learned.path == PROVISIONAL and learned.learned_coefficients
    assert learned.pipeline is not None and len(learned.pipeline.stages) == training.pipeline_parallel_size
    composed = [n for n in learned.notes if n.startswith(("pipeline parallelism", "context parallelism"))]
    assert len(composed) == 1 and "provisional answer is for" not in composed[0]  # it is per stage
    errors = [lp.predicted_bytes / tp.predicted_bytes - 1 for lp, tp in zip(learned.points, traced.points)]
    assert max(abs(e) for e in errors) < 0.05, errors
    for p in learned.points:
        assert sum(p.breakdown.values()) == p.predicted_bytes


def test_context_parallel_ranks_stay_in_the_sharding_group_of_the_learned_coefficients(entries, held_out_model):
    """The one-stage configuration the learned coefficients answer kept ``data_parallel_size`` and dropped the
    context-parallel ranks, so ZeRO-3 over 1 data x 8 context ranks was predicted unsharded: Llama-3-8B, mb4
    s8192 on 8 GPUs said 222.7 GiB at every k, traced 44.1 down to 20.6. Held out here: Pythia-410M, ZeRO-3 over
    8 ranks as 1 x 8 and 4 x 2, against the shipped terms' composition."""
    job = entry_configuration(_entry(entries, "pythia-410m", sharding="zero3", data_parallel_size=8))
    for cp in (8, 2):
        training = job.training.model_copy(
            update={"micro_batch_size": 2, "seq_len": 8192, "context_parallel_size": cp, "data_parallel_size": 8 // cp}
        )
        learned = MemoryPredictor(None, TermsCache(shipped_dir=None), coefficients=held_out_model).curve(
            job.spec, training, job.hf_config
        )
        traced = MemoryPredictor(None, TermsCache()).curve(job.spec, training, job.hf_config)
        assert traced.path == "traced" and learned.path == PROVISIONAL and learned.learned_coefficients
        errors = [lp.predicted_bytes / tp.predicted_bytes - 1 for lp, tp in zip(learned.points, traced.points)]
        assert max(abs(e) for e in errors) < 0.05, (cp, errors)


def test_a_family_without_sdpa_keeps_its_eager_score_term_when_sdpa_is_asked(entries, held_out_model):
    """BLOOM has no SDPA in transformers: asked for SDPA (the default) it runs eager attention and keeps its
    (b, heads, s, s) scores, as its traced terms do. The learned coefficients dropped the score term whenever eager
    was not asked: BLOOM-7B1, mb2 s4096, said 149.4 GiB at k = 0 where the trace composes 329.2 (-55 %); now the
    same answer as asking for eager."""
    from memfit.schema import Attention

    job = entry_configuration(_entry(entries, "bloom-7b1", attention="sdpa", sharding="none", finetune="full"))
    asked = job.training.model_copy(update={"micro_batch_size": 2, "seq_len": 4096})
    assert asked.attention is Attention.SDPA
    learned = MemoryPredictor(None, TermsCache(shipped_dir=None), coefficients=held_out_model)
    sdpa = learned.curve(job.spec, asked, job.hf_config)
    eager = learned.curve(job.spec, asked.model_copy(update={"attention": Attention.EAGER}), job.hf_config)
    traced = MemoryPredictor(None, TermsCache()).curve(job.spec, asked, job.hf_config)
    assert traced.path == "traced" and sdpa.path == PROVISIONAL and sdpa.learned_coefficients
    assert abs(sdpa.points[0].predicted_bytes / traced.points[0].predicted_bytes - 1) < 0.05
    assert sdpa.points[0].predicted_bytes > 0.9 * eager.points[0].predicted_bytes
