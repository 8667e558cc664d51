"""memfit against the real frameworks on CPU: DeepSpeed, PEFT and Megatron-Core (``memfit[frameworks]``).

* DeepSpeed: the patch drives the real ``deepspeed.checkpointing.checkpoint``; the generated
  ``activation_checkpointing`` block goes through DeepSpeed's own parsers; the HF Trainer runs with a
  DeepSpeed config (ZeRO stage 0, one CPU process, in a subprocess so its process group stays there).
* PEFT: ``describe()`` on LoRA models built with ``peft``; the frozen-embedding trap on a real LoRA model.
* Megatron-Core: the per-stage recompute fields are accepted by ``TransformerConfig`` (import only).

What needs a GPU and is not run here: ZeRO-3 parameter partitioning itself (DeepSpeed's CPU
accelerator runs ZeRO-3 only with its own comm backend), ``partition_activations`` /
``cpu_checkpointing`` (they move activations between model-parallel ranks and host), measured CUDA
peaks, and Megatron's ``TransformerBlock`` forward (needs Transformer Engine or CUDA kernels).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from memfit.api import Recommendation, RecommendRequest, StageOut
from memfit.checkpointing import CheckpointPlan, MemfitWarning, apply, checkpoint_layers
from memfit.client import fallback_recommendation
from memfit.hf import build_causal_lm, decoder_layers, quiet_transformers
from tests.helpers import TINY_LLAMA

ROOT = Path(__file__).resolve().parent.parent
deepspeed = pytest.importorskip("deepspeed")


def rec_for(layers: list[int], num_layers: int = 4, k: int | None = -1, pp: int = 1) -> Recommendation:
    """A hand-made answer; with pp > 1 it carries the service's per-stage split (even stages here)."""
    per = num_layers // pp
    stages = [
        StageOut(
            stage=s,
            first_layer=s * per,
            num_layers=per,
            k=sum(s * per <= i < (s + 1) * per for i in layers),
            micro_batches_in_flight=float(pp - s),
            predicted_peak_bytes=1,
            parameters=1,
        )
        for s in range(pp)
        if pp > 1
    ]
    return Recommendation(
        stages=stages,
        fits=k is not None,
        k=len(layers) if k == -1 else k,
        layers=layers,
        num_layers=num_layers,
        predicted_peak_bytes=1,
        upper_bound_bytes=1,
        total_upper_bytes=1,
        capacity_bytes=1,
        usable_bytes=1,
        curve=[],
        breakdown={},
        overhead={},
        recompute_overhead_fraction=0.0,
        model_version="0007",
        training={"pipeline_parallel_size": pp},
    )


# -- DeepSpeed: the patch over the real deepspeed.checkpointing -----------------------------------------
class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MegatronDeepSpeedStyle(nn.Module):
    """A Megatron-DeepSpeed-style model: every layer goes through ``deepspeed.checkpointing.checkpoint``
    (looked up at call time) when checkpointing is on."""

    def __init__(self, num_layers: int = 4, d: int = 32, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(num_layers))
        self.head = nn.Linear(d, vocab)
        self.checkpointing = True

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = deepspeed.checkpointing.checkpoint(layer, h) if self.checkpointing else layer(h)
        return self.head(h)


def count_backward_forwards(model) -> dict[int, int]:
    """Per layer, how many times its forward ran inside a backward pass (= recomputed)."""
    counts = {i: 0 for i in range(len(model.layers))}
    for i, layer in enumerate(model.layers):

        def hook(_mod, _inp, _out, i=i):
            counts[i] += int(torch._C._current_graph_task_id() != -1)

        layer.register_forward_hook(hook)
    return counts


def ds_step(model, seed: int = 1) -> None:
    torch.manual_seed(seed)
    ids = torch.randint(0, 64, (3, 16))
    nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()


def test_deepspeed_patch_recomputes_exactly_k_of_L_with_the_real_module_and_equal_gradients():
    torch.manual_seed(0)
    ref = MegatronDeepSpeedStyle()
    ref.checkpointing = False
    model = copy.deepcopy(ref)
    model.checkpointing = True
    ds_step(ref)

    real = deepspeed.checkpointing.checkpoint
    counts = count_backward_forwards(model)
    with patch_deepspeed([0, 2]) as patch:
        ds_step(model)
        assert counts == {0: 1, 1: 0, 2: 1, 3: 0}  # k=2 of L=4 recomputed in the first backward
        assert patch.plan.recomputed == {0, 2} and patch.plan.verify()
        assert patch.original is real  # the real DeepSpeed function ran the chosen layers
    assert deepspeed.checkpointing.checkpoint is real  # undone
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7), name

    counts_all = count_backward_forwards(ref2 := copy.deepcopy(model))
    ref2.zero_grad()
    ds_step(ref2)  # unpatched real DeepSpeed: every layer recomputes
    assert counts_all == {0: 1, 1: 1, 2: 1, 3: 1}


def patch_deepspeed(layers):
    from memfit.integrations.deepspeed import patch_deepspeed_checkpointing

    return patch_deepspeed_checkpointing(rec_for(layers))


def test_deepspeed_helpers_take_the_fallback_for_a_catalog_model_name():
    """Reproduces issue 11: the fallback made for a request that named a catalog model used to have no
    layer count, so the patch raised and the config block said "nothing fits"."""
    from memfit.integrations.deepspeed import deepspeed_activation_checkpointing_config, patch_deepspeed_checkpointing
    from memfit.integrations.megatron import megatron_flags, megatron_recompute_config

    req = RecommendRequest(
        model="llama-3-8b", training={"micro_batch_size": 1, "seq_len": 4096}, cluster={"gpu": "H100-80GB"}
    )
    fb = fallback_recommendation(req, "unreachable")
    assert fb.num_layers == 32 and fb.layers == list(range(32))  # read from the catalog
    block = deepspeed_activation_checkpointing_config(fb)["activation_checkpointing"]
    assert block["number_checkpoints"] == 32
    assert megatron_flags(fb)[-1] == "32"

    unknown = fallback_recommendation(req.model_copy(update={"model": "my-private-model"}), "unreachable")
    assert unknown.num_layers == 0
    assert deepspeed_activation_checkpointing_config(unknown)["activation_checkpointing"]["number_checkpoints"] is None
    assert megatron_recompute_config(unknown) == [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    ]

    torch.manual_seed(0)
    model = MegatronDeepSpeedStyle()
    counts = count_backward_forwards(model)
    for fallback in (fb, unknown):  # neither raises; every layer of the live model recomputes
        for c in counts:
            counts[c] = 0
        with warnings.catch_warnings():
            warnings.simplefilter("error", MemfitWarning)
            with patch_deepspeed_checkpointing(fallback) as patch:
                ds_step(model)
                assert counts == {0: 1, 1: 1, 2: 1, 3: 1}
                assert patch.plan.recomputed == {0, 1, 2, 3}
                ds_step(model)  # a second step re-uses the learned layer count
                assert patch.plan.verify() and patch.plan.layer_indices == [0, 1, 2, 3]


def test_activation_checkpointing_block_is_what_deepspeeds_parsers_read():
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
    from deepspeed.runtime.config import DeepSpeedConfig

    from memfit.integrations.deepspeed import deepspeed_activation_checkpointing_config

    block = deepspeed_activation_checkpointing_config(rec_for([0, 1, 2], num_layers=8))
    parsed = vars(DeepSpeedActivationCheckpointingConfig(block))
    assert parsed == block["activation_checkpointing"]  # every key known to DeepSpeed, every value kept
    full = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **block})
    assert full.activation_checkpointing_config.number_checkpoints == 3
    # DeepSpeed ignores keys it does not know: the equality above is what proves none of ours is ignored
    assert (
        vars(DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": {"bogus": 1}}))["number_checkpoints"]
        is None
    )


@pytest.mark.timeout(900)
def test_hf_trainer_with_a_deepspeed_config_applies_and_verifies_the_plan():
    """HF Trainer + DeepSpeed (ZeRO-0, one CPU process): the callback applies k=2 of 4 after DeepSpeed
    wrapped the model, exactly those layers recompute, and training matches the un-checkpointed run."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "ds_trainer_job.py")],
        capture_output=True,
        text=True,
        timeout=850,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["plan_layers"] == [0, 1] and result["recomputed"] == [0, 1] and result["verified"] is True
    assert result["engine"] == "DeepSpeedEngine"
    assert result["max_param_diff"] < 1e-5  # same training with and without the plan
    # bf16 "auto" resolves to TrainingArguments.bf16 (off): DeepSpeed trains in fp32
    assert result["described"] == {"precision": "fp32", "micro_batch_size": 2, "sharding": "none"}
    assert result["hf_block_warning"] and "no effect on a HF transformers model" in result["hf_block_warning"]


# -- PEFT -------------------------------------------------------------------------------------------------
peft = pytest.importorskip("peft")


def llama(layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    with quiet_transformers():
        return build_causal_lm({**TINY_LLAMA, "num_hidden_layers": layers})


def lora(model, r: int = 4, targets=("q_proj", "v_proj"), **kw):
    targets = targets if isinstance(targets, str) else list(targets)
    return peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=targets, **kw))


def test_describe_reads_rank_targets_and_trainable_count_from_peft():
    from memfit.describe import describe

    model = lora(llama(), r=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    trainable, _total = model.get_nb_trainable_parameters()
    req = describe(model, seq_len=64, micro_batch_size=2, gpu="L4")
    t = req.training
    assert (t.finetune.value, t.lora_rank) == ("lora", 8)
    assert t.lora_target_modules == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert t.trainable_params == trainable
    # per layer: q (64->64), k (64->32), v (64->32), o (64->64); r x (in + out) each
    assert trainable == 4 * 8 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64))
    assert req.model["num_hidden_layers"] == 4  # the base model's HF config, through the PEFT wrapper

    for targets in (r".*\.(q_proj|v_proj)", "all-linear"):  # a regex; PEFT resolves all-linear to full paths
        req = describe(lora(llama(), targets=targets), seq_len=64, micro_batch_size=2, gpu="L4")
        assert req.training.lora_target_modules == (
            ["q_proj", "v_proj"]
            if "|" in targets
            else ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        ), targets

    model.add_adapter("wide", peft.LoraConfig(r=16, target_modules=["gate_proj"]))
    model.set_adapter("wide")
    req = describe(model, seq_len=64, micro_batch_size=2, gpu="L4")
    assert (req.training.lora_rank, req.training.lora_target_modules) == (16, ["gate_proj"])


def test_describe_models_a_bitsandbytes_base_and_warns_for_other_quantization():
    """Issue 9: a bitsandbytes 4-bit base under LoRA is QLoRA (``quantization``), no longer a warning; methods
    memfit does not model (GPTQ) still warn."""
    import warnings

    from memfit.describe import describe
    from memfit.schema import Quantization

    model = llama()
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemfitWarning)
        req = describe(lora(model), seq_len=64, micro_batch_size=1, gpu="L4")
    assert req.training.quantization is Quantization.NF4
    other = llama()
    other.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.warns(MemfitWarning, match="quantized \\(gptq\\).*does not model"):
        describe(lora(other), seq_len=64, micro_batch_size=1, gpu="L4")


def test_reentrant_checkpointing_of_a_real_lora_model_loses_gradients_and_apply_fixes_it():
    def lora_b_grads(model):
        return [p.grad for n, p in model.named_parameters() if "lora_B" in n and ".layers.0." in n]

    def step(model):
        torch.manual_seed(1)
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()

    bare = lora(llama())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that no input requires grad: that is the trap
        checkpoint_layers(bare, [0, 1], use_reentrant=True)  # the mechanism alone, no trap guard
        step(bare)
    assert all(g is None for g in lora_b_grads(bare))  # silently no gradients for the adapters

    fixed = lora(llama())
    with pytest.warns(MemfitWarning, match="enable_input_require_grads"):
        plan = apply(fixed, rec_for([0, 1]), use_reentrant=True)
    step(fixed)
    assert plan.recomputed == {0, 1}
    assert all(g is not None and g.abs().sum() > 0 for g in lora_b_grads(fixed))


# -- Megatron-Core ----------------------------------------------------------------------------------------
def transformer_config(**fields):
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" etc.
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4, **fields)


def test_megatron_recompute_fields_per_stage_are_accepted_by_transformer_config():
    from memfit.integrations.megatron import megatron_recompute_config

    # pp=2, k=3 of 8 in the block layout: stage 0 takes layers 0-1, stage 1 layer 4
    stages = megatron_recompute_config(rec_for([0, 1, 4], num_layers=8, pp=2))
    assert [s["recompute_num_layers"] for s in stages] == [2, 1]
    for rank, fields in enumerate(stages):
        config = transformer_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.bfloat16, **fields)
        assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
            "full",
            "block",
            [2, 1][rank],
        )

    stages = megatron_recompute_config(rec_for([0, 1], num_layers=8, pp=2))  # stage 1 checkpoints nothing
    config = transformer_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.bfloat16, **stages[1])
    assert config.recompute_granularity is None
    every = megatron_recompute_config(fallback_recommendation(None, "down"))[0]
    config = transformer_config(**every)
    assert (config.recompute_method, config.recompute_num_layers) == ("uniform", 1)
    with pytest.raises(ValueError, match="not its first 1"):
        megatron_recompute_config(rec_for([0, 5], num_layers=8, pp=2))


def test_megatron_interleaved_schedule_counts_per_model_chunk():
    """Under interleaved 1F1B a rank holds `chunks` TransformerBlocks (rank 0 of pp 2 with 2 chunks of 8 layers:
    layers 0-1 and 4-5), and the block method recomputes the first recompute_num_layers of each: a stage planned
    for 3 layers gets 2 per chunk (4 recomputed, never fewer than planned), not 3 per chunk (6)."""
    from memfit.integrations.megatron import megatron_flags, megatron_recompute_config

    rec = rec_for([0, 1, 2, 4], num_layers=8, pp=2)
    rec.training = {"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b", "pipeline_chunks_per_rank": 2}
    stages = megatron_recompute_config(rec)
    assert [s["recompute_num_layers"] for s in stages] == [2, 1]
    assert megatron_flags(rec)[-1] == "2"
    fields = stages[0]
    config = transformer_config(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.bfloat16,
        **fields,
    )
    assert (config.recompute_method, config.recompute_num_layers) == ("block", 2)
    assert (
        megatron_recompute_config([0, 1, 2, 4], num_layers=8, pipeline_parallel_size=2)[0]["recompute_num_layers"] == 3
    )
    with pytest.raises(ValueError, match="pipeline_chunks_per_rank=3 must be >= 1 and divide the 4 layers"):
        megatron_recompute_config(rec, pipeline_chunks_per_rank=3)


def test_megatron_settings_match_what_apply_checkpoints():
    """One plan, two readers: Megatron's block fields name the same layers apply() checkpoints."""
    from memfit.integrations.megatron import megatron_recompute_config

    rec = rec_for([0, 1], num_layers=4)
    model = llama()
    plan = apply(model, rec)
    (fields,) = megatron_recompute_config(rec)
    assert plan.layer_indices == list(range(fields["recompute_num_layers"]))
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, True, False, False]


# -- one pipeline stage per process, saved answers, bad plans (a new user's trial, 2026-12-06) ----------------------
def test_a_pipeline_stage_checkpoints_its_own_layers_at_every_step():
    """A 2-stage answer for 8 layers that checkpoints layers 0-2 (stage 0) and 4 (stage 1), carried out in a process
    that runs one 4-layer stage. The patch counted calls modulo the whole model's 8 layers: step 0 recomputed
    layers 0-2 and step 1 none, with verify() passing after step 0."""
    from memfit.integrations.deepspeed import patch_deepspeed_checkpointing

    rec = rec_for([0, 1, 2, 4], num_layers=8, pp=2)
    with pytest.raises(ValueError, match=r"pipeline_stage: .*pipeline_parallel_size=2.*0\.\.1"):
        patch_deepspeed_checkpointing(rec)
    with pytest.raises(ValueError, match=r"pipeline_stage: .*pipeline_parallel_size=2"):  # a saved --json answer
        patch_deepspeed_checkpointing(rec.model_dump(mode="json"))
    assert CheckpointPlan.from_recommendation(rec.model_dump(mode="json")).pipeline_parallel_size == 2
    assert CheckpointPlan.from_recommendation(rec, pipeline_stage=1).pipeline_parallel_size == 2
    assert CheckpointPlan.from_recommendation([0, 1]).pipeline_parallel_size == 1
    for stage, expected in ((0, {0, 1, 2}), (1, {0})):
        torch.manual_seed(0)
        model = MegatronDeepSpeedStyle()  # this process's stage: 4 layers
        counts = count_backward_forwards(model)
        with patch_deepspeed_checkpointing(rec.model_dump(mode="json"), pipeline_stage=stage) as patch:
            assert patch.plan.num_layers == 4 and patch.plan.layer_indices == sorted(expected)
            for step in range(3):
                for c in counts:
                    counts[c] = 0
                ds_step(model, seed=step)
                assert {i for i, n in counts.items() if n} == expected, f"stage {stage} step {step}"
    with pytest.raises(ValueError, match=r"pipeline_stage=2 must be an integer in \[0, 1\]"):
        patch_deepspeed_checkpointing(rec, pipeline_stage=2)
    no_stages = rec_for([0], num_layers=4)  # every layer, with a warning: a job is never broken
    with (
        pytest.warns(MemfitWarning, match="carries no pipeline stages"),
        patch_deepspeed_checkpointing(no_stages, pipeline_stage=0, num_layers=4) as patch,
    ):
        assert patch.plan.k == 4
    with pytest.raises(ValueError, match="carries no pipeline stages"):
        patch_deepspeed_checkpointing(rec_for([0], num_layers=4), pipeline_stage=0, strict=True)
    # the client's fallback (service unreachable) for a pipeline job: every layer of the stage, never an error
    req = RecommendRequest(
        model="llama-3-8b",
        training={"micro_batch_size": 1, "seq_len": 4096, "pipeline_parallel_size": 2},
        cluster={"gpu": "H100-80GB", "gpu_count": 2},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemfitWarning)
        with patch_deepspeed_checkpointing(fallback_recommendation(req, "unreachable")) as patch:
            assert patch.plan.layer_indices == [] and patch.plan.num_layers == 0  # every call checkpointed
        with patch_deepspeed_checkpointing(fallback_recommendation(req, "unreachable"), pipeline_stage=1) as patch:
            assert patch.plan.num_layers == 0
        assert apply(MegatronDeepSpeedStyle(), fallback_recommendation(req, "unreachable"), pipeline_stage=1).k == 4

    plain = MegatronDeepSpeedStyle()
    plain.checkpointing = False
    applied = apply(plain, rec, pipeline_stage=1)  # memfit.apply on a stage module: the same reading
    assert applied.layer_indices == [0] and applied.num_layers == 4
    with pytest.warns(MemfitWarning, match="pass pipeline_stage="):
        assert apply(MegatronDeepSpeedStyle(), rec).k == 4  # a stage without its index: every layer


def test_a_saved_pipeline_answer_gives_every_stage_its_megatron_fields():
    from memfit.integrations.megatron import megatron_recompute_config

    rec = rec_for([0, 1, 2, 4], num_layers=8, pp=2)
    saved = json.loads(rec.model_dump_json())  # `memfit recommend --json` output, read back
    assert megatron_recompute_config(saved) == megatron_recompute_config(rec)
    assert [f["recompute_num_layers"] for f in megatron_recompute_config(saved)] == [3, 1]


def test_patches_undone_in_any_order_restore_deepspeed_and_evaluation_forwards_are_not_counted():
    from memfit.integrations.deepspeed import patch_deepspeed_checkpointing

    real = deepspeed.checkpointing.checkpoint
    p1 = patch_deepspeed_checkpointing([0], num_layers=4)
    p2 = patch_deepspeed_checkpointing([1], num_layers=4)
    p1.undo()
    torch.manual_seed(0)
    model = MegatronDeepSpeedStyle()
    counts = count_backward_forwards(model)
    ds_step(model)
    assert {i for i, n in counts.items() if n} == {1}  # the later patch still rules
    p2.undo()
    assert deepspeed.checkpointing.checkpoint is real

    # the client's fallback for an unknown model learns the layer count from the first training step; an
    # evaluation forward under no_grad before it made the plan 8 layers of a 4-layer model
    from memfit.client import fallback_recommendation

    req = RecommendRequest(
        model="my-private-model", training={"micro_batch_size": 1, "seq_len": 16}, cluster={"gpu": "H100-80GB"}
    )
    with patch_deepspeed_checkpointing(fallback_recommendation(req, "unreachable")) as patch:
        with torch.no_grad():
            model(torch.randint(0, 64, (2, 8)))
        ds_step(model)
        ds_step(model)
        assert patch.plan.layer_indices == [0, 1, 2, 3] and patch.plan.verify()


def test_plans_that_cannot_be_carried_out_are_refused():
    model = MegatronDeepSpeedStyle()
    model.checkpointing = False
    with pytest.raises(ValueError, match="not one of the model's modules"):
        apply(model, [0, 1], layers=list(model.layers))  # a Python list: the model would stay unchanged
    for bad in ([True], ["1"], [1.5], "1"):
        with pytest.raises(ValueError, match=r"a list of layer indices \(ints >= 0\)"):
            apply(model, bad)
    with pytest.raises(ValueError, match=r"k=5 must be an integer in \[0, 4\]"):
        apply(model, 5)
    assert apply(model, 3).layer_indices == [0, 1, 2]  # an integer is k: the first k layers
    assert apply(model, np.array([2, 0])).layer_indices == [0, 2]
    assert apply(model, np.int64(1)).layer_indices == [0]
    with pytest.warns(MemfitWarning, match="recommendation is for 12 layers but the model has 4"):
        assert apply(model, CheckpointPlan((0, 1), num_layers=12)).k == 4
    from memfit.integrations.deepspeed import deepspeed_activation_checkpointing_config

    assert (
        deepspeed_activation_checkpointing_config(2, num_layers=4)["activation_checkpointing"]["number_checkpoints"]
        == 2
    )
    with pytest.raises(ValueError, match=r"a list of layer indices \(ints >= 0\)"):
        deepspeed_activation_checkpointing_config(2.0, num_layers=4)


def test_a_pipeline_size_megatron_cannot_split_evenly_is_refused_with_the_reason():
    from memfit.integrations.megatron import megatron_recompute_config

    # the service answers 5 stages of 32 layers (6/6/6/7/7); Megatron-Core's stages are num_layers / pp each
    with pytest.raises(ValueError, match=r"num_layers=32 must be divisible by pipeline_parallel_size=5: Megatron-Core"):
        megatron_recompute_config(rec_for([0, 1], num_layers=32, pp=5))
