"""The traced path: phase timelines of 1- and 2-layer models, composed to L layers, against full measurement.

Small widths keep every tensor a multiple of the 512-byte block (hidden 512, vocabulary 4096), so the
polynomial fit over (b, s) is exact; the composed peak is compared with the collector measuring the
whole L-layer model at micro-batch and sequence lengths that were *not* traced (a third token count).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from data import catalog
from memfit.hf import small_config
from memfit.schema import TrainingConfig
from model.compose import PEAK_PHASES, compose, compose_terms
from tracer.collect import measure_family
from tracer.phases import (
    PHASES,
    envelope_pieces,
    linear_token_points,
    micro_batch_one_on_fit,
    timeline_on_fit,
    token_points,
    trace_terms,
)

L = 6


def small_width(name: str, **over) -> dict:
    cfg = dict(catalog.get(name)["hf_config"])
    if cfg["model_type"] == "gpt2":
        cfg.update(n_layer=L, n_embd=512, n_head=8, vocab_size=4096, n_positions=1024, n_ctx=1024)
    else:
        cfg.update(
            num_hidden_layers=L,
            hidden_size=512,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=4096,
        )
        if "layer_types" in cfg:
            cfg.pop("layer_types")
    cfg.update(over)
    return cfg


CASES = [
    ("llama-3-8b", {"precision": "bf16", "optimizer": "adamw_foreach"}),
    ("gpt2", {"precision": "amp_bf16", "optimizer": "adamw_fused"}),
    ("gemma-2-2b", {"precision": "amp_bf16", "optimizer": "adamw_foreach"}),  # eager, sliding window, soft-cap
    ("qwen2.5-0.5b", {"precision": "bf16_fp32_master", "optimizer": "adamw_foreach"}),
    ("llama-3-8b", {"precision": "amp_bf16", "optimizer": "adamw_foreach", "finetune": "lora", "lora_rank": 8}),
    (
        "llama-3-8b",
        {"precision": "bf16", "optimizer": "adamw_fused", "sharding": "fsdp_full_shard", "data_parallel_size": 4},
    ),
]


@pytest.mark.parametrize("name,fields", CASES, ids=[f"{n}-{'-'.join(map(str, f.values()))}" for n, f in CASES])
def test_composed_peak_equals_full_measurement(name, fields):
    cfg = small_width(name)
    training = TrainingConfig(micro_batch_size=1, seq_len=128, **fields)
    terms = trace_terms(cfg, training)
    assert set(terms.coef) == {(1, 0), (2, 0), (1, 1), (2, 2)}
    assert all(set(p) == set(PHASES) for p in terms.coef.values())
    traced = set(terms.points)
    # SDPA steps hold nothing quadratic in s (no explicit mask below a sliding window): three token points
    # fix (1, b·s, s); eager attention keeps (b, heads, s, s) scores and takes all five
    assert len(traced) == (5 if terms.attention == "eager" else 3)
    for b, s in [(3, 768), (1, 1000)]:
        assert (b, s) not in traced
        t = training.model_copy(update={"micro_batch_size": b, "seq_len": s})
        ks = [0, 1, L // 2, L]
        measured = [
            r.measurement.peak_allocated_bytes
            for r in measure_family(cfg, t, [list(range(k)) for k in ks], prime=True, steps=1)
        ]
        curve = compose_terms(terms.to_json(), L, b, s)
        for k, m in zip(ks, measured):
            got = int(curve.peak_bytes[k])
            if terms.period == 1:  # layers alike: exact up to 512-byte rounding of tensors not traced
                assert abs(got - m) / m < 2e-3, f"k={k} b={b} s={s}: composed {got} vs measured {m}"
            else:  # a sliding/full pattern, k cutting through it: the average layer is charged (rounding aside)
                assert -1e-4 <= (got - m) / m < 1e-2, f"k={k} b={b} s={s}: composed {got} vs measured {m}"
            assert curve.phase[k] in PEAK_PHASES


def test_fsdp_lora_micro_batch_one_composes_from_its_own_traces():
    """FSDP full shard over 2 ranks + LoRA r16, fp32, eager (a pythia-shaped model): at micro-batch 1 each
    un-checkpointed layer holds 2 hidden vectors per token more than the b >= 2 fit says (a reshape that is a
    view at b = 1), so composing b = 1 from the b >= 2 coefficients was 4.8 % low at k = 0 (3.3 % on the real
    pythia-160m). Traced at b = 1 on its own, k = 0 and k = L are exact against the 6-layer model.

    Known miss: with 0 < k < L at b = 1 a constant boundary term (~10 MB here, the layer above the
    checkpointed block keeping its input's buffer) is not in the all-or-nothing small models: 2.6-3.5 % low."""
    cfg = small_width("pythia-160m")
    training = TrainingConfig(
        micro_batch_size=1,
        seq_len=128,
        precision="fp32",
        optimizer="adamw_foreach",
        sharding="fsdp_full_shard",
        data_parallel_size=2,
        attention="eager",
        finetune="lora",
        lora_rank=16,
    )
    terms = trace_terms(cfg, training)
    assert terms.depths == (3, 4) and terms.mb1_coef is not None
    t = training.model_copy(update={"micro_batch_size": 1, "seq_len": 1000})
    ks = [0, 1, L // 2, L]
    measured = [
        r.measurement.peak_allocated_bytes
        for r in measure_family(cfg, t, [list(range(k)) for k in ks], prime=True, steps=1)
    ]
    fitted = compose(terms.coef, L, 1, 1000, terms.depths, monotone=False).peak_bytes  # b = 1 from the b >= 2 fit
    own = compose_terms(terms.to_json(), L, 1, 1000).peak_bytes
    assert (fitted[0] - measured[0]) / measured[0] < -0.03
    for k, m in zip(ks, measured):
        err = (int(own[k]) - m) / m
        if k in (0, L):
            assert abs(err) < 5e-3, f"k={k}: composed {own[k]} vs measured {m}"
        else:
            assert -0.04 < err <= 0, f"k={k}: composed {own[k]} vs measured {m}"


def test_sliding_window_regimes_compose_on_both_sides():
    # Mistral: from seq_len = sliding_window on, transformers builds a (b, 1, s, s) mask for SDPA; below it none.
    # The two regimes are traced apart and the curve picks by sequence length.
    from model.curve import MemoryPredictor
    from model.terms import TermsCache, terms_key

    cfg = small_width("mistral-7b-v0.1", sliding_window=1024)
    training = TrainingConfig(micro_batch_size=1, seq_len=128, precision="bf16")
    terms = trace_terms(cfg, training)
    assert terms.long_min_seq_len == 1024 and max(s for _, s in terms.points) < 1024
    cache = TermsCache(shipped_dir=None)
    cache.put(terms_key(cfg, training), terms.to_json())
    spec = catalog.spec(cfg)
    for b, s in [(2, 1000), (1, 1024), (1, 3000)]:
        t = training.model_copy(update={"micro_batch_size": b, "seq_len": s})
        measured = [
            r.measurement.peak_allocated_bytes
            for r in measure_family(cfg, t, [[], list(range(L))], prime=True, steps=1)
        ]
        c = MemoryPredictor(None, cache).curve(spec, t, cfg)
        for k, m in zip((0, L), measured):
            assert abs(c.points[k].predicted_bytes - m) / m < 2e-3, (b, s, k)


def test_micro_batch_one_on_the_fit_drops_only_missing_allocations():
    # two b >= 2 timelines on (1, b·s): one event a b = 1 trace does not make (a view there) is dropped; a b = 1 event
    # with other bytes, or one the fit does not have, sends b = 1 to its own traces
    points = [(2, 100), (4, 100)]
    per_token = [1000, 3000, 2000]  # live bytes per b·s token after each event
    timelines = [[("fwd.layers", 50 + v * b * s) for v in per_token] for b, s in points]
    at_one = [("fwd.layers", 50 + v * 300) for v in per_token]
    folded = micro_batch_one_on_fit(timelines, points, [0, 1], [at_one[0], at_one[2]], (1, 300))
    assert folded is not None and folded.shape == (5, 2)
    assert folded[0].tolist() == pytest.approx([50, 50]) and folded[2].tolist() == pytest.approx([1000, 2000])
    assert not folded[1].any() and not folded[3].any()
    assert (
        micro_batch_one_on_fit(timelines, points, [0, 1], [at_one[0], ("fwd.layers", 50 + 2500 * 300)], (1, 300))
        is None
    )
    assert micro_batch_one_on_fit(timelines, points, [0, 1], [*at_one, ("fwd.layers", 1)], (1, 300)) is None
    assert micro_batch_one_on_fit(timelines, points, [0, 1], at_one, (2, 300)) is None  # not micro-batch 1


def test_micro_batch_one_from_the_fit_composes_as_its_own_traces(monkeypatch):
    # Mistral-shaped, sliding window: b = 1 traces at each regime's longest length are on the b >= 2 fits (its
    # logits reshape is a view at b = 1: one allocation fewer), so 6 of the 27 traces per small model are not
    # run, and the b = 1 curves are those of micro-batch 1 fitted on its own traces (to the byte)
    from tracer import phases

    cfg = small_width("mistral-7b-v0.1", sliding_window=1024)
    training = TrainingConfig(micro_batch_size=1, seq_len=128, precision="bf16")
    calls = []
    real = phases._traced_at
    monkeypatch.setattr(phases, "_traced_at", lambda *a, **k: calls.append(a[2:4]) or real(*a, **k))
    checked = trace_terms(cfg, training, parallel=False).to_json()
    n_checked = len(calls)
    monkeypatch.setattr(phases, "micro_batch_one_on_fit", lambda *a: None)
    own = trace_terms(cfg, training, parallel=False).to_json()
    assert len(calls) - n_checked == n_checked + 2 * 6  # per small model: 1 of 2 b = 1 traces per c below, 1 of 3 above
    for s in (64, 500, 1023, 1024, 1500, 2048):
        a, b = compose_terms(checked, L, 1, s), compose_terms(own, L, 1, s)
        assert a.peak_bytes.tolist() == b.peak_bytes.tolist() and a.phase == b.phase, s


def test_forked_trace_gives_the_same_terms(monkeypatch):
    # the larger small model traced in a forked process (two CPUs) gives the terms a trace in one process gives:
    # a sliding-window model, so both token regimes and both micro-batch-1 regimes travel back through the pipe
    from tracer import phases

    if not phases._fork_available():
        pytest.skip("needs Linux with two CPUs")
    monkeypatch.setattr(phases, "_can_fork", lambda: True)  # a CPU to spare or not (the suite keeps them busy)
    forks = []
    real_fork = phases._Forked
    monkeypatch.setattr(phases, "_Forked", lambda *a: forks.append(a[1:]) or real_fork(*a))
    cfg = small_width("mistral-7b-v0.1", sliding_window=1024)
    training = TrainingConfig(micro_batch_size=1, seq_len=128, precision="bf16")
    forked, alone = trace_terms(cfg, training).to_json(), trace_terms(cfg, training, parallel=False).to_json()
    assert forks == [(2, 3)]  # model 2 of depth 3 went to the child, once
    forked.pop("trace_s"), alone.pop("trace_s")
    assert forked == alone and forked["long"]["mb1_coef"] is not None


def test_the_larger_small_model_is_forked_only_with_a_cpu_to_spare(monkeypatch):
    import os

    from tracer import phases

    if not phases._fork_available():
        pytest.skip("needs Linux with two CPUs")
    cpus = phases._cpus()
    for load, forks in ((0.0, True), (1.0, True), (cpus - 0.1, True), (float(cpus), False), (2.0 * cpus, False)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert phases._can_fork() is forks, load


def test_composition_reads_phases_not_one_total():
    # A 4-layer curve whose small models peak in bwd.head but whose full model peaks in the optimizer
    # step at k = L: composing the total alone would miss the phase change.
    def piece(v):
        return [[float(v), 0.0, 0.0, 0.0, 0.0]]

    small = {
        (1, 0): {
            "rest": 10,
            "fwd.layers": 12,
            "fwd.head": 20,
            "bwd.head": 30,
            "bwd.layers": 18,
            "bwd.emb": 16,
            "opt": 22,
        },
        (2, 0): {
            "rest": 14,
            "fwd.layers": 18,
            "fwd.head": 26,
            "bwd.head": 36,
            "bwd.layers": 26,
            "bwd.emb": 22,
            "opt": 30,
        },
        (1, 1): {
            "rest": 10,
            "fwd.layers": 12,
            "fwd.head": 18,
            "bwd.head": 28,
            "bwd.layers": 20,
            "bwd.emb": 16,
            "opt": 22,
        },
        (2, 2): {
            "rest": 14,
            "fwd.layers": 16,
            "fwd.head": 22,
            "bwd.head": 32,
            "bwd.layers": 25,
            "bwd.emb": 22,
            "opt": 30,
        },
    }
    coef = {nc: {p: piece(v) for p, v in phases.items()} for nc, phases in small.items()}
    c = compose(coef, 10, 1, 1)
    # k = 0: bwd.head 30 + 9*6 = 84 vs opt 22 + 9*8 = 94 -> opt
    assert int(c.peak_bytes[0]) == 94 and c.phase[0] == "opt"
    # k = L: bwd.head 28 + 9*4 = 64, opt 94 -> opt
    assert int(c.peak_bytes[10]) == 94
    # k = 5, bwd.layers split: part 1 = 18 + 4*8 + 5*4 = 70, part 2 = 20 + 4*5 + 5*6 = 70
    assert c.phase_bytes[5, PEAK_PHASES.index("bwd.layers")] == 70


def test_misaligned_timelines_are_refused():
    with pytest.raises(RuntimeError, match="differ"):
        envelope_pieces([[("rest", 1)], [("rest", 1), ("opt", 2)]], [(2, 4), (2, 8)], grid=None)


def test_linear_check_passes_only_steps_without_s2_terms():
    points = token_points({"model_type": "llama"})
    three, check, rest = linear_token_points(points)
    assert sorted([*three, check, rest]) == sorted(points) and {b for b, _ in three} == {2, 4}

    def timeline(b, s, mask=0, batch_mask=0):  # live bytes after three events: weights, activations, a mask
        return [
            ("rest", 1 << 30),
            ("fwd.layers", (1 << 30) + 4096 * b * s + 512 * s),
            ("bwd.head", 2048 * b * s + mask * s * s + batch_mask * b * s * s),
        ]

    assert timeline_on_fit([timeline(b, s) for b, s in three], three, [0, 1, 2], timeline(*check), check)
    # an explicit 1-byte mask, (1, 1, s, s) or (b, 1, s, s): the check point is s1²/8 or s1²/4 bytes off the fit
    for m in ({"mask": 1}, {"batch_mask": 1}):
        assert not timeline_on_fit(
            [timeline(b, s, **m) for b, s in three], three, [0, 1, 2], timeline(*check, **m), check
        ), m
    # a step with one allocation more at the check point (a shape-dependent op sequence)
    assert not timeline_on_fit(
        [timeline(b, s) for b, s in three], three, [0, 1, 2], [*timeline(*check), ("opt", 1)], check
    )


def test_small_config_cuts_per_layer_lists():
    cfg = {
        "model_type": "gpt_neo",
        "num_layers": 4,
        "attention_types": [[["global", "local"], 2]],
        "hidden_size": 64,
        "num_heads": 4,
        "vocab_size": 256,
    }
    assert small_config(cfg, 1)["attention_types"] == [[["global"], 1]]
    assert small_config(cfg, 2)["attention_types"] == [[["global"], 1], [["local"], 1]]
    g = {
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }
    assert small_config(g, 2)["layer_types"] == ["sliding_attention", "full_attention"]
    assert small_config(g, 2)["num_hidden_layers"] == 2
    # a model shallower than the traced depth (2 layers traced at 3 and 4): the pattern repeats, and HF's own
    # check (num_hidden_layers == len(layer_types)) holds; it failed every trace of 2-layer Qwen3 configs
    q = {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "layer_types": ["full_attention", "full_attention"],
    }
    assert small_config(q, 3)["layer_types"] == ["full_attention"] * 3
    assert small_config(g, 6)["layer_types"] == ["sliding_attention", "full_attention"] * 3
    assert small_config(cfg, 5)["attention_types"] == [[[t], 1] for t in ["global", "local"] * 2 + ["global"]]
    from memfit.hf import _hf_config

    assert _hf_config(small_config(q, 3)).num_hidden_layers == 3


def test_layer_period():
    from memfit.hf import layer_period

    assert layer_period(small_width("llama-3-8b")) == 1
    assert layer_period(small_width("gemma-2-2b")) == 2


def test_token_points_respect_learned_positions():
    assert max(s for _, s in token_points({"model_type": "gpt2", "n_positions": 1024})) == 1024
    assert max(s for _, s in token_points({"model_type": "llama"})) == 4096
    assert all(b >= 2 for b, _ in token_points({"model_type": "llama"}))


REPLAY_CASES = [
    ("qwen2.5-0.5b", {"precision": "bf16_fp32_master", "optimizer": "adamw_foreach"}),  # frees bf16 grads mid-step
    (
        "llama-3-8b",
        {"precision": "bf16", "optimizer": "adamw_fused", "sharding": "fsdp_full_shard", "data_parallel_size": 4},
    ),  # DTensor states
    ("llama-3-8b", {"precision": "amp_bf16", "optimizer": "adafactor", "gradient_accumulation_steps": 4}),
]


@pytest.mark.parametrize("name,fields", REPLAY_CASES, ids=[f"{n}-{f['optimizer']}" for n, f in REPLAY_CASES])
def test_replayed_optimizer_step_gives_the_terms_of_real_steps(name, fields, monkeypatch):
    # the optimizer step is traced once per small model and replayed in its later steps (OptimizerReplay): the terms
    # must be those of stepping every time, byte for byte
    from tracer import phases

    cfg = small_width(name)
    training = TrainingConfig(micro_batch_size=1, seq_len=128, **fields)
    replayed = trace_terms(cfg, training, micro_batch_one=False, parallel=False).to_json()
    steps = []
    monkeypatch.setattr(phases.OptimizerReplay, "step", lambda self, tracker, opt: steps.append(1) or opt.step())
    stepped = trace_terms(cfg, training, micro_batch_one=False, parallel=False).to_json()
    assert len(steps) >= 12  # two small models, two variants, three or more token points each
    replayed.pop("trace_s"), stepped.pop("trace_s")
    assert replayed == stepped
