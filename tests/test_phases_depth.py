"""The bottom decoder layer is not like the layers above it: the traced small models start at two layers.

Three block types whose 1 -> 2 layer difference is not what each further layer adds (found on the shipped
telemetry, issue 8): BLOOM with ALiBi and eager attention (a checkpointed model's forward holds one more
(b, heads, s, s) tensor from two layers on, once, not per layer: composed from one and two layers it was
+293 % at k = L on bloom-560m, amp_bf16 Adafactor, micro-batch 2, 16,384 tokens), and the parallel-residual
blocks of GPT-J and Falcon under LoRA (frozen embeddings: the bottom layer computes no input gradient, so
its backward is lighter than the others'; +15 % at k = 0 and +126 % at k = L on GPT-J-6B LoRA r16,
+40 % at k = L on Falcon-7B LoRA r16). Each case is the same architecture at reduced width, traced at the
depths :func:`tracer.phases.traced_depths` chooses and composed to six layers, against the collector's
measurement of the whole six-layer model at a token count that was not traced.

Known miss (BLOOM, k = L − 1): the one un-checkpointed layer above the checkpointed block also holds that
block's top attention probabilities (the layer loop's previous output), which none of the all-or-nothing
small models shows: −3.7 % at this reduced width, where the forward's attention scores are the peak; on
bloom-560m itself the bwd.head peak is higher there, by more than those probabilities.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from data import catalog
from memfit.schema import Sharding, TrainingConfig
from model.compose import compose_terms
from tracer.collect import measure_family
from tracer.phases import trace_terms, traced_depths

L = 6

REDUCED = {
    "bloom-560m": {"n_layer": L, "hidden_size": 512, "n_head": 8, "vocab_size": 4096},
    "gpt-j-6b": {"n_layer": L, "n_embd": 512, "n_head": 8, "rotary_dim": 32, "vocab_size": 4096},
    "falcon-7b": {"num_hidden_layers": L, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 4096},
}

CASES = [
    ("bloom-560m", {"precision": "amp_bf16", "optimizer": "adafactor"}, (3, 1536)),  # eager: b·heads·s² scores
    ("gpt-j-6b", {"precision": "bf16", "optimizer": "adamw_fused", "finetune": "lora", "lora_rank": 16}, (3, 768)),
    ("falcon-7b", {"precision": "bf16", "optimizer": "adamw_foreach", "finetune": "lora", "lora_rank": 16}, (1, 1000)),
]


@pytest.mark.parametrize("name,fields,tokens", CASES, ids=[c[0] for c in CASES])
def test_composed_from_two_and_three_layers_equals_full_measurement(name, fields, tokens):
    cfg = {**catalog.get(name)["hf_config"], **REDUCED[name]}
    training = TrainingConfig(micro_batch_size=1, seq_len=128, **fields)
    terms = trace_terms(cfg, training)
    assert terms.depths == (2, 3)
    b, s = tokens
    assert (b, s) not in terms.points
    t = training.model_copy(update={"micro_batch_size": b, "seq_len": s})
    ks = list(range(L + 1))
    measured = [
        r.measurement.peak_allocated_bytes
        for r in measure_family(cfg, t, [list(range(k)) for k in ks], prime=True, steps=1)
    ]
    curve = compose_terms(terms.to_json(), L, b, s)
    for k, m in zip(ks, measured):
        got = int(curve.peak_bytes[k])
        err = (got - m) / m
        if name == "bloom-560m" and k == L - 1:  # the known miss of this module's docstring
            assert -0.05 < err <= 0, f"k={k}: composed {got} vs measured {m} ({err:+.2%})"
        else:
            assert abs(err) < 2e-3, f"k={k}: composed {got} vs measured {m} ({err:+.2%})"


def test_traced_depths():
    assert traced_depths(1, Sharding.NONE) == (2, 3)
    assert traced_depths(2, Sharding.NONE) == (2, 4)  # one and two whole sliding/full patterns, as before
    assert traced_depths(3, Sharding.ZERO1) == (3, 6)
    assert traced_depths(1, Sharding.FSDP_FULL_SHARD) == (3, 4)  # past FSDP's prefetch edge effects
    assert traced_depths(2, Sharding.ZERO3) == (4, 6)


def test_fsdp_lora_mixed_k_forward_is_not_charged_checkpointed_inputs():
    """opt-1.3b (full width, 4 layers), fp32 fused AdamW, ZeRO-3 over 8 ranks, LoRA r64, micro-batch 1: the
    forward peaks while FSDP gathers the bottom layers' parameters, before any layer holds activations, so an
    un-checkpointed layer adds no more to it than a checkpointed one. The split fwd.layers rule charged each
    checkpointed layer its end-of-forward bytes (its saved input) on top of that early peak: +0.3 % per
    checkpointed layer, flat in truth (+4.9 % at k = 22 of 24 on the shipped telemetry, +5.2 % on
    tinyllama-1.1b under FSDP + LoRA r64; +0.3 to +0.9 % at k = 1..3 here).

    Known miss, not fixed here: a phase's peak is the max over its events, each linear in depth, and the max
    is not: at 3 and 4 layers the early gather is the forward's peak, from 6 layers on the top layer's
    activations are, so the per-layer increment read from 3 and 4 layers is too small there (opt-1.3b ZeRO-3
    LoRA r64 at 24 layers: -1.1 to -1.6 % for k <= 18)."""
    cfg = {**catalog.get("opt-1.3b")["hf_config"], "num_hidden_layers": 4}
    training = TrainingConfig(
        micro_batch_size=1,
        seq_len=128,
        precision="fp32",
        optimizer="adamw_fused",
        sharding="zero3",
        data_parallel_size=8,
        finetune="lora",
        lora_rank=64,
    )
    terms = trace_terms(cfg, training)
    assert terms.depths == (3, 4)
    t = training.model_copy(update={"micro_batch_size": 1, "seq_len": 640})
    ks = list(range(5))
    measured = [
        r.measurement.peak_allocated_bytes
        for r in measure_family(cfg, t, [list(range(k)) for k in ks], prime=True, steps=1)
    ]
    curve = compose_terms(terms.to_json(), 4, 1, 640)
    assert curve.phase[2] == "fwd.layers"
    for k, m in zip(ks, measured):
        got = int(curve.peak_bytes[k])
        assert abs(got - m) / m < 2e-3, f"k={k}: composed {got} vs measured {m} ({(got - m) / m:+.2%})"


def test_terms_traced_at_older_depths_are_stale():
    """training.terms_mb1 re-traces entries without micro-batch-1 terms or at depths other than traced_depths."""
    from training.terms_mb1 import stale_reason

    def entry(depths, sharding="none", mb1=True, period=1):
        terms = {"coef": {}, "period": period, **({"depths": depths} if depths else {}), **({"mb1": {}} if mb1 else {})}
        return {"training": {"sharding": sharding}, "terms": terms}

    assert stale_reason(entry([2, 3])) is None
    assert stale_reason(entry([1, 2])) == "traced at depths (1, 2), now (2, 3)"
    assert stale_reason(entry(None)) is not None  # no depths: (period, 2 * period) = (1, 2)
    assert stale_reason(entry([2, 4], period=2)) is None
    assert stale_reason(entry([3, 4], sharding="zero3")) is None
    assert stale_reason(entry([2, 3], mb1=False)) == "no micro-batch-1 terms"
