"""Run one pipeline stage's 1F1B schedule for real (CPU tensors, live-storage tracker) on a HF Llama-style
model: the check of :func:`model.parallel.compose_stage`.

Stage ``stage`` of ``pp`` holds its decoder layers (the embedding on the first stage; the final norm,
``lm_head`` and the loss on the last). Its micro-batches run in Megatron's non-interleaved 1F1B order
(``schedules.forward_backward_pipelining_without_interleaving``): ``pp − stage − 1`` warm-up forwards, then
one forward and one backward alternately, then the cool-down backwards, then one optimizer step. What
the neighbouring stages send is stood in for: the input activation of a later stage is a random
``(b, s, h)`` tensor that requires grad, and the gradient of an earlier stage's output is a random tensor
of its shape. Gradients accumulate over the micro-batches as in real training.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.checkpointing import apply_activation_checkpointing
from memfit.hf import build_causal_lm, decoder_layers, param_dtype
from memfit.schema import TrainingConfig
from model.parallel import pipeline_stages
from tracer.collect import make_optimizer
from tracer.tracker import LiveStorageTracker


def one_f_one_b_order(stage: int, pp: int, m: int) -> list[tuple[str, int]]:
    """The stage's sequence of ("F" | "B", micro-batch) in Megatron's non-interleaved 1F1B schedule."""
    warm = min(pp - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        order.append(("F", f))
        f += 1
        order.append(("B", b))
        b += 1
    order += [("B", i) for i in range(b, m)]
    return order


def measure_stage(hf_config: dict[str, Any], training: TrainingConfig, stage: int, k: int) -> int:
    """Peak live bytes of stage ``stage`` running one primed 1F1B step with its first ``k`` layers
    checkpointed (real CPU tensors; fp32/amp autocast as ``training.precision`` says, AdamW).

    Raises:
        ValueError: a schedule other than 1f1b, or k outside the stage's layers.
    """
    if training.pipeline_schedule.value != "1f1b":
        raise ValueError("measure_stage runs pipeline_schedule='1f1b' only")
    pp, m = training.pipeline_parallel_size, training.micro_batches_per_step
    b, s = training.micro_batch_size, training.seq_len
    torch.manual_seed(0)
    model = build_causal_lm(hf_config, dtype=param_dtype(training.precision), attention=training.attention.value)
    st = pipeline_stages(model_spec_of(hf_config, model), training)[stage]
    if not 0 <= k <= st.num_layers:
        raise ValueError(f"k={k} must be in [0, {st.num_layers}]")
    layers = decoder_layers(model)
    apply_activation_checkpointing(model, list(range(st.first_layer, st.first_layer + k)), layers=layers)
    mine = torch.nn.ModuleList(list(decoder_layers(model))[st.first_layer : st.first_layer + st.num_layers])
    embed, norm, lm_head, rotary = model.model.embed_tokens, model.model.norm, model.lm_head, model.model.rotary_emb
    keep: list[torch.nn.Module] = [mine]
    if st.has_embedding:
        keep.append(embed)
    if st.has_head:
        keep += [norm, lm_head]
    params = [p for mod in keep for p in mod.parameters()]
    amp = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}.get(training.precision.value)
    h = model.config.hidden_size
    act_dtype = amp or param_dtype(training.precision)
    del layers
    tracker = LiveStorageTracker()
    with tracker:
        # the tracker counts what is allocated from here on: the stage's own parameters are re-made inside
        for p in params:
            p.data = p.data.clone()
        opt = make_optimizer(training.optimizer, params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del model
        tracker.reset_peak()
        ids = torch.randint(0, hf_config["vocab_size"], (b, s))
        pos = torch.arange(s).unsqueeze(0)
        outs: dict[int, torch.Tensor] = {}
        for kind, i in one_f_one_b_order(stage, pp, m):
            if kind == "F":
                with torch.autocast("cpu", dtype=amp) if amp else torch.autocast("cpu", enabled=False):
                    x = embed(ids) if st.has_embedding else torch.randn(b, s, h, dtype=act_dtype, requires_grad=True)
                    cos_sin = rotary(x, pos)
                    for layer in mine:
                        x = layer(x, position_embeddings=cos_sin, position_ids=pos)
                        x = x[0] if isinstance(x, tuple) else x
                    if st.has_head:
                        logits = lm_head(norm(x))
                        x = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.view(-1))
                        del logits
                    del cos_sin
                outs[i] = x
            else:
                out = outs.pop(i)
                if st.has_head:
                    out.backward()
                else:
                    out.backward(torch.randn_like(out))
                del out
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def model_spec_of(hf_config: dict[str, Any], model) -> Any:
    """The :class:`memfit.schema.ModelSpec` of a built model."""
    from memfit.hf import model_spec

    return model_spec(hf_config, model)
