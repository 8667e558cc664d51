"""Issue 29, item 3: one request's analytic facts are computed once (model.analytic.analytic_estimates for every k,
model_state_bytes memoised), with the same values as computed afresh."""

from __future__ import annotations

import cProfile
import itertools
import pstats

import pytest

from data import catalog
from memfit.schema import TrainingConfig
from model.analytic import _model_state_bytes, analytic_estimate, analytic_estimates, model_state_bytes
from model.features import curve_matrix, feature_row

SPECS = [catalog.spec("llama-3-8b"), catalog.spec("mixtral-8x7b"), catalog.spec("gpt2")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.architecture)
def test_memoised_states_equal_fresh_ones_for_every_field_it_reads(spec):
    grid = itertools.product(
        ("fp32", "amp_bf16", "bf16", "bf16_fp32_master"),
        ("adamw_foreach", "sgd_momentum", "adamw_8bit"),
        ("none", "zero1", "zero2", "zero3", "fsdp_shard_grad_op"),
        (1, 8),
        ("none", "cpu"),
    )
    seen = set()
    for precision, optimizer, sharding, dp, offload in grid:
        fields = {"precision": precision, "optimizer": optimizer, "sharding": sharding, "offload_optimizer": offload}
        if sharding != "none":
            fields["data_parallel_size"] = dp
        if spec.num_experts and sharding != "none" and dp == 8:
            fields["expert_parallel_size"] = 2
        try:
            training = TrainingConfig(micro_batch_size=1, seq_len=64, **fields)
        except ValueError:
            continue
        for lower in (False, True):
            got = model_state_bytes(spec, training, zero1_lower_bound=lower)
            assert got == _model_state_bytes(spec, training, lower)
            seen.add(got)
    lora = spec.model_copy(update={"trainable_params": spec.total_params // 100})
    for quant in ("none", "nf4", "int8"):
        training = TrainingConfig(micro_batch_size=1, seq_len=64, finetune="lora", lora_rank=8, quantization=quant)
        assert model_state_bytes(lora, training) == _model_state_bytes(lora, training, False)
    assert len(seen) > 20  # the grid's fields do change the states: the memo tells them apart


def test_estimates_of_every_k_equal_one_k_at_a_time():
    spec = SPECS[0]
    training = TrainingConfig(micro_batch_size=2, seq_len=2048, precision="bf16", optimizer="adafactor")
    every = analytic_estimates(spec, training)
    assert len(every) == spec.num_layers + 1
    for k in (0, 1, 17, spec.num_layers):
        one = analytic_estimate(spec, training.model_copy(update={"checkpoint_layers": list(range(k))}))
        assert every[k] == one
        assert one.peak_bytes == max(one.backward_peak_bytes, one.optimizer_peak_bytes)
    rows = curve_matrix(spec, training)
    for k in (0, 5, spec.num_layers):
        t = training.model_copy(update={"checkpoint_layers": list(range(k))})
        assert list(rows[k]) == feature_row(spec, t)


def test_a_learned_curve_asks_the_analytic_model_a_few_times_not_once_per_k():
    """Before: about 35 calls into model/analytic.py per k (1,155 for Llama-3-8B's 33 rows)."""
    spec = SPECS[0]
    training = TrainingConfig(micro_batch_size=1, seq_len=4096, precision="bf16")
    prof = cProfile.Profile()
    prof.enable()
    curve_matrix(spec, training)
    prof.disable()
    calls = sum(
        total
        for (filename, _l, _n), (_p, total, *_r) in pstats.Stats(prof).stats.items()
        if filename.endswith("model/analytic.py")
    )
    assert 0 < calls <= 30, calls
