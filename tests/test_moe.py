"""MoE tracing: the balanced router, its agreement with real CPU runs, determinism, composition over L, EP."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from memfit.errors import InvalidConfiguration
from memfit.hf import local_expert_config
from memfit.schema import TrainingConfig, check_moe_settings
from model.compose import compose
from model.terms import not_traceable_reason
from tests.moe_configs import TINY_MOE
from tracer.collect import measure, measure_family
from tracer.moe import balanced_expert_index, received_token_rows
from tracer.phases import trace_terms


def _with_layers(cfg: dict, n: int) -> dict:
    return {**cfg, "num_hidden_layers": n}


def test_balanced_index_gives_every_expert_its_share():
    idx = balanced_expert_index(48, 2, 8)
    assert idx.shape == (48, 2) and idx.dtype == torch.int64
    assert torch.bincount(idx.flatten(), minlength=8).tolist() == [12] * 8  # T·k/E each
    assert all(len(set(row)) == 2 for row in idx.tolist())  # a token's experts are distinct


def test_imbalanced_index_makes_expert_0_hottest_by_the_factor():
    idx = balanced_expert_index(48, 2, 8, imbalance_factor=2.5)
    counts = torch.bincount(idx.flatten(), minlength=8).tolist()
    assert counts[0] == 30  # 2.5 x 12
    assert sum(counts) == 96 and max(counts[1:]) - min(counts[1:]) <= 1
    assert all(len(set(row)) == 2 for row in idx.tolist())
    with pytest.raises(ValueError, match="moe_imbalance_factor=4.5 must be in \\[1, .* = 4\\]"):
        balanced_expert_index(48, 2, 8, imbalance_factor=4.5)


def test_received_rows_of_the_hottest_rank():
    assert received_token_rows(1000, 8, 4) == 1000  # balanced: every rank gets T tokens' slots
    assert received_token_rows(1000, 8, 4, imbalance_factor=2.0) == 1500  # T·(1 + (f-1)·P/E)
    assert received_token_rows(1000, 8, 1, imbalance_factor=2.0) == 1125


@pytest.mark.parametrize("family", sorted(TINY_MOE))
def test_fake_trace_equals_real_cpu_run_with_the_same_routing(family):
    # the same patch on real CPU tensors routes the same tokens: allocated bytes agree to the byte
    t = TrainingConfig(micro_batch_size=2, seq_len=64, precision="bf16", checkpoint_layers=[1])
    fake, cpu = (measure(TINY_MOE[family], t, device=d).measurement.peak_allocated_bytes for d in ("fake", "cpu"))
    assert fake == cpu


def test_expert_parallel_and_imbalance_fake_equal_real_cpu():
    # amp_bf16 keeps fp32 experts: transformers' grouped_mm fallback op, on both sides
    t = TrainingConfig(
        micro_batch_size=2,
        seq_len=64,
        precision="amp_bf16",
        data_parallel_size=2,
        expert_parallel_size=2,
        moe_imbalance_factor=2.0,
    )
    fake, cpu = (measure(TINY_MOE["mixtral"], t, device=d) for d in ("fake", "cpu"))
    assert fake.measurement.peak_allocated_bytes == cpu.measurement.peak_allocated_bytes
    from memfit.hf import count_params_from_config

    assert fake.model.num_experts == 4  # the record describes the whole model: all experts and their parameters
    assert fake.model.total_params == count_params_from_config(TINY_MOE["mixtral"])


def test_imbalance_changes_memory_only_through_expert_parallelism():
    cfg = TINY_MOE["qwen2_moe"]

    def peak(**kw):
        t = TrainingConfig(micro_batch_size=2, seq_len=128, precision="bf16", **kw)
        return measure(cfg, t).measurement.peak_allocated_bytes

    assert peak() == peak(moe_imbalance_factor=3.0)  # grouped_mm: T·k rows whatever their spread
    balanced = peak(data_parallel_size=2, expert_parallel_size=2)
    assert peak(data_parallel_size=2, expert_parallel_size=2, moe_imbalance_factor=3.0) > balanced
    assert balanced < peak()  # half the experts' weights, gradients and AdamW states on the rank


def test_trace_is_deterministic():
    cfg = TINY_MOE["olmoe"]
    t = TrainingConfig(micro_batch_size=1, seq_len=128, precision="bf16")
    a, b = (json.dumps(trace_terms(cfg, t).to_json()["coef"], sort_keys=True) for _ in range(2))
    assert a == b


@pytest.mark.parametrize(
    "family,fields",
    [
        ("mixtral", {"precision": "bf16"}),
        ("deepseek_v3", {"precision": "amp_bf16"}),
        (
            "qwen2_moe",
            {"precision": "bf16", "data_parallel_size": 2, "expert_parallel_size": 2, "moe_imbalance_factor": 2.0},
        ),
    ],
)
def test_composed_moe_peak_equals_full_measurement(family, fields):
    L = 4
    cfg = _with_layers(TINY_MOE[family], L)
    training = TrainingConfig(micro_batch_size=1, seq_len=128, **fields)
    terms = trace_terms(cfg, training)
    b, s = 3, 384  # not a traced point
    assert (b, s) not in set(terms.points)
    t = training.model_copy(update={"micro_batch_size": b, "seq_len": s})
    ks = [0, 2, L]
    measured = [
        r.measurement.peak_allocated_bytes
        for r in measure_family(cfg, t, [list(range(k)) for k in ks], prime=True, steps=1)
    ]
    curve = compose(terms.coef, L, b, s, terms.depths)
    for k, m in zip(ks, measured):
        assert abs(int(curve.peak_bytes[k]) - m) / m < 2e-3, (k, int(curve.peak_bytes[k]), m)
    # the one curve answers on the traced path; with EP its state floor is the rank's (E/P experts), not the model's
    from data import catalog
    from model.curve import TRACED, MemoryPredictor
    from model.terms import TermsCache, terms_key

    cache = TermsCache(shipped_dir=None)
    cache.put(terms_key(cfg, training), terms.to_json())
    c = MemoryPredictor(None, cache).curve(catalog.spec(cfg), t, cfg)
    assert c.path == TRACED and not any("approximate" in n for n in c.notes)
    for k, m in zip(ks, measured):
        assert abs(c.points[k].predicted_bytes - m) / m < 2e-3, (k, c.points[k].predicted_bytes, m)


def test_not_traceable_moe_setups_are_named():
    from data import catalog

    ds = {k: v for k, v in TINY_MOE["deepseek_v3"].items() if k != "first_k_dense_replace"}  # HF default: 3 dense
    spec = catalog.spec(ds)
    t = TrainingConfig(micro_batch_size=1, seq_len=128)
    assert "dense and MoE decoder layers" in not_traceable_reason(spec, t, ds)
    assert "saving per checkpointed layer is approximate" in not_traceable_reason(spec, t, ds)  # issue 30 item 8
    assert not_traceable_reason(spec, t, TINY_MOE["deepseek_v3"]) is None
    fsdp_ep = TrainingConfig(
        micro_batch_size=1, seq_len=128, sharding="fsdp_full_shard", data_parallel_size=2, expert_parallel_size=2
    )
    assert "sharding=none" in not_traceable_reason(spec, fsdp_ep, TINY_MOE["deepseek_v3"])
    with pytest.raises(ValueError, match="must divide num_experts=8"):
        local_expert_config(TINY_MOE["olmoe"], 3)


def test_moe_settings_are_checked_against_the_model():
    from data import catalog

    spec = catalog.spec(TINY_MOE["mixtral"])  # 4 experts, top-2
    with pytest.raises(InvalidConfiguration) as err:
        check_moe_settings(spec, TrainingConfig(micro_batch_size=1, seq_len=8, moe_imbalance_factor=2.5))
    assert err.value.field == "training.moe_imbalance_factor"
    with pytest.raises(InvalidConfiguration) as err:
        check_moe_settings(
            spec, TrainingConfig(micro_batch_size=1, seq_len=8, data_parallel_size=3, expert_parallel_size=3)
        )
    assert err.value.field == "training.expert_parallel_size"
    with pytest.raises(ValueError, match="expert_parallel_size: must be a divisor of data_parallel_size=1"):
        TrainingConfig(micro_batch_size=1, seq_len=8, expert_parallel_size=2)


def test_lora_with_peft_default_targets_runs_on_mixtral():
    """PEFT 0.21 under transformers 5 leaves Mixtral's default LoRA targets an empty set (NoMatchingPeftModuleError,
    found by a new-user trial: every Mixtral LoRA request without target modules fell back to the learned path); the
    collector passes PEFT's default mapping (q_proj, v_proj) itself, and the step adapts exactly those."""
    t = TrainingConfig(micro_batch_size=2, seq_len=64, precision="bf16", finetune="lora", lora_rank=4)
    explicit = t.model_copy(update={"lora_target_modules": ["q_proj", "v_proj"]})
    measure(TINY_MOE["mixtral"], explicit)  # the first step in a process allocates 2 KiB more (a one-off cache)
    default, named = (measure(TINY_MOE["mixtral"], c) for c in (t, explicit))
    assert default.measurement.peak_allocated_bytes == named.measurement.peak_allocated_bytes > 0
    assert default.model.trainable_params == named.model.trainable_params > 0


def test_zero_placement_gathers_each_parameter_at_its_own_size():
    """DeepSpeed's flat partition pads no dimension; FSDP2's dim-0 shard pads (8, 2F, H) experts over 64 ranks to
    64 rows. The ZeRO placement keeps dim 0 where it has at least one row per rank, else the first even dimension."""
    from torch.distributed.tensor import Shard

    from tracer.collect import flat_partition_placement

    place = flat_partition_placement(64)
    assert place(torch.nn.Parameter(torch.empty(8, 28672, 4096, device="meta"))) == Shard(1)  # Mixtral's experts
    assert place(torch.nn.Parameter(torch.empty(8, 4096, device="meta"))) == Shard(1)  # its router
    assert place(torch.nn.Parameter(torch.empty(16, 4096, device="meta"))) == Shard(1)  # LoRA A, rank 16
    assert place(torch.nn.Parameter(torch.empty(50257, 768, device="meta"))) == Shard(0)  # 47 rows of padding
    assert place(torch.nn.Parameter(torch.empty(4096, device="meta"))) == Shard(0)
    assert place(torch.nn.Parameter(torch.empty(8, 7, device="meta"))) == Shard(0)  # nothing even: FSDP2's own


def test_zero3_over_more_ranks_than_experts_holds_less_and_fsdp2_pads_the_experts():
    """A helper saw Mixtral-8x7B under zero3 grow from 117 to 184 GB per GPU going from 8 to 64 GPUs: FSDP2 padded
    the 8-expert tensors to 64 rows. DeepSpeed-named sharding is traced without that padding, so more ranks hold
    less; fsdp_full_shard keeps it (FSDP2 runs so), and its answer says why."""
    from data import catalog
    from model.curve import MemoryPredictor
    from model.terms import TermsCache, terms_key

    cfg = _with_layers(TINY_MOE["mixtral"], 2)  # 4 experts

    def peak(sharding: str, ranks: int) -> int:
        t = TrainingConfig(micro_batch_size=1, seq_len=128, sharding=sharding, data_parallel_size=ranks)
        return measure(cfg, t).measurement.peak_allocated_bytes

    zero3 = [peak("zero3", n) for n in (4, 16)]
    fsdp = [peak("fsdp_full_shard", n) for n in (4, 16)]
    assert zero3[0] == fsdp[0]  # 4 experts over 4 ranks: no padding either way
    assert zero3[1] < zero3[0] < fsdp[1]  # zero3: less per rank; FSDP2: the experts gathered at 4x their size
    t = TrainingConfig(micro_batch_size=1, seq_len=128, sharding="fsdp_full_shard", data_parallel_size=16)
    cache = TermsCache(shipped_dir=None)
    cache.put(terms_key(cfg, t), trace_terms(cfg, t).to_json())
    notes = MemoryPredictor(None, cache).curve(catalog.spec(cfg), t, cfg).notes
    assert (
        "FSDP2 shards dim 0: the fused (4, ...) expert tensors are padded to 16 rows over 16 ranks, gathered at 4x "
        "their size; sharding them on another dimension (fully_shard's shard_placement_fn, torchtitan) or "
        "DeepSpeed's flat partition (sharding zero3) avoids it"
    ) in notes
