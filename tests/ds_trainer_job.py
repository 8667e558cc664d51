"""HF Trainer + DeepSpeed (ZeRO stage 0) on one CPU process, with and without a memfit plan.

Run by tests/test_frameworks.py in a subprocess (DeepSpeed initialises a process group and keeps it).
Prints one JSON line: the plan, what recomputed, the engine type, the largest parameter difference
between the two runs, what ``memfit.describe`` read from the DeepSpeed config, and the warning
``check_deepspeed_config`` gives for an ``activation_checkpointing`` block on a HF model.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import warnings

import torch

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    PORT = s.getsockname()[1]
for key, value in {
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": str(PORT),
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
}.items():
    os.environ.setdefault(key, value)

import importlib

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

import memfit
from memfit.integrations.deepspeed import check_deepspeed_config, deepspeed_activation_checkpointing_config

# The shared-memory all-reduce op only speeds up multi-process CPU runs; building it takes ~2 minutes of g++.
# (deepspeed.comm's attribute "torch" is torch itself: patch the module by its sys.modules name.)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
hf_logging.set_verbosity_error()
L, SEQ, VOCAB = 4, 32, 128


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def run(plan_layers: list[int] | None) -> tuple[dict[str, torch.Tensor], object, object]:
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=L,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=2,
        per_device_train_batch_size=2,
        use_cpu=True,
        deepspeed=ds,
        learning_rate=1e-3,
        activation_checkpointing=plan_layers is not None,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        data_seed=0,
        seed=0,
    )
    callbacks = [memfit.MemfitTrainerCallback(plan_layers, deepspeed_config=ds)] if plan_layers is not None else []
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return params, (callbacks[0] if callbacks else None), trainer


def main() -> None:
    plain, _, _ = run(None)
    planned, cb, trainer = run([0, 1])
    diff = max((planned[n] - plain[n]).abs().max().item() for n in plain)
    model = trainer.model_wrapped
    described = memfit.describe(trainer.model, seq_len=SEQ, training_args=trainer.args, gpu="L4")
    ds_with_block = {
        **trainer.args.hf_deepspeed_config.config,
        **deepspeed_activation_checkpointing_config(cb.recommendation, num_layers=L),
    }
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        hf_warning = check_deepspeed_config(ds_with_block, trainer.model)
    print(
        json.dumps(
            {
                "plan_layers": cb.plan.layer_indices,
                "recomputed": sorted(cb.plan.recomputed),
                "verified": cb.verified,
                "engine": type(model).__name__,
                "max_param_diff": diff,
                "described": {
                    "precision": described.training.precision.value,
                    "micro_batch_size": described.training.micro_batch_size,
                    "sharding": described.training.sharding.value,
                },
                "hf_block_warning": hf_warning[0] if hf_warning else None,
            }
        )
    )


if __name__ == "__main__":
    main()
