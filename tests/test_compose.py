"""The token envelope of the composition (model.compose.token_envelope): monotone in micro-batch and sequence
length by construction, equal to the plain composition wherever that already grows with tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data import catalog
from data.catalog import hf_config_of
from model.compose import compose, compose_terms
from model.terms import SHIPPED_DIR


def _entries() -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(SHIPPED_DIR.glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


ENTRIES = _entries()


def _opt13b_zero3_lora64() -> dict:
    (entry,) = [
        e
        for e in ENTRIES
        if e["model_name"] == "opt-1.3b"
        and e["training"]["sharding"] == "zero3"
        and e["training"]["precision"] == "fp32"
        and e["training"].get("lora_rank") == 64
    ]
    return entry


def _depths(terms: dict) -> tuple[int, int]:
    p = terms.get("period", 1)
    return tuple(terms.get("depths") or (p, 2 * p))


def test_plain_composition_falls_with_micro_batch_the_envelope_does_not():
    """opt-1.3b, fp32, ZeRO-3 over 8 ranks, LoRA r64 (traced at depths 3 and 4): the plain composition of
    ``fwd.layers`` at k = L-1 charges -2 un-checkpointed layers' increment above the 3-layer base, and that
    increment (a difference of two per-phase maxima) grows faster than the base once the 4-layer model
    switches to its steep piece: the peak falls by ~10 MB per extra sample. The envelope does not fall."""
    e = _opt13b_zero3_lora64()
    t, L = e["terms"], catalog.spec("opt-1.3b").num_layers
    plain = [compose(t["coef"], L, mb, 24, _depths(t), monotone=False).peak_bytes for mb in (31, 32)]
    assert plain[1][L - 1] < plain[0][L - 1] - 5_000_000
    env = [compose_terms(t, L, mb, 24).peak_bytes for mb in (31, 32)]
    assert (env[1] >= env[0]).all()
    assert (env[0] >= plain[0]).all()


def test_envelope_is_the_max_over_smaller_token_counts():
    """Brute force: the envelope at (b, s) is at least the plain composition at every b' <= b, s' <= s of a
    fine grid, and not above that grid's max by more than the grid's resolution could hide."""
    e = _opt13b_zero3_lora64()
    t, L = e["terms"], catalog.spec("opt-1.3b").num_layers
    b, s = 9, 300
    brute = np.max(
        [
            compose(t["coef"], L, bb, ss, _depths(t), monotone=False).phase_bytes
            for bb in range(1, b + 1)
            for ss in range(1, s + 1)
        ],
        axis=0,
    )
    env = compose(t["coef"], L, b, s, _depths(t)).phase_bytes
    assert (env >= brute - 1e-3).all()
    assert np.allclose(env, brute, rtol=1e-4)


def test_envelope_equals_the_plain_composition_where_it_grows():
    rng = np.random.default_rng(3)
    same = 0
    for _ in range(300):
        e = ENTRIES[rng.integers(len(ENTRIES))]
        t, L = e["terms"], catalog.spec(hf_config_of(e["model_name"])).num_layers
        mb, seq = int(rng.integers(1, 17)), int(rng.integers(16, 2048))
        long = t.get("long")
        coef = long["coef"] if long and seq >= long["min_seq_len"] else t["coef"]
        plain = compose(coef, L, mb, seq, _depths(t), monotone=False).peak_bytes
        env = compose_terms(t, L, mb, seq).peak_bytes
        assert (env >= plain).all()
        same += bool((env == plain).all())
    assert same >= 290


@pytest.mark.parametrize("mb,seq", [(8, 93), (27, 24), (5, 142), (22, 32)])
def test_opt13b_zero3_lora64_non_decreasing_in_micro_batch(mb, seq):
    e = _opt13b_zero3_lora64()
    t, L = e["terms"], catalog.spec("opt-1.3b").num_layers
    a, b = compose_terms(t, L, mb, seq).peak_bytes, compose_terms(t, L, mb + 1, seq).peak_bytes
    assert (b >= a).all()


def test_terms_mb1_merge_replaces_entries_in_place(tmp_path):
    """training.terms_mb1 --merge: re-traced lines replace their entries, order and other lines kept."""
    from training.terms_mb1 import entry_training, merge

    src = [e for e in ENTRIES if "mb1" not in e["terms"]][:3]
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in src))
    (tmp_path / "out").mkdir()
    redone = {**src[1], "terms": {**src[1]["terms"], "mb1": {"coef": src[1]["terms"]["coef"]}}}
    (tmp_path / "out" / "x.0.jsonl").write_text(json.dumps(redone) + "\n")
    assert merge(path, tmp_path / "out") == 1
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["key"] for e in got] == [e["key"] for e in src]
    assert "mb1" in got[1]["terms"] and "mb1" not in got[0]["terms"] and "mb1" not in got[2]["terms"]
    from model.terms import entry_key, shipped_keys, terms_key

    assert terms_key(hf_config_of(src[0]["model_name"]), entry_training(src[0])) == entry_key(src[0], shipped_keys())


def test_traced_training_names_the_base_of_composed_configurations():
    """``training.terms --telemetry`` traces what answers a row: the row's own configuration, the full fine-tune a
    frozen one is composed from, the unsharded configuration of ZeRO-1; nothing for what is not composed."""
    from data import catalog
    from memfit.schema import Sharding, TrainingConfig
    from training.terms import traced_training

    hf = hf_config_of("llama-3.2-1b")
    spec = catalog.spec("llama-3.2-1b")
    own = TrainingConfig(micro_batch_size=1, seq_len=512)
    assert traced_training(spec, own, hf) is own
    frozen = TrainingConfig(micro_batch_size=1, seq_len=512, finetune="frozen", frozen_layers=4)
    base = traced_training(spec, frozen, hf)
    assert base.finetune.value == "full" and base.frozen_layers == 0 and base.precision is frozen.precision
    zero1 = TrainingConfig(micro_batch_size=1, seq_len=512, sharding="zero1", data_parallel_size=8)
    base = traced_training(spec, zero1, hf)
    assert base.sharding is Sharding.NONE and base.data_parallel_size == 1
    # a bitsandbytes optimizer under ZeRO-1 is not composed (ZeroRedundancyOptimizer wraps torch optimizers)
    bnb = TrainingConfig(
        micro_batch_size=1, seq_len=512, sharding="zero1", data_parallel_size=8, optimizer="adamw_8bit"
    )
    assert traced_training(spec, bnb, hf) is None
    # GPT-2's learned position table stays trainable below the frozen layers: not composed either
    gpt2 = TrainingConfig(micro_batch_size=1, seq_len=512, finetune="frozen", frozen_layers=2)
    assert traced_training(catalog.spec("gpt2"), gpt2, hf_config_of("gpt2")) is None


def test_bitsandbytes_optimizers_under_sharding_are_not_traced():
    """bitsandbytes' update kernel refuses FSDP2's DTensor parameters: the answer says so instead of a doomed trace."""
    from data import catalog
    from memfit.schema import TrainingConfig
    from model.terms import not_traceable_reason

    spec = catalog.spec("qwen2.5-0.5b")
    for opt in ("adamw_8bit", "paged_adamw_8bit", "lion"):
        t = TrainingConfig(micro_batch_size=1, seq_len=512, optimizer=opt, sharding="zero2", data_parallel_size=8)
        assert "traced without sharding only" in not_traceable_reason(spec, t)
        assert not_traceable_reason(spec, TrainingConfig(micro_batch_size=1, seq_len=512, optimizer=opt)) is None
