"""HF Trainer + MemfitTrainerCallback on a tiny random Llama (CPU, a few seconds).

Question: which decoder layers must I checkpoint so this training fits the GPU memory I have?

    python examples/hf_trainer.py --k 2                     # no service: checkpoint the first 2 layers
    python examples/hf_trainer.py --url http://127.0.0.1:8000   # ask the service; the capacity is the
                                                                # smallest at which it answers about half
                                                                # the layers checkpointed

The Trainer enables activation checkpointing on every layer inside train(); the callback re-applies
the plan at on_train_begin and verifies after the first step that exactly those layers recomputed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import (
    cpu_frameworks,
    parser,
    peak_meter,
    plan_source,
    predicted_peak,
    print_measured_vs_predicted,
    print_plan,
    setup_logging,
)

cpu_frameworks()
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import memfit

SEQ = 64


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 16):
        self.vocab, self.n = vocab, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    setup_logging(args.verbose)
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    out = tempfile.mkdtemp(prefix="memfit-example-")
    targs = TrainingArguments(
        output_dir=out,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        use_cpu=True,
        activation_checkpointing=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )

    def request(cap):
        return memfit.describe(model, seq_len=SEQ, training_args=targs, gpu_memory_bytes=cap)

    rec = plan_source(args, request, config.num_hidden_layers)
    callbacks = [memfit.MemfitTrainerCallback(rec)]
    with peak_meter(model) as meter:
        if args.url:  # reports the peak of the first 2 steps: CUDA's on a GPU, the tensor tracker's on CPU
            callbacks.append(
                memfit.MemfitReporterCallback(
                    args.url,
                    callbacks[0],
                    steps=2,
                    seq_len=SEQ,
                    token=args.token,
                    gpu_memory_bytes=rec.capacity_bytes,
                    peak_fn=meter["peak_fn"],
                )
            )
        trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(config.vocab_size), callbacks=callbacks)
        trainer.train()
    plan = callbacks[0].plan
    print_plan(plan, bool(callbacks[0].verified))
    print_measured_vs_predicted(meter, predicted_peak(rec, request, plan.k), plan.k)


if __name__ == "__main__":
    main()
