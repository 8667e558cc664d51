"""Tensor (+ sequence) parallelism run for real: DTensor ``parallelize_module`` over a fake process group.

:func:`apply_tensor_parallel` shards a HF decoder-only model the way Megatron-LM and torchtitan shard
Llama (Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3; torchtitan ``parallelize_llama``):

* attention: ``q_proj``, ``k_proj``, ``v_proj`` column-wise (heads split over the ranks), ``o_proj``
  row-wise (partial sums all-reduced);
* MLP: ``gate_proj``, ``up_proj`` column-wise, ``down_proj`` row-wise;
* embedding row-wise over the vocabulary, ``lm_head`` column-wise over the vocabulary with the
  logits left sharded and the loss computed vocab-parallel (``torch.distributed.tensor.parallel.
  loss_parallel``, Megatron's ``vocab_parallel_cross_entropy``);
* norms replicated. With ``sequence_parallel`` (the embedding output stays replicated and the first
  layer keeps its sequence chunk, so HF's rotary positions cover the whole sequence) they run :class:`~torch.distributed.tensor.parallel.
  SequenceParallel` (activations between the blocks sharded along the sequence, all-gathered before
  the column-wise projections and reduce-scattered after the row-wise ones; Korthikanti et al. 2022,
  arXiv 2205.05198, Sec. 4.2.2); without it they run on replicated DTensor inputs, which keeps every
  parameter a DTensor so that foreach/fused optimizers see one kind of tensor.

Running this under ``FakeTensorMode`` with the ``fake`` process-group backend measures rank 0 exactly
as the real library lays it out: collectives allocate their outputs and move no data.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

#: linear layers split column-wise (output features) and row-wise (input features), HF Llama-style names
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


def tensor_parallel_unsupported(model: Any) -> str | None:
    """Why :func:`apply_tensor_parallel` cannot shard ``model`` (None when it can).

    The plan needs the Llama-style module names (:data:`COLWISE`, :data:`ROWWISE`, :data:`NORMS`) in
    every decoder layer, ``model.model.embed_tokens``, ``model.model.norm`` and ``model.lm_head``, and
    no other parameter in a layer (a bias-free norm + projection layout: Llama, Mistral, Qwen2/3, ...).
    """
    from memfit.hf import decoder_layers

    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "embed_tokens") or not hasattr(base, "norm") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} lacks model.embed_tokens / model.norm / lm_head"
    for layer in decoder_layers(model):
        names = dict(layer.named_modules())
        missing = [n for n in (*COLWISE, *ROWWISE, *NORMS) if n not in names]
        if missing:
            return f"decoder layer lacks {missing}"
        covered = {f"{m}.{p}" for m in (*COLWISE, *ROWWISE, *NORMS) for p, _ in names[m].named_parameters()}
        extra = [n for n, _ in layer.named_parameters() if n not in covered]
        if extra:
            return f"decoder layer parameters outside the tensor-parallel plan: {extra[:4]}"
    return None


class _ReplicatedModule:
    """ParallelStyle-like helper: parameters become Replicate DTensors; plain inputs are taken as
    replicated and outputs handed back as local tensors (no communication, no copy)."""

    @staticmethod
    def apply(module: torch.nn.Module, mesh) -> None:
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        def to_dtensor(_mod, inputs, device_mesh):
            return tuple(
                DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def to_local(_mod, out, _mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def apply_tensor_parallel(model: Any, layers, mesh, *, sequence_parallel: bool = False) -> None:
    """Shard ``model`` in place over the 1-D ``mesh`` (see the module docstring for the plan).

    Args:
        model: a HF ``*ForCausalLM`` with Llama-style module names.
        layers: its decoder layers (:func:`memfit.hf.decoder_layers`).
        mesh: a 1-D ``DeviceMesh`` of the tensor-parallel ranks.
        sequence_parallel: shard the activations between blocks along the sequence.

    Raises:
        ValueError: the model does not follow the plan's layout (:func:`tensor_parallel_unsupported`).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    why = tensor_parallel_unsupported(model)
    if why is not None:
        raise ValueError(f"tensor_parallel_size > 1 is not supported for this model: {why}")
    seq = Shard(1)
    for layer in layers:
        plan: dict[str, Any] = {name: ColwiseParallel() for name in COLWISE}
        rowwise = RowwiseParallel(output_layouts=seq) if sequence_parallel else RowwiseParallel()
        plan.update({name: rowwise for name in ROWWISE})
        if sequence_parallel:
            plan.update({name: SequenceParallel() for name in NORMS})
            plan["self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": seq},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            )
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        parallelize_module(layer, mesh, plan)
        if sequence_parallel and layer is layers[0]:
            # the embedding output stays replicated so that HF derives rotary positions from the whole
            # sequence; the first layer keeps its own chunk of it (no communication)
            parallelize_module(
                layer,
                mesh,
                PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True),
            )
        if not sequence_parallel:
            for name in NORMS:
                _ReplicatedModule.apply(layer.get_submodule(name), mesh)
    top: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sequence_parallel:
        top["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    if not sequence_parallel:
        _ReplicatedModule.apply(model.model.norm, mesh)


@contextlib.contextmanager
def vocab_parallel_loss(enabled: bool):
    """``loss_parallel()`` when ``enabled`` (cross-entropy over vocabulary-sharded logits), else nothing."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield
