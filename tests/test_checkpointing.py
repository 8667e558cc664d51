"""memfit.apply / verify on live models, the traps, the HF Trainer callback, the DeepSpeed patch.

Models are tiny (2-4 layers, hidden 64) and run on CPU in well under a second per step.
"""

from __future__ import annotations

import copy
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.api import Recommendation
from memfit.checkpointing import MemfitWarning, apply, apply_activation_checkpointing, frozen_input_trap, verify
from memfit.client import fallback_recommendation
from memfit.hf import build_causal_lm, decoder_layers, quiet_transformers
from memfit.integrations.deepspeed import (
    check_deepspeed_config,
    deepspeed_activation_checkpointing_config,
    patch_deepspeed_checkpointing,
    standin_checkpointing,
)
from memfit.integrations.megatron import megatron_flags
from tests.helpers import TINY_LLAMA


def llama(layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    with quiet_transformers():
        return build_causal_lm({**TINY_LLAMA, "num_hidden_layers": layers})


def rec_for(layers: list[int], num_layers: int = 4, k: int | None = -1) -> Recommendation:
    """A service-shaped answer with the given layers (byte figures irrelevant here)."""
    return Recommendation(
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
    )


def step(model, seed: int = 1):
    torch.manual_seed(seed)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def grads(model) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


# -- the plan: one reader of a recommendation --------------------------------------------------------
def test_checkpoint_plan_reads_answers_fallbacks_and_lists():
    from memfit import CheckpointPlan

    plan = CheckpointPlan.from_recommendation(rec_for([2, 0], num_layers=4))
    assert (plan.layer_indices, plan.num_layers, plan.source, plan.every_layer) == ((0, 2), 4, "0007", False)
    assert plan.indices(4) == [0, 2] and plan.k() == 2
    fb = CheckpointPlan.from_recommendation(fallback_recommendation(None, "down"), num_layers=6)
    assert fb.every_layer and fb.indices(6) == list(range(6)) and fb.k() == 6 and fb.source == "fallback"
    assert CheckpointPlan.from_recommendation(fallback_recommendation(None, "down")).k() is None  # count unknown
    with pytest.warns(MemfitWarning, match="made for another model"):
        assert CheckpointPlan.from_recommendation(rec_for([0], num_layers=8), num_layers=4).every_layer
    with pytest.raises(ValueError, match="no k fits"):
        CheckpointPlan.from_recommendation(rec_for([], k=None), strict=True)
    assert CheckpointPlan.from_recommendation([3, 1, 1]).layer_indices == (1, 3)
    with pytest.raises(ValueError, match="out of range: allowed \\[0, 1\\]"):
        CheckpointPlan.from_recommendation([3]).indices(2)
    with pytest.raises(ValueError, match="must be >= 0"):
        CheckpointPlan.from_recommendation([-1])


# -- apply + verify -------------------------------------------------------------------------------------
def test_apply_checkpoints_exactly_the_recommended_layers_and_keeps_gradients():
    ref = llama()
    model = copy.deepcopy(ref)
    plan = apply(model, rec_for([0, 2]))
    assert plan.layer_indices == [0, 2] and plan.mechanism == "hf_per_layer" and plan.source == "0007"
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False, True, False]
    loss_ref, loss = step(ref), step(model)
    assert torch.equal(loss, loss_ref)
    g_ref, g = grads(ref), grads(model)
    assert all(g[n] is not None and torch.allclose(g[n], g_ref[n], atol=1e-6) for n in g_ref)
    assert plan.recomputed == {0, 2} and verify(plan) is True


def test_fallback_and_no_fit_checkpoint_every_layer():
    model = llama()
    fb = fallback_recommendation(None, "service down")  # catalog-name style: layer count unknown
    assert fb.num_layers == 0 and fb.layers == []
    assert apply(model, fb).layer_indices == [0, 1, 2, 3]
    with pytest.warns(MemfitWarning, match="no k fits"):
        plan = apply(model, rec_for([], k=None))
    assert plan.layer_indices == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="no k fits"):
        apply(model, rec_for([], k=None), strict=True)
    with pytest.raises(ValueError, match="for 8 layers but the model has 4"):
        apply(model, rec_for([0], num_layers=8), strict=True)


@pytest.mark.parametrize("enable", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_verify_catches_a_plan_overwritten_after_apply(enable):
    """transformers 5's activation_checkpointing_enable (what the HF Trainer calls inside train()) and its
    deprecated alias gradient_checkpointing_enable both overwrite the plan; verify says so."""
    model = llama()
    if not hasattr(model, enable):
        pytest.skip(f"{enable} is not in this transformers")
    plan = apply(model, rec_for([1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias warns
        getattr(model, enable)()
    step(model)
    assert plan.recomputed == set()
    with pytest.warns(MemfitWarning, match=r"missing \[1\].*nothing recomputed"):
        assert verify(plan) is False
    with pytest.raises(RuntimeError, match="planned to recompute 1 layers"):
        verify(plan, strict=True)


# -- trap (a): frozen embeddings + reentrant checkpointing --------------------------------------------
def _freeze_embeddings_and_first_layer(model):
    model.get_input_embeddings().weight.requires_grad_(False)
    for p in decoder_layers(model)[0].parameters():
        p.requires_grad_(False)


def test_reentrant_behind_frozen_embeddings_really_loses_gradients():
    """The trap itself (no memfit guard): layer 1 is trainable but gets no gradient."""
    model = llama()
    _freeze_embeddings_and_first_layer(model)
    apply_activation_checkpointing(model, [1, 2], use_reentrant=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "None of the inputs have requires_grad=True"
        step(model)
    assert decoder_layers(model)[1].self_attn.q_proj.weight.grad is None
    assert frozen_input_trap(model, decoder_layers(model), [1, 2]) == 1
    assert frozen_input_trap(model, decoder_layers(model), [2, 3]) is None  # layer 1 runs un-checkpointed


def test_apply_fixes_frozen_input_trap_on_hf_models():
    ref = llama()
    _freeze_embeddings_and_first_layer(ref)
    model = copy.deepcopy(ref)
    with pytest.warns(MemfitWarning, match="enable_input_require_grads"):
        plan = apply(model, rec_for([1, 2]), use_reentrant=True)
    assert plan.use_reentrant is True
    step(ref), step(model)
    g_ref, g = grads(ref), grads(model)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert g[q] is not None and torch.allclose(g[q], g_ref[q], atol=1e-6)
    assert plan.recomputed == {1, 2}
    # re-applying sees the hook already in place: no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemfitWarning)
        apply(model, rec_for([1, 2]), use_reentrant=True)
    other = copy.deepcopy(ref)
    with pytest.raises(ValueError, match="inputs do not require grad"):
        apply(other, rec_for([1, 2]), use_reentrant=True, strict=True)


class Blocks(nn.Module):
    """A plain PyTorch model: embedding, a ModuleList of MLP blocks, a head."""

    def __init__(self, n: int = 4, d: int = 32, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def test_apply_switches_plain_models_to_non_reentrant_behind_frozen_embeddings():
    torch.manual_seed(0)
    model = Blocks()
    model.embed.weight.requires_grad_(False)
    with pytest.warns(MemfitWarning, match="switched to non-reentrant"):
        plan = apply(model, [0, 1], use_reentrant=True, layers=model.blocks)
    assert plan.use_reentrant is False and plan.mechanism == "checkpoint_wrapper"
    ids = torch.randint(0, 64, (2, 8))
    model(ids).sum().backward()
    assert model.blocks[0][1].weight.grad is not None and plan.recomputed == {0, 1}


# -- trap (b): torch.compile ----------------------------------------------------------------------------
def test_whole_model_compile_around_non_reentrant_warns_and_the_plan_lands_on_the_original():
    model = llama()
    compiled = torch.compile(model)  # nothing is compiled until the first call
    with pytest.warns(MemfitWarning, match="whole model is torch.compile'd around non-reentrant"):
        plan = apply(compiled, rec_for([3]))
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [False, False, False, True]
    assert plan.layer_indices == [3]


def test_no_compile_warning_where_memory_is_unchanged():
    """Reentrant checkpointing (compile graph-breaks around it), nothing checkpointed, and blocks
    compiled one by one after apply (torchtitan's order) give no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemfitWarning)
        apply(torch.compile(llama()), rec_for([1]), use_reentrant=True)
        apply(torch.compile(llama()), rec_for([]))
        model = llama()
        apply(model, rec_for([1]))
        layers = decoder_layers(model)
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i])
        plan = apply(model, rec_for([0, 2]))  # re-planning through compiled blocks reaches the real layers
    assert [layers[i]._orig_mod.gradient_checkpointing for i in range(4)] == [True, False, True, False]
    assert plan.layer_indices == [0, 2]


@pytest.mark.timeout(600)
def test_per_block_compile_after_apply_recomputes_exactly_the_plan_with_inductor(monkeypatch):
    """torchtitan's order: checkpoint the chosen blocks, then torch.compile each block (inductor, CPU).
    The checkpointed blocks compile without graph breaks (the recompute is counted by memfit's marker op
    inside the compiled backward), exactly the planned layers recompute and the gradients match eager
    training without checkpointing. Inductor writes scalar C++ kernels here (``cpp.vec_isa_ok`` off: what is
    checked does not depend on the vector ISA, and they compile in 33 s of CPU instead of 40 s on a cold cache)."""
    import torch._dynamo
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ref = llama(layers=3)
    model = copy.deepcopy(ref)
    plan = apply(model, rec_for([0, 2], num_layers=3))
    layers = decoder_layers(model)
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i], backend="inductor")
    step(model)
    step(ref)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # checkpointed and plain blocks compiled
    assert plan.recomputed == {0, 2} and verify(plan)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5), name


# -- trap (c): frozen (LoRA) parameters + ZeRO-3 + non-reentrant ---------------------------------------
def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_lora_zero3_non_reentrant_on_old_deepspeed_switches_to_reentrant(monkeypatch):
    """DeepSpeed without the recompute fix fails with CheckpointError (transformers issue 47254): memfit
    switches to reentrant and, the embeddings being frozen, hooks the input grads; LoRA grads flow."""
    from memfit import checkpointing

    ds = {"zero_optimization": {"stage": 3}}
    monkeypatch.setattr(checkpointing, "zero3_recompute_keeps_frozen_params", lambda: False)
    with pytest.raises(ValueError, match="upgrade deepspeed, or use use_reentrant=True"):
        apply(_lora(llama()), rec_for([0]), deepspeed_config=ds, strict=True)
    model = _lora(llama())
    with pytest.warns(MemfitWarning) as caught:
        plan = apply(model, rec_for([0]), deepspeed_config=ds)
    messages = [str(w.message) for w in caught]
    assert any("switched to reentrant" in m for m in messages)
    assert any("enable_input_require_grads" in m for m in messages)
    assert plan.use_reentrant
    step(model)
    assert plan.recomputed == {0}
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n and ".layers.0." in n]  # A's grad is 0
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)  # at step 1 (B = 0)


def test_lora_zero3_non_reentrant_is_left_alone_on_fixed_deepspeed():
    pytest.importorskip("deepspeed")
    from memfit.checkpointing import zero3_recompute_keeps_frozen_params

    assert zero3_recompute_keeps_frozen_params()  # the pinned deepspeed has the fix
    model = _lora(llama())
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemfitWarning)
        plan = apply(model, rec_for([0]), deepspeed_config={"zero_optimization": {"stage": 3}})
    assert not plan.use_reentrant


# -- HF Trainer -----------------------------------------------------------------------------------------
class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (32,), generator=g)
        return {"input_ids": ids, "labels": ids}


def test_trainer_callback_reapplies_after_trainer_enables_checkpointing(tmp_path):
    from transformers import Trainer, TrainingArguments

    from memfit.integrations.hf import MemfitTrainerCallback

    model = llama()
    cb = MemfitTrainerCallback(rec_for([0, 1]))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        activation_checkpointing=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    with quiet_transformers():
        Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb]).train()
    assert cb.plan.layer_indices == [0, 1] and cb.verified is True
    assert cb.plan.recomputed == {0, 1}
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, True, False, False]


# -- DeepSpeed --------------------------------------------------------------------------------------------
class DSStyle(nn.Module):
    """Megatron-DeepSpeed style: calls deepspeed.checkpointing.checkpoint(layer, h) for every layer."""

    def __init__(self, n: int = 4, d: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n))

    def forward(self, x):
        import deepspeed.checkpointing

        for layer in self.layers:
            x = deepspeed.checkpointing.checkpoint(layer, x)
        return x


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """A stand-in for the deepspeed package: its checkpoint counts calls and uses torch's reentrant one."""
    import torch.utils.checkpoint as cp

    ckpt = types.ModuleType("deepspeed.checkpointing")
    ckpt.calls = 0

    def checkpoint(function, *args):
        ckpt.calls += 1
        return cp.checkpoint(function, *args, use_reentrant=True)

    ckpt.checkpoint = checkpoint
    ds = types.ModuleType("deepspeed")
    ds.checkpointing = ckpt
    monkeypatch.setitem(sys.modules, "deepspeed", ds)
    monkeypatch.setitem(sys.modules, "deepspeed.checkpointing", ckpt)
    return ckpt


def test_deepspeed_patch_recomputes_only_chosen_layers(fake_deepspeed):
    torch.manual_seed(0)
    ref = DSStyle()
    model = copy.deepcopy(ref)
    x = torch.randn(3, 16, requires_grad=True)
    ref(x).sum().backward()  # unpatched: DeepSpeed checkpoints every layer
    assert fake_deepspeed.calls == 4
    fake_deepspeed.calls = 0
    with patch_deepspeed_checkpointing(rec_for([1, 3])) as patch:
        for _ in range(2):  # two steps: the positional counter wraps per forward
            model.zero_grad()
            model(x.detach().requires_grad_()).sum().backward()
        assert fake_deepspeed.calls == 2 * 2  # DeepSpeed's checkpoint now runs for the 2 chosen layers only
        assert patch.plan.recomputed == {1, 3} and patch.plan.verify()
    assert fake_deepspeed.checkpoint is patch.original  # undone
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad), n


def test_deepspeed_patch_by_module_identity_and_standin():
    standin = standin_checkpointing()
    torch.manual_seed(0)
    layers = DSStyle().layers
    patch = patch_deepspeed_checkpointing([0], module=standin, layers=layers)
    x = torch.randn(2, 16)
    h = x
    for layer in layers:
        h = standin.checkpoint(layer.forward, h)  # bound method: indexed by __self__
    h.sum().backward()
    assert patch.plan.recomputed == {0} and patch.calls == 0
    patch.undo()
    assert standin.checkpoint is patch.original


def test_deepspeed_missing_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed.checkpointing", None)
    with pytest.raises(ImportError, match="deepspeed is not installed.*standin_checkpointing"):
        patch_deepspeed_checkpointing(rec_for([0]))


def test_deepspeed_config_block_and_hf_check():
    assert deepspeed_activation_checkpointing_config(rec_for([0, 1, 2])) == {
        "activation_checkpointing": {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": 3,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    }
    ds = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"number_checkpoints": 4}}
    with pytest.warns(MemfitWarning, match="no effect on a HF transformers model.*memfit.apply"):
        out = check_deepspeed_config(ds, llama(2))
    assert len(out) == 1 and "number_checkpoints" in out[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemfitWarning)
        assert check_deepspeed_config(ds, DSStyle()) == []
        assert check_deepspeed_config({"train_micro_batch_size_per_gpu": 1}, llama(2)) == []


def test_megatron_flags():
    assert megatron_flags(rec_for([0, 1, 2], num_layers=32)) == [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "3",
    ]
    assert megatron_flags(rec_for([], num_layers=32)) == []
    assert megatron_flags(rec_for([0, 1, 16, 17], num_layers=32), pipeline_parallel_size=2)[-1] == "2"
    assert megatron_flags(rec_for([0, 1, 16], num_layers=32), pipeline_parallel_size=2)[-1] == "2"  # widest stage
    with pytest.raises(ValueError, match="not its first 2"):
        megatron_flags(rec_for([0, 31], num_layers=32))
    with pytest.warns(MemfitWarning, match="no k fits"):  # nothing fits: every layer, like memfit.apply
        assert megatron_flags(rec_for([], k=None))[-1] == "4"
    assert megatron_flags(fallback_recommendation(None, "down"), num_layers=24)[-1] == "24"
    assert megatron_flags(fallback_recommendation(None, "down"))[-4:] == [  # every layer, count unknown
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ]


def test_memfit_package_stays_light():
    import subprocess

    code = (
        "import sys, memfit, memfit.reporter, memfit.integrations.megatron; "
        "print(sorted(m for m in ('torch', 'transformers', 'deepspeed', 'service', 'model', 'tracer', 'training', "
        "'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert memfit.apply is apply and memfit.verify is verify
