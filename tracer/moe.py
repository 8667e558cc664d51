"""Make mixture-of-experts (MoE) training steps traceable: a deterministic router and expert parallelism.

How transformers 5 routes (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, ...): a router module
computes ``torch.topk`` over the router probabilities (DeepSeek-V3 first picks expert groups), and
passes ``(hidden_states (T, h), top_k_index (T, k), top_k_weights (T, k))`` to an experts module whose
class is decorated with ``transformers.integrations.moe.use_experts_implementation``. That module
dispatches on ``config._experts_implementation``:

* ``eager``: a Python loop over the experts hit, each gathering its tokens with ``torch.where`` —
  data-dependent shapes, so it cannot run under ``FakeTensorMode``;
* ``grouped_mm`` (the default where ``torch.nn.functional.grouped_mm`` exists): tokens are sorted by
  expert into one ``(T·k, h)`` buffer and multiplied with ``grouped_mm`` using per-expert offsets. Every
  shape is ``T·k`` rows whatever the routing, so it runs under fake tensors; the tracer uses it.

:func:`balanced_routing` is the one place where the tracer changes what the model does (see its
docstring). Expert parallelism is traced on the rank's local shard: the model is built with
``num_experts / expert_parallel_size`` experts (:func:`local_expert_config`) and the tokens that the
all-to-all dispatch delivers to the hottest rank are stood in for by a gather of
:func:`received_token_rows` rows.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch


def expert_modules(model) -> list[torch.nn.Module]:
    """The experts modules of a transformers 5 MoE model (classes decorated with
    ``use_experts_implementation``: they carry ``num_experts`` and ``_is_expert_parallel``)."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]


def balanced_expert_index(
    num_tokens: int, top_k: int, num_experts: int, imbalance_factor: float = 1.0, device: Any = "cpu"
) -> torch.Tensor:
    """A deterministic routing: expert ids of shape ``(num_tokens, top_k)``, int64.

    With ``imbalance_factor`` f = 1, flat slot p = t·k + j goes to expert ``p mod E``: every expert gets
    ``T·k/E`` slots (exactly, when E divides T·k) and a token's k experts are distinct (k ≤ E). With
    f > 1 expert 0 is the hottest: the first ``round(f·T·k/E)`` tokens (at most all T) send their first
    slot to it, and the other slots go round-robin over experts 1..E-1. Built with tensor ops, so it
    works under ``FakeTensorMode`` as on real tensors.

    Raises:
        ValueError: ``top_k`` outside [1, E], f < 1, or f > E / k (the hottest expert cannot receive
            more than every token).
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    check_imbalance_factor(imbalance_factor, num_experts, top_k)
    slot = torch.arange(num_tokens * top_k, device=device)
    if imbalance_factor == 1.0 or num_experts == 1:
        return (slot % num_experts).view(num_tokens, top_k)
    n_hot = min(num_tokens, round(imbalance_factor * num_tokens * top_k / num_experts))
    hot = (slot % top_k == 0) & (slot // top_k < n_hot)
    rest = torch.cumsum((~hot).to(torch.int64), 0) - 1
    return torch.where(hot, torch.zeros_like(slot), 1 + rest % (num_experts - 1)).view(num_tokens, top_k)


def check_imbalance_factor(imbalance_factor: float, num_experts: int, top_k: int) -> None:
    """Raise ValueError unless 1 <= ``imbalance_factor`` <= num_experts / top_k."""
    hi = num_experts / top_k
    if not 1.0 <= imbalance_factor <= hi:
        raise ValueError(
            f"moe_imbalance_factor={imbalance_factor} must be in [1, num_experts / num_experts_per_token"
            f" = {hi:g}] (the hottest expert's share relative to balanced)"
        )


def received_token_rows(
    num_tokens: int, num_experts: int, expert_parallel_size: int, imbalance_factor: float = 1.0
) -> int:
    """Tokens (each with its k expert slots) the rank holding the hottest expert receives per MoE layer.

    Every rank sends its T tokens' T·k slots; with E experts over ``expert_parallel_size`` (P) ranks,
    each expert's balanced share of the P·T·k slots is P·T·k/E. The hottest expert gets f times that and
    the other E/P - 1 experts of its rank their balanced share, so that rank receives
    ``T·k·(1 + (f - 1)·P/E)`` slots: ``ceil(T·(1 + (f - 1)·P/E))`` tokens' worth (T when balanced).
    The same accounting as the all-to-all token dispatch of Megatron-Core's ``MoEAlltoAllTokenDispatcher``
    (Megatron-LM ``megatron/core/transformer/moe/token_dispatcher.py``), whose received buffer is sized by
    the per-expert token counts of the rank's local experts.
    """
    return math.ceil(num_tokens * (1 + (imbalance_factor - 1) * expert_parallel_size / num_experts) - 1e-9)


@contextlib.contextmanager
def _grouped_mm_bf16_only():
    """Send non-bf16 grouped matmuls to transformers' own fallback op.

    ``torch.nn.functional.grouped_mm`` takes bf16 operands only on CUDA (its meta function, which fake
    tensors run, checks exactly that), while on CPU transformers would call it with fp32 weights too.
    For fp32 expert weights (``amp_bf16``/``fp32`` precision) the tracer and the CPU check both use
    ``torch.ops.transformers.grouped_mm_fallback`` (same output, saves the same input and weight).
    """
    from transformers.integrations import moe

    orig = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda input, weight, offs: weight.dtype == torch.bfloat16 and orig(input, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = orig


@contextlib.contextmanager
def balanced_routing(
    model, *, imbalance_factor: float = 1.0, expert_parallel_size: int = 1, num_experts: int | None = None
):
    """Route every MoE layer of ``model`` deterministically while inside (the tracer's one MoE patch).

    What it changes, per experts module (:func:`expert_modules`), for the duration of the block:

    * the experts implementation is ``grouped_mm`` (static shapes; see the module docstring);
    * the router's ``top_k_index`` is replaced by :func:`balanced_expert_index` of the same shape: every
      expert gets its balanced share T·k/E, or the hottest ``imbalance_factor`` times it. The router still
      runs (its logits, softmax and top-k are allocated as in a real step); only the choice changes;
    * with ``expert_parallel_size`` P > 1 the model holds one rank's E/P experts
      (:func:`local_expert_config`) and the experts receive :func:`received_token_rows` tokens, gathered
      from the rank's own (a stand-in for the all-to-all receive buffer of the hottest rank), routed
      evenly over the local experts; the output keeps the rank's T rows;
    * non-bf16 grouped matmuls go to transformers' fallback op (:func:`_grouped_mm_bf16_only`).

    Under ``grouped_mm`` the footprint of one rank does not depend on how its rows spread over its
    experts, so ``imbalance_factor`` only changes memory through expert parallelism (more rows arrive).

    Args:
        model: a transformers (or PEFT-wrapped) causal LM.
        imbalance_factor: the hottest expert's share relative to balanced, in [1, E/k].
        expert_parallel_size: ranks the experts are split over (1: all experts local).
        num_experts: E of the whole model (default: the modules' own count, i.e. no EP).
    """
    mods = expert_modules(model)
    undo: list[tuple[torch.nn.Module, Any]] = []
    configs = {id(m.config): m.config for m in mods if getattr(m, "config", None) is not None}
    impls = {k: c._experts_implementation for k, c in configs.items()}
    for m in mods:
        local = m.num_experts
        total = num_experts or local * expert_parallel_size
        orig = m.forward

        def forward(hidden_states, top_k_index, top_k_weights, *args, _orig=orig, _local=local, _total=total, **kwargs):
            T, k = top_k_index.shape
            if expert_parallel_size > 1:
                rows = received_token_rows(T, _total, expert_parallel_size, imbalance_factor)
                pick = torch.arange(rows, device=hidden_states.device) % T
                hidden_states, top_k_weights = hidden_states[pick], top_k_weights[pick]
                index = balanced_expert_index(rows, k, _local, 1.0, device=top_k_index.device)
                return _orig(hidden_states, index, top_k_weights, *args, **kwargs)[:T]
            index = balanced_expert_index(T, k, _local, imbalance_factor, device=top_k_index.device)
            return _orig(hidden_states, index, top_k_weights, *args, **kwargs)

        m.forward = forward
        undo.append((m, orig))
    for c in configs.values():
        c._experts_implementation_internal = "grouped_mm"
    try:
        with _grouped_mm_bf16_only():
            yield mods
    finally:
        for m, _ in undo:
            del m.forward  # the class's forward again
        for k, c in configs.items():
            c._experts_implementation_internal = impls[k]
