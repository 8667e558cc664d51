"""'What fits instead' (issue 9, item 6): candidate changes and their ranking rule."""

from __future__ import annotations

import pytest

from memfit.api import Alternative
from memfit.schema import ModelSpec, TrainingConfig
from model.recommend import CATEGORIES, candidate_changes, needs_alternatives, rank_alternatives


def alt(name: str, category: str, loss: float, fits: bool = True, peak: int = 10, total: int = 10) -> Alternative:
    return Alternative(
        description=name,
        change={"x": name},
        fits=fits,
        k=0 if fits else None,
        predicted_peak_bytes=peak,
        total_upper_bytes=total,
        category=category,
        throughput_loss_fraction=loss,
    )


def test_rank_by_category_then_throughput_loss_then_peak():
    ranked = rank_alternatives(
        [
            alt("lora", "trained_weights", 0.0),
            alt("bf16", "numerics", 0.0),
            alt("gpus", "more_hardware", 0.05),
            alt("offload", "same_training", 0.3),
            alt("zero3", "same_training", 0.05, peak=20),
            alt("zero3-bigger-peak", "same_training", 0.05, peak=30),
            alt("nofit", "same_training", 0.0, fits=False),
        ]
    )
    assert [a.description for a in ranked] == ["zero3", "zero3-bigger-peak", "offload", "gpus", "bf16", "lora"]


def test_fewer_gpus_first_among_equally_cheap_hardware():
    # a new user saw "ZeRO-3 over 64 GPUs" before 32 and 16 (the lower peak per GPU won the tie): the smallest
    # cluster that fits comes first
    more = [
        Alternative(
            description=f"ZeRO-3 over {n} GPUs",
            change={"gpu_count": n, "sharding": "zero3"},
            fits=True,
            k=0,
            predicted_peak_bytes=1000 // n,
            total_upper_bytes=1000 // n,
            category="more_hardware",
            throughput_loss_fraction=0.0,
        )
        for n in (64, 16, 32)
    ]
    assert [a.change["gpu_count"] for a in rank_alternatives(more)] == [16, 32, 64]


def test_heavy_recompute_keeps_only_cheaper_changes():
    ranked = rank_alternatives(
        [alt("offload", "same_training", 0.3), alt("bf16", "numerics", 0.02), alt("zero2", "same_training", 0.1)],
        current_recompute_fraction=0.25,
    )
    assert [a.description for a in ranked] == ["zero2", "bf16"]
    assert rank_alternatives([alt("offload", "same_training", 0.3)], current_recompute_fraction=0.2) == []


def test_nothing_fits_returns_three_closest():
    alts = [alt(str(t), "same_training", 0.0, fits=False, total=t) for t in (50, 20, 40, 30)]
    assert [a.total_upper_bytes for a in rank_alternatives(alts)] == [20, 30, 40]


def test_unknown_category_is_refused():
    with pytest.raises(ValueError, match=r"category='cheap' must be one of \['same_training'"):
        rank_alternatives([alt("x", "cheap", 0.0)])
    assert CATEGORIES[0] == "same_training"


def test_needs_alternatives_when_no_fit_or_heavy_recompute():
    class P:  # the two Plan attributes the rule reads
        def __init__(self, fits, k, L=8):
            self.fits, self.k = fits, k
            self.curve = type("C", (), {"points": list(range(L + 1))})()

    assert needs_alternatives(P(False, None))
    assert needs_alternatives(P(True, 5)) and not needs_alternatives(P(True, 4)) and not needs_alternatives(P(True, 0))


def test_candidates_cover_each_kind_of_change():
    spec = ModelSpec(
        architecture="llama",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        total_params=8_030_261_248,
        trainable_params=8_030_261_248,
    )
    t = TrainingConfig(micro_batch_size=4, seq_len=2048, precision="bf16_fp32_master")
    cands = candidate_changes(t, spec, 2)
    changes = [c.change for c in cands]
    assert {"sharding": "zero2", "data_parallel_size": 2} in changes
    assert {"sharding": "zero3", "data_parallel_size": 2} in changes
    assert {"micro_batch_size": 1, "gradient_accumulation_steps": 4} in changes
    assert {"offload_optimizer": "cpu"} in changes
    assert {
        "offload_optimizer": "cpu",
        "offload_parameters": "cpu",
        "sharding": "zero3",
        "data_parallel_size": 2,
    } in changes
    assert {"gpu_count": 16, "sharding": "zero3", "data_parallel_size": 16} in changes
    assert {"precision": "bf16"} in changes
    assert any(c.get("finetune") == "lora" for c in changes)
    assert {c.category for c in cands} <= set(CATEGORIES)
    # already offloaded, pure bf16, LoRA: those changes are not offered again
    done = TrainingConfig(
        micro_batch_size=1,
        seq_len=128,
        precision="bf16",
        finetune="lora",
        lora_rank=8,
        offload_optimizer="cpu",
        offload_parameters="cpu",
    )
    again = [c.change for c in candidate_changes(done, spec, 1)]
    assert not any("offload_optimizer" in c or "precision" in c or "finetune" in c for c in again)


def test_candidates_offer_8bit_adamw_qlora_and_context_parallel_where_they_apply():
    spec = ModelSpec(
        architecture="llama",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        total_params=8_030_261_248,
        trainable_params=8_030_261_248,
    )
    full = [c.change for c in candidate_changes(TrainingConfig(micro_batch_size=1, seq_len=2048), spec, 1)]
    assert {"optimizer": "adamw_8bit"} in full
    assert {"finetune": "lora", "lora_rank": 16, "quantization": "nf4"} in full
    assert not any("context_parallel_size" in c for c in full)  # short sequence, one GPU
    lora = TrainingConfig(micro_batch_size=1, seq_len=2048, finetune="lora", lora_rank=64, optimizer="sgd_momentum")
    changes = [c.change for c in candidate_changes(lora, spec, 1)]
    assert {"quantization": "nf4"} in changes  # the same adapters on a 4-bit base
    assert {"optimizer": "adamw_8bit"} not in changes  # not an AdamW run
    long = [c.change for c in candidate_changes(TrainingConfig(micro_batch_size=1, seq_len=12288), spec, 8)]
    # the largest power of two <= 8 GPUs that divides the sequence: 12288 = 3 * 4096
    # on the same GPUs: cp of the replicas go, cp-fold gradient accumulation keeps the samples per step
    assert {"context_parallel_size": 8, "data_parallel_size": 1, "gradient_accumulation_steps": 8} in long
    # unsharded: also with ZeRO-3 / FSDP over the data x context-parallel ranks
    assert {
        "context_parallel_size": 8,
        "data_parallel_size": 1,
        "gradient_accumulation_steps": 8,
        "sharding": "zero3",
    } in long
    zero3 = TrainingConfig(micro_batch_size=1, seq_len=12288, sharding="zero3", data_parallel_size=8)
    assert [c.change for c in candidate_changes(zero3, spec, 8) if "context_parallel_size" in c.change][:1] == [
        {"context_parallel_size": 8, "data_parallel_size": 1, "gradient_accumulation_steps": 8}
    ]
    even = [c.change for c in candidate_changes(TrainingConfig(micro_batch_size=1, seq_len=10002), spec, 8)]
    assert {"context_parallel_size": 2, "data_parallel_size": 4, "gradient_accumulation_steps": 2} in even  # 2 * 5001
    odd = [c.change for c in candidate_changes(TrainingConfig(micro_batch_size=1, seq_len=9001), spec, 8)]
    assert not any("context_parallel_size" in c for c in odd)


def test_heavy_recompute_gets_cheaper_alternatives_through_the_curve():
    # Mistral-7B, pure bf16, AdamW, micro-batch 4, seq 4096 on one A100-80GB fits only with 27 of 32 layers
    # checkpointed (~28 % extra compute): the answer offers the cheaper ways out, each planned on the same curve.
    from memfit.api import RecommendRequest
    from model.registry import Registry
    from service.recommender import Recommender

    loaded = Registry().load()
    rec = Recommender(loaded.estimator, loaded.version).recommend(
        RecommendRequest.model_validate(
            {
                "model": "mistral-7b-v0.1",
                "training": {
                    "micro_batch_size": 4,
                    "seq_len": 4096,
                    "precision": "bf16",
                    "optimizer": "adamw_foreach",
                    "attention": "flash",
                },
                "cluster": {"gpu": "A100-80GB"},
            }
        )
    )
    assert rec.fits and rec.k > rec.num_layers // 2
    assert rec.alternatives
    first = rec.alternatives[0]
    assert first.fits and first.k < rec.k
    # micro-batch 1 with 4x gradient accumulation keeps the 13.5 GiB gradient buffer live through forward and
    # backward (82.6 GiB at k = 0, traced) but its largest request, the fp32 logits, is a quarter of micro-batch 4's
    # (0.49 against 1.95 GiB kept free): it needs 14 checkpointed layers, cheaper than 27 at micro-batch 4
    (accumulate,) = [a for a in rec.alternatives if "micro_batch_size" in a.change]
    assert accumulate.change == {"micro_batch_size": 1, "gradient_accumulation_steps": 4} and accumulate.k == 14
    assert rec.k == 27
    assert all(a.fits and a.throughput_loss_fraction < rec.recompute_overhead_fraction for a in rec.alternatives)
    assert [CATEGORIES.index(a.category) for a in rec.alternatives] == sorted(
        CATEGORIES.index(a.category) for a in rec.alternatives
    )


def test_recompute_fraction_counts_no_recompute_for_frozen_layers():
    """Checkpointing a frozen layer recomputes nothing and frozen layers run no backward (model.frozen)."""
    from memfit.schema import TrainingConfig
    from model.recommend import recompute_fraction

    full = TrainingConfig(micro_batch_size=1, seq_len=512)
    assert recompute_fraction(12, 16, full) == pytest.approx(12 / 48)
    frozen = TrainingConfig(micro_batch_size=1, seq_len=512, finetune="frozen", frozen_layers=4)
    assert recompute_fraction(4, 16, frozen) == 0.0
    assert recompute_fraction(12, 16, frozen) == pytest.approx(8 / (16 + 24))


def test_longest_fitting_seq_len_bisects_multiples_of_the_step():
    from model.recommend import longest_fitting_seq_len

    asked = []

    def fits(s: int) -> bool:
        asked.append(s)
        return s <= 20_700

    assert longest_fitting_seq_len(32_768, fits) == 20_480
    assert len(asked) <= 7 and all(s % 1024 == 0 and s < 32_768 for s in asked)
    assert longest_fitting_seq_len(32_768, lambda s: False) is None
    assert longest_fitting_seq_len(32_768, lambda s: True) == 31_744  # shorter, never the request's own length
    assert longest_fitting_seq_len(1024, lambda s: True) is None


def test_long_context_offers_context_parallel_over_more_gpus():
    spec = ModelSpec(
        architecture="llama",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        total_params=8_030_261_248,
        trainable_params=8_030_261_248,
    )
    changes = [c.change for c in candidate_changes(TrainingConfig(micro_batch_size=1, seq_len=32768), spec, 1)]
    for cp in (2, 4, 8):  # the data-parallel size is left to the request schema's default for the new gpu_count
        assert {"gpu_count": cp, "context_parallel_size": cp} in changes
        assert {"gpu_count": cp, "context_parallel_size": cp, "sharding": "zero3"} in changes
    short = [c.change for c in candidate_changes(TrainingConfig(micro_batch_size=1, seq_len=4096), spec, 1)]
    assert not any("context_parallel_size" in c for c in short)


@pytest.fixture(scope="module")
def shipped_recommender():
    from model.registry import Registry
    from service.recommender import Recommender

    loaded = Registry().load()
    return Recommender(
        loaded.estimator,
        loaded.version,
        telemetry_range=loaded.meta.get("telemetry_range"),
        margins=loaded.meta.get("bound_margins"),
        coefficients=loaded.coefficients,
    )


def test_llama_3_8b_at_32k_on_one_h100_is_offered_a_shorter_sequence_and_context_parallel(shipped_recommender):
    # issue 28.8: nothing fits at 32k (110.4 GiB at k = 32 with the overhead); a shorter sequence and context
    # parallelism were not among the alternatives
    from memfit.api import RecommendRequest

    body = {
        "model": "llama-3-8b",
        "training": {"micro_batch_size": 1, "seq_len": 32768, "precision": "bf16"},
        "cluster": {"gpu": "H100-94GB"},
    }
    rec = shipped_recommender.recommend(RecommendRequest.model_validate(body))
    assert not rec.fits and rec.path == "traced"
    by_change = {tuple(sorted(a.change.items())): a for a in rec.alternatives}
    cp_k = {cp: by_change[(("context_parallel_size", cp), ("gpu_count", cp))].k for cp in (2, 4, 8)}
    assert cp_k == {2: 31, 4: 18, 8: 0}
    # the default allocator keeps the largest request free: at 20,480 tokens the fp32 logits are 9.8 GiB
    shorter = by_change[(("seq_len", 17408),)]
    assert shorter.fits and shorter.k == 32 and shorter.category == "shorter_sequence" and shorter.path == "traced"
    # each alternative is the answer to the changed request, and the next multiple of 1024 does not fit
    for change in ({"seq_len": 17408}, {"seq_len": 18432}, {"gpu_count": 4, "context_parallel_size": 4}):
        changed = {
            **body,
            "training": {**body["training"], **{k: v for k, v in change.items() if k != "gpu_count"}},
            "cluster": {**body["cluster"], "gpu_count": change.get("gpu_count", 1)},
        }
        direct = shipped_recommender.recommend(RecommendRequest.model_validate(changed))
        if change.get("seq_len") == 18432:
            assert not direct.fits
        else:
            assert direct.fits and direct.k == by_change[tuple(sorted(change.items()))].k


def test_when_no_single_change_fits_sharding_and_a_smaller_micro_batch_are_offered_together(shipped_recommender):
    """Llama-3-8B, micro-batch 8, seq 4096, 8 A100-80GB, no sharding (a new user's trial at mb4 s8192): nothing
    fits, and neither did any single change on the same GPUs (ZeRO-3 keeps micro-batch 8's activations, micro-batch
    1 keeps 16 B of states per parameter): the three closest were CPU offload and ZeRO-3 over 32 and 64 GPUs, none
    fitting, while ZeRO-3 with micro-batch 1 and 8x accumulation fits on the 8 GPUs. Pairs are planned when no
    single change fits."""
    from memfit.api import RecommendRequest
    from model.recommend import candidate_changes, combined_changes

    body = {
        "model": "llama-3-8b",
        "training": {"micro_batch_size": 8, "seq_len": 4096},
        "cluster": {"gpu": "A100-80GB", "gpu_count": 8},
    }
    rec = shipped_recommender.recommend(RecommendRequest.model_validate(body))
    assert not rec.fits
    first = rec.alternatives[0]
    assert first.fits and first.category == "same_training", [(a.description, a.fits) for a in rec.alternatives]
    assert first.change["sharding"] == "zero3" and first.change["data_parallel_size"] == 8
    assert first.change["micro_batch_size"] * first.change["gradient_accumulation_steps"] == 8
    # the pairs: ZeRO-3 on the same GPUs with each halving of the micro-batch, costs added
    from data import catalog

    singles = candidate_changes(TrainingConfig(micro_batch_size=4, seq_len=8192), catalog.spec("llama-3-8b"), 8)
    pairs = combined_changes(singles)
    assert [p.change["micro_batch_size"] for p in pairs] == [2, 1]
    assert [p.throughput_loss_fraction for p in pairs] == pytest.approx([0.1, 0.15])


def test_long_sequences_are_offered_context_parallel_with_zero3_on_the_same_gpus(shipped_recommender):
    """Llama-3-8B, micro-batch 4, seq 8192, 8 A100-80GB, no sharding: the context-parallel alternatives were all on
    more GPUs (the one on the same GPUs kept every rank's full model states), though the README offers context
    parallelism within the GPUs. ZeRO-3 over the 1 x 8 data x context ranks fits at k = 0 (1,024 tokens a rank),
    with 8x gradient accumulation keeping the 32 sequences a step."""
    from memfit.api import RecommendRequest

    body = {
        "model": "llama-3-8b",
        "training": {"micro_batch_size": 4, "seq_len": 8192},
        "cluster": {"gpu": "A100-80GB", "gpu_count": 8},
    }
    rec = shipped_recommender.recommend(RecommendRequest.model_validate(body))
    first = rec.alternatives[0]
    assert not rec.fits and first.fits and first.category == "same_training" and first.k == 0
    assert first.change == {
        "context_parallel_size": 8,
        "data_parallel_size": 1,
        "gradient_accumulation_steps": 8,
        "sharding": "zero3",
    }
