"""Offload (issue 9, item 3): the public case, the host-memory rule against DeepSpeed's estimators, and the
device composition checked on a tiny model against a real CPU run with the optimizer on the host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from memfit.api import RecommendRequest
from memfit.schema import ModelSpec, Offload, TrainingConfig
from model.job import resolve
from model.offload import host_bytes_per_rank, host_memory_bytes
from model.registry import Registry
from model.terms import TermsCache
from service.recommender import Recommender
from tests.helpers import TINY_LLAMA, ZERO3_FULL_OFFLOAD_TRAINING

GB = 10**9


#: traced terms (python -m training.terms's run(), 6 s + 13 s here) of Llama-3-8B in bf16 + fp32 master AdamW, unsharded
#: and FSDP full-shard over 8 ranks: the bases of the optimizer- and parameter-offload curves. Kept beside the
#: tests, not in data/terms, until the shipped set grows (it changes tests/test_curve.py's random draws).
TERMS = Path(__file__).parent / "data" / "terms_llama3_8b_bf16_master.jsonl"


@pytest.fixture(scope="module")
def recommender() -> Recommender:
    loaded = Registry().load()  # the shipped, current version
    terms = TermsCache()
    for line in TERMS.read_text().splitlines():
        entry = json.loads(line)
        terms.put(entry["key"], entry["terms"], entry["model_name"])
    return Recommender(
        loaded.estimator, loaded.version, telemetry_range=loaded.meta.get("telemetry_range"), terms=terms
    )


def test_llama_3_8b_full_finetune_on_one_a100_80gb_needs_optimizer_offload(recommender):
    # Public report (issue 9): Llama-3-8B full fine-tune, bf16 with fp32 master weights, AdamW, one A100-80GB,
    # micro-batch 1, seq 128: no k fits (16 B/param of states = 128 GB), and the fix was offloading the optimizer.
    req = RecommendRequest.model_validate(
        {
            "model": "llama-3-8b",
            "training": {
                "micro_batch_size": 1,
                "seq_len": 128,
                "precision": "bf16_fp32_master",
                "optimizer": "adamw_foreach",
            },
            "cluster": {"gpu": "A100-80GB"},
        }
    )
    rec = recommender.recommend(req)
    assert not rec.fits and rec.k is None and rec.path == "traced"
    assert rec.host_memory_bytes == 0
    first = rec.alternatives[0]
    assert first.change == {"offload_optimizer": "cpu"}
    assert first.fits and first.k == 0 and first.path == "traced"
    # device: bf16 weights + bf16 gradients (4 B/param) plus activations of 128 tokens
    params = 8_030_261_248
    assert 4 * params <= first.predicted_peak_bytes <= 4 * params * 1.02
    # host: (8 B AdamW states + 4 B fp32 master + 4 B fp32 gradients) x params x 1.5 pinned-buffer factor
    assert first.host_memory_bytes == int(16 * params * 1.5)
    assert round(first.host_memory_bytes / GB, 1) == 192.7
    assert all(a.fits for a in rec.alternatives)
    assert "ZeRO-Offload" in first.description and "slower" in first.cost


def _llama_8b_spec() -> ModelSpec:
    return ModelSpec(
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


def test_host_memory_matches_deepspeed_estimators():
    stage12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    spec = _llama_8b_spec()
    p = spec.total_params
    one = TrainingConfig(micro_batch_size=1, seq_len=128, precision="bf16_fp32_master", offload_optimizer="cpu")
    assert host_memory_bytes(spec, one, 1) == stage12.estimate_zero2_model_states_mem_needs(p, 1, 1, True)[0]

    # eight ranks on one node, ZeRO-2 + optimizer offload: DeepSpeed's max(4 x gpus, 16) per parameter
    def changed(t, **update):
        return TrainingConfig.model_validate({**t.model_dump(), **update})

    z2 = changed(one, sharding="zero2", data_parallel_size=8)
    assert host_memory_bytes(spec, z2, 8) == stage12.estimate_zero2_model_states_mem_needs(p, 8, 1, True)[0]
    # ZeRO-3 with parameters and optimizer offloaded (zero.Init): 18 B per parameter per node
    z3 = changed(z2, sharding="zero3", offload_parameters="cpu")
    largest = 128256 * 4096
    assert (
        host_memory_bytes(spec, z3, 8)
        == stage3.estimate_zero3_model_states_mem_needs(p, largest, 8, 1, True, True, True)[0]
    )
    # ZeRO-3 with only the optimizer offloaded: zero.Init too (transformers enters it whenever ZeRO-3 is
    # configured), 16 B per parameter per node; it was given DeepSpeed's zero_init=False figure, twice that for
    # Qwen3-30B-A3B on 8 GPUs (1,364.9 GiB, above the 767.8 GiB of offloading the parameters as well)
    z3_opt = changed(z3, offload_parameters="none")
    assert (
        host_memory_bytes(spec, z3_opt, 8)
        == stage3.estimate_zero3_model_states_mem_needs(p, largest, 8, 1, True, False, True)[0]
    )
    assert host_memory_bytes(spec, z3_opt, 8) < host_memory_bytes(spec, z3, 8)


def test_offload_validation_names_field_and_allowed_values():
    base = {"model": "llama-3-8b", "cluster": {"gpu": "A100-80GB"}}
    with pytest.raises(ValidationError) as err:
        RecommendRequest.model_validate(
            {**base, "training": {"micro_batch_size": 1, "seq_len": 128, "offload_optimizer": "nvme"}}
        )
    assert "offload_optimizer" in str(err.value) and "'none' or 'cpu'" in str(err.value)
    with pytest.raises(ValidationError, match="offload_parameters='cpu' needs offload_optimizer='cpu'"):
        RecommendRequest.model_validate(
            {**base, "training": {"micro_batch_size": 1, "seq_len": 128, "offload_parameters": "cpu"}}
        )
    with pytest.raises(ValidationError, match="needs sharding in"):
        TrainingConfig(
            micro_batch_size=1,
            seq_len=8,
            sharding="zero2",
            data_parallel_size=2,
            offload_optimizer="cpu",
            offload_parameters="cpu",
        )


def test_deepspeed_config_and_fsdp_policy_are_picked_up():
    import torch

    from memfit.describe import describe, ds_offload

    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    assert ds_offload(ds) == ("cpu", None)
    with pytest.raises(ValueError, match=r"zero_optimization.offload_param.device='nvme'.*\['none', 'cpu'\]"):
        ds_offload({"zero_optimization": {"offload_param": {"device": "nvme"}}})
    from memfit.hf import build_causal_lm

    model = build_causal_lm(TINY_LLAMA)
    req = describe(model, seq_len=64, deepspeed_config=ds, gpu="A100-80GB", gpu_count=1)
    assert req.training.offload_optimizer == "cpu" and req.training.offload_parameters == "none"
    assert req.training.precision == "bf16_fp32_master"
    # FSDP2 CPUOffloadPolicy over a one-rank fake process group: parameters and optimizer offloaded
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from tracer.collect import _fake_process_group

    _fake_process_group(1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = build_causal_lm(TINY_LLAMA, dtype=torch.float32)
        fully_shard(sharded, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        req = describe(sharded, micro_batch_size=1, seq_len=64, gpu="A100-80GB", gpu_count=1)
    finally:
        torch.distributed.destroy_process_group()  # later tests read the world size
    assert req.training.offload_parameters == "cpu" and req.training.offload_optimizer == "cpu"


def test_optimizer_offload_composition_agrees_with_a_real_cpu_run():
    # The composed device curve (traced terms without offload, optimizer states removed, the step on the host)
    # against a real CPU step whose optimizer lives on the host (tracer.collect.HostOffloadOptimizer).
    # Measured here: +1.3 % / +1.8 % / +2.5 % at k = 0 / 2 / 4 (a constant 26,880 B: the 512-byte rounding of
    # the removed optimizer tensors), never below; host bytes equal the formula up to the step counters.
    from model.curve import MemoryPredictor
    from model.terms import TermsCache, terms_key
    from tracer.collect import measure_family
    from tracer.phases import trace_terms

    cfg = {**TINY_LLAMA, "num_hidden_layers": 4}
    tr = TrainingConfig(
        micro_batch_size=2, seq_len=64, precision="bf16_fp32_master", optimizer="adamw_fused", offload_optimizer="cpu"
    )
    base = TrainingConfig.model_validate({**tr.model_dump(), "offload_optimizer": "none"})
    terms = TermsCache(shipped_dir=None)
    terms.put(terms_key(cfg, base), trace_terms(cfg, base).to_json())
    records = list(measure_family(cfg, tr, [[], [0, 1], [0, 1, 2, 3]], device="cpu", steps=2))
    curve = MemoryPredictor(None, terms).curve(records[0].model, tr, cfg)
    assert curve.path == "traced"
    for r in records:
        k, measured = r.training.num_checkpointed_layers, r.measurement.peak_allocated_bytes
        predicted = curve.points[k].predicted_bytes
        assert measured <= predicted <= measured * 1.03, (k, measured, predicted)
        assert curve.points[k].breakdown["optimizer_states_bytes"] == 0
        host = host_bytes_per_rank(r.model, tr)
        assert host <= r.measurement.host_peak_bytes <= host + 512
    assert resolve(cfg, tr).host_memory_bytes(1) == host_memory_bytes(records[0].model, tr)


def test_public_case_on_the_provisional_path_ranks_the_same():
    # Without traced terms for this configuration (a service that has not traced it yet) the answer is
    # provisional, and still: no k fits, optimizer offload first, the same host memory.
    loaded = Registry().load()
    rec = Recommender(loaded.estimator, loaded.version).recommend(
        RecommendRequest.model_validate(
            {
                "model": "llama-3-8b",
                "training": {"micro_batch_size": 1, "seq_len": 128, "precision": "bf16_fp32_master"},
                "cluster": {"gpu": "A100-80GB"},
            }
        )
    )
    assert not rec.fits and rec.path == "provisional"
    first = rec.alternatives[0]
    assert first.change == {"offload_optimizer": "cpu"} and first.fits and first.path == "provisional"
    assert first.host_memory_bytes == int(16 * 8_030_261_248 * 1.5)


def test_offloaded_paged_optimizer_says_nothing_of_unified_memory():
    # a paged 8-bit optimizer's states live in CUDA unified memory; offloaded, they are in host memory instead
    from data import catalog
    from model.curve import MemoryPredictor
    from model.terms import TermsCache

    predictor = MemoryPredictor(None, TermsCache())
    spec, hf = catalog.spec("gpt2"), catalog.get("gpt2")["hf_config"]
    paged = TrainingConfig(micro_batch_size=2, seq_len=512, precision="amp_bf16", optimizer="paged_adamw_8bit")
    on_device = predictor.curve(spec, paged, hf)
    assert on_device.path == "traced" and any("unified memory" in n for n in on_device.notes)
    offloaded = predictor.curve(spec, paged.model_copy(update={"offload_optimizer": Offload.CPU}), hf)
    assert offloaded.path == "traced" and not any("unified memory" in n for n in offloaded.notes)
    assert offloaded.points[0].breakdown["optimizer_states_bytes"] == 0  # the states are on the host
    assert on_device.points[0].breakdown["optimizer_states_bytes"] > 0


def test_provisional_parameter_offload_curve_follows_its_traced_composition(recommender):
    # Llama-3-8B, ZeRO-3 over 8 ranks with optimizer and parameter offload: the traced composition (the FSDP full-shard
    # terms less the resident shards) against the provisional curve (the learned base scaled by the analytic
    # offloaded / not-offloaded backward peak). Scaled by the base's peak, its optimizer step, it was 0.77-0.93 of it.
    request = RecommendRequest.model_validate(
        {
            "model": "llama-3-8b",
            "training": ZERO3_FULL_OFFLOAD_TRAINING,
            "cluster": {"gpu": "H200", "gpu_count": 8},
        }
    )
    traced = recommender.recommend(request)
    loaded = Registry().load()
    provisional = Recommender(
        loaded.estimator, loaded.version, telemetry_range=loaded.meta.get("telemetry_range")
    ).recommend(request)
    assert traced.path == "traced" and provisional.path == "provisional"
    for t, p in zip(traced.curve, provisional.curve, strict=True):
        assert 0.9 * t.predicted_bytes <= p.predicted_bytes <= 1.2 * t.predicted_bytes, t.k
        assert p.upper_bytes >= t.predicted_bytes, t.k


def test_optimizer_offload_with_tensor_parallelism_subtracts_one_ranks_states():
    """The offload composition subtracted the whole model's resident states from a tensor-parallel rank's phases
    and took the whole model's states as the floor: Llama-3.2-1B bf16 + fp32 master, tp 2, optimizer offloaded,
    said 4.60 GiB flat at every k (weights and gradients of both ranks, activations 0). It is one rank's now:
    below the same job without offload at every k, and checkpointing buys memory down again."""
    from data import catalog
    from model.analytic import model_state_bytes as states_of
    from model.analytic import tensor_parallel_rank_spec
    from model.curve import MemoryPredictor

    loaded = Registry().load()
    predictor = MemoryPredictor(loaded.estimator, TermsCache(), coefficients=loaded.coefficients)
    spec, hf = catalog.spec("llama-3.2-1b"), catalog.hf_config_of("llama-3.2-1b")
    tp2 = TrainingConfig(micro_batch_size=2, seq_len=1024, precision="bf16_fp32_master", tensor_parallel_size=2)
    off = tp2.model_copy(update={"offload_optimizer": Offload.CPU})
    offloaded, resident = predictor.curve(spec, off, hf), predictor.curve(spec, tp2, hf)
    rank = states_of(tensor_parallel_rank_spec(spec, off), off)
    assert offloaded.floor_bytes == rank.total_bytes < states_of(spec, off).total_bytes
    assert all(o.predicted_bytes < r.predicted_bytes for o, r in zip(offloaded.points, resident.points))
    assert offloaded.points[0].predicted_bytes > offloaded.points[-1].predicted_bytes
    assert offloaded.points[0].breakdown["activations_bytes"] > 0


def test_host_memory_adds_up_each_rank_s_own_share_on_the_node(recommender):
    """Host memory per node was the whole model's offloaded states times the ranks on the node, also where each
    rank holds a tensor- or pipeline-parallel shard: Llama-3.2-1B over 2 tensor-parallel ranks asked for 59.3 GB
    of host memory, twice what the node holds (one model, split in two). A rank offloads its own share
    (model.job.Job.host_memory_bytes)."""

    def answer(tp: int, pp: int, gpus: int):
        req = RecommendRequest.model_validate(
            {
                "model": "llama-3.2-1b",
                "training": {
                    "micro_batch_size": 1,
                    "seq_len": 1024,
                    "precision": "bf16_fp32_master",
                    "offload_optimizer": "cpu",
                    "tensor_parallel_size": tp,
                    "pipeline_parallel_size": pp,
                },
                "cluster": {"gpu": "A100-80GB", "gpu_count": gpus},
            }
        )
        return recommender.recommend(req)

    one, tp2, pp2, dp2 = answer(1, 1, 1), answer(2, 1, 2), answer(1, 2, 2), answer(1, 1, 2)
    # one GPU: 16 B per parameter (fp32 AdamW moments, master, gradient copy) x 1.5 buffer
    assert one.host_memory_bytes == int(16 * one.parameters_per_rank * 1.5)
    # two tensor-parallel halves on the node: one model (plus the norms every rank keeps whole), not two
    assert one.host_memory_bytes <= tp2.host_memory_bytes < 1.001 * one.host_memory_bytes
    assert tp2.host_memory_bytes == int(2 * 16 * tp2.parameters_per_rank * 1.5)
    # two pipeline stages: twice the fuller stage (the last keeps its own copy of the tied embedding)
    assert pp2.host_memory_bytes == int(2 * 16 * pp2.parameters_per_rank * 1.5)
    assert pp2.host_memory_bytes < dp2.host_memory_bytes
    # two data-parallel replicas without sharding: each offloads the whole model's states
    assert dp2.host_memory_bytes == 2 * one.host_memory_bytes
