"""Real DeepSpeed ZeRO stage 2 (bf16, fp32 master partitions) on one CPU process: what its step allocates.

Run by tests/test_deepspeed_zero.py in a subprocess (DeepSpeed initialises a process group and keeps it).
Two steps run; the second (optimizer states already built) is measured with
:class:`tracer.tracker.LiveStorageTracker`: the bytes live when the wrapped optimizer's ``step`` starts and
the peak between ``engine.step()``'s start and that moment, both relative to the bytes live before
``engine.step()``. Prints one JSON line with those figures, the partition's element count, the fp32 gradient
the wrapped optimizer stepped (dtype, elements), the 16-bit weights' element count after the step and the
optimizer's reduce bucket size.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import socket

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

import deepspeed
from transformers import LlamaConfig, LlamaForCausalLM

from tracer.tracker import LiveStorageTracker

# the shared-memory all-reduce op only speeds up multi-process CPU runs; building it takes minutes of g++
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

torch.manual_seed(0)
config = LlamaConfig(
    num_hidden_layers=2,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=64,
    use_cache=False,
)
model = LlamaForCausalLM(config)
ds_config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
}
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
seen: dict[str, object] = {}


def one_step(tracker: LiveStorageTracker | None) -> None:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    if tracker is None:
        engine.step()
        return
    inner = optimizer.optimizer  # the wrapped torch AdamW stepping the fp32 partition
    wrapped = inner.step

    def step(*args, **kwargs):
        grad = inner.param_groups[0]["params"][0].grad
        seen.update(at_inner_step=tracker.live_bytes - seen["before"], peak_before_inner=tracker.peak_bytes)
        seen.update(grad_dtype=str(grad.dtype), grad_numel=grad.numel())
        return wrapped(*args, **kwargs)

    inner.step = step
    # cyclic garbage of the backward (freed only when the collector runs) must not count in "before": a collection
    # inside engine.step() would free it there and hide the partition's allocation under the old peak
    gc.collect()
    gc.disable()
    try:
        seen["before"] = tracker.live_bytes
        tracker.reset_peak()
        engine.step()
    finally:
        gc.enable()
        inner.step = wrapped


one_step(None)
with LiveStorageTracker() as tracker:
    one_step(tracker)
partition = sum(int(p.numel()) for p in optimizer.single_partition_of_fp32_groups)
bit16 = sum(int(p.numel()) for group in optimizer.bit16_groups for p in group)
print(
    json.dumps(
        {
            "partition_numel": partition,
            "bit16_numel": bit16,
            "model_numel": sum(p.numel() for p in model.parameters()),
            "at_inner_step_bytes": seen["at_inner_step"],
            "peak_until_inner_step_bytes": int(seen["peak_before_inner"]) - int(seen["before"]),
            "grad_dtype": seen["grad_dtype"],
            "grad_numel": seen["grad_numel"],
            "reduce_bucket_size": int(optimizer.reduce_bucket_size),
        }
    )
)
