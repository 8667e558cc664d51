"""Public cases for tensor / pipeline / context parallelism (issue 9), on the shipped model and terms."""

from __future__ import annotations

import pytest

from memfit.api import RecommendRequest
from model.analytic import replicated_params
from model.job import resolve_architecture
from model.recommend import layer_indices
from model.registry import Registry
from service.recommender import Recommender

GIB = 1 << 30


@pytest.fixture(scope="module")
def recommender() -> Recommender:
    loaded = Registry().load()
    return Recommender(loaded.estimator, loaded.version, telemetry_range=loaded.meta.get("telemetry_range"))


def _llama3_8b(recommender, gpu="A100-40GB", **training):
    req = RecommendRequest.model_validate(
        {
            "model": "llama-3-8b",
            "training": {"micro_batch_size": 1, "seq_len": 8192, **training},
            "cluster": {"gpu": gpu, "gpu_count": 8},
        }
    )
    return recommender.recommend(req)


def test_llama_3_8b_tensor_parallel_8_holds_an_eighth_per_gpu(recommender):
    # Llama-3-8B with TP = 8 on 8 GPUs: about 1/8 of the parameters per GPU (replicated norms aside), and a
    # k recommendation per rank. Before issue 9 nothing was divided and it "did not fit".
    rec = _llama3_8b(recommender, tensor_parallel_size=8)
    total = 8_030_261_248
    norms = replicated_params(resolve_architecture("llama-3-8b").spec)  # 65 RMSNorm weights of 4096
    assert rec.path == "traced"  # DTensor TP traced over a fake process group (shipped terms)
    per_rank = rec.parameters_per_rank
    assert abs(per_rank - total / 8) <= norms  # an eighth, but for the norms every rank holds whole
    assert per_rank == norms + -(-(total - norms) // 8)
    assert rec.breakdown["parameters_bytes"] == 4 * per_rank  # fp32 weights under bf16 autocast
    assert rec.breakdown["optimizer_states_bytes"] == 8 * per_rank  # AdamW moments of this rank's shard
    assert rec.fits and 0 < rec.k < 32  # a real choice of k per rank on a 40 GB card
    assert rec.total_upper_bytes <= rec.usable_bytes < rec.curve[0].total_upper_bytes
    assert any("fake process group of 8 ranks" in w for w in rec.warnings)


def test_llama_3_8b_without_tensor_parallel_does_not_fit(recommender):
    rec = _llama3_8b(recommender)  # one rank holds all 8B parameters: 16 B each of states
    assert not rec.fits
    tp8 = _llama3_8b(recommender, tensor_parallel_size=8)
    assert tp8.curve[-1].predicted_bytes < rec.curve[-1].predicted_bytes / 6


def test_sequence_parallel_divides_the_activations_between_blocks(recommender):
    tp = _llama3_8b(recommender, tensor_parallel_size=8)
    sp = _llama3_8b(recommender, tensor_parallel_size=8, sequence_parallel=True)
    assert sp.path == "traced"
    # same states, fewer activations at k = 0 (norm inputs and residuals held as sequence shards)
    assert sp.curve[0].predicted_bytes < tp.curve[0].predicted_bytes - 5 * GIB
    assert sp.k is not None and sp.k < tp.k


def test_llama_3_8b_pipeline_8_recommends_k_per_stage(recommender):
    rec = _llama3_8b(recommender, "A100-80GB", pipeline_parallel_size=8, num_micro_batches=16)
    assert rec.path == "traced"
    assert [s.num_layers for s in rec.stages] == [4] * 8
    assert [s.micro_batches_in_flight for s in rec.stages] == [8, 7, 6, 5, 4, 3, 2, 1]  # 1F1B: pp - i
    assert rec.fits
    # the first stage holds the most micro-batches: it needs the most checkpointing and is the bottleneck
    ks = [s.k for s in rec.stages]
    assert ks[0] == max(ks) and ks[0] > ks[-2]
    assert sum(ks) == rec.k and len(rec.layers) == rec.k
    assert rec.layers[: ks[0]] == list(range(ks[0]))  # the first k_i layers of each stage (Megatron "block")
    assert rec.predicted_peak_bytes >= max(s.predicted_peak_bytes for s in rec.stages) - GIB // 1024
    # each stage's rank holds about an eighth of the layers' parameters, plus embedding (first) or head (last)
    assert rec.stages[0].parameters == rec.stages[-1].parameters
    layer_params = (8_030_261_248 - 2 * 128_256 * 4096 - 4096) // 32  # 218.1 M per decoder layer
    assert abs(rec.stages[3].parameters - 4 * layer_params) <= 4096
    assert rec.stages[0].parameters - rec.stages[3].parameters == 128_256 * 4096  # + the embedding


def test_qwen25_72b_tensor_8_by_zero3_data_8_holds_a_64th_of_the_states(recommender):
    # issue 9: Qwen2.5-72B with TP 8 x DP 8 + ZeRO-3 was given 135 GiB of states per GPU instead of about 17
    # (the provisional path counted the whole model's states on every rank) and "did not fit" on H100s
    req = RecommendRequest.model_validate(
        {
            "model": "qwen2.5-72b",
            "training": {"micro_batch_size": 1, "seq_len": 4096, "sharding": "zero3", "tensor_parallel_size": 8},
            "cluster": {"gpu": "H100-80GB", "gpu_count": 64},
        }
    )
    rec = recommender.recommend(req)
    per_rank = rec.parameters_per_rank
    assert per_rank == pytest.approx(72.7e9 / 8, rel=0.01)
    # fp32 weights and AdamW moments of the rank's TP shard, / 8 ZeRO-3 ranks (gradients not yet made at the
    # peak, in the head's backward): 4 + 8 bytes of 9.09 B / 8 = 12.7 GiB, not 135 GiB
    assert rec.peak_phase == "bwd.head" and rec.breakdown["gradients_bytes"] == 0
    assert rec.breakdown["parameters_bytes"] == pytest.approx(4 * per_rank / 8, rel=0.001)
    assert rec.breakdown["optimizer_states_bytes"] == pytest.approx(8 * per_rank / 8, rel=0.001)
    # traced on a 2-D (dp 8, tp 8) mesh (shipped terms): activations without sequence parallelism are ~0.55 GiB
    # per layer and rank at seq 4096, so every layer un-checkpointed still fits an H100 (65 GiB, bound 73 GiB)
    assert rec.path == "traced"
    assert any("fake process group of 8 ranks" in w for w in rec.warnings)
    assert 60 * GIB < rec.curve[0].predicted_bytes < 70 * GIB and rec.curve[-1].predicted_bytes < 25 * GIB
    assert rec.fits and rec.k == 0


def test_even_layout_spreads_each_stages_k_over_that_stage(recommender):
    # a new user asked layout "even" with 3 pipeline stages and got the "block" layers [0, 1, 2, 3, 4]: the layout
    # was applied only without pipeline parallelism
    def ask(layout):
        req = RecommendRequest.model_validate(
            {
                "model": "llama-3-8b",
                "training": {"micro_batch_size": 1, "seq_len": 8192, "pipeline_parallel_size": 4},
                "cluster": {"gpu": "A100-80GB", "gpu_count": 4},
                "layout": layout,
            }
        )
        return recommender.recommend(req)

    block, even = ask("block"), ask("even")
    assert block.k == even.k and [s.k for s in block.stages] == [s.k for s in even.stages]
    assert block.layers != even.layers and len(even.layers) == even.k
    for stage in even.stages:  # the same count per stage, evenly spaced within it (first and last layer at k >= 2)
        first = sum(s.num_layers for s in even.stages[: stage.stage])
        mine = [i - first for i in even.layers if first <= i < first + stage.num_layers]
        assert mine == layer_indices(stage.k, stage.num_layers, 1, "even")
        if stage.k >= 2:
            assert mine[0] == 0 and mine[-1] == stage.num_layers - 1
