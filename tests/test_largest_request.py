"""The largest single request of a step without its stream (``model.analytic.largest_request_bytes``): the room
the allowance keeps free must be the one the recorded stream gives the simulated decision."""

from __future__ import annotations

import pytest

from memfit.schema import TrainingConfig
from model.analytic import largest_request_bytes
from model.job import resolve_architecture
from tests.helpers import TINY_LLAMA
from tracer.stream_source import stream_source

# vocabulary 256, hidden 64, 4 heads of 16: with eager attention at 16-32 tokens the head's weight is the largest
# tensor; the fp32 logits (4·s·b·256 B) outgrow it above 64 tokens; FlashAttention's dq accumulator pads to 128 tokens
EAGER = {"attention": "eager"}
CASES = [
    ({"micro_batch_size": 1, "seq_len": 32, **EAGER}, 256 * 64 * 4),  # amp: the head's fp32 gradient
    ({"micro_batch_size": 2, "seq_len": 256}, 4 * 2 * 256 * 256),  # the fp32 logits
    ({"micro_batch_size": 1, "seq_len": 16, "precision": "bf16", **EAGER}, 256 * 64 * 2),  # a bf16 gradient
    ({"micro_batch_size": 1, "seq_len": 16, "precision": "bf16_fp32_master", **EAGER}, 256 * 64 * 4),  # fp32 copy
    ({"micro_batch_size": 1, "seq_len": 16, "finetune": "lora", "lora_rank": 4, **EAGER}, 256 * 64 * 2),  # autocast
    ({"micro_batch_size": 1, "seq_len": 16, "precision": "bf16"}, 4 * 128 * 4 * 32),  # dq accumulator (sdpa)
    ({"micro_batch_size": 1, "seq_len": 128, "precision": "fp32", **EAGER}, 4 * 4 * 128 * 128),  # eager softmax
]


@pytest.mark.parametrize(("training", "expected"), CASES, ids=[str(c[0]) for c in CASES])
def test_largest_request_is_the_recorded_streams(tmp_path, monkeypatch, training, expected):
    monkeypatch.setenv("MEMFIT_STREAM_CACHE", str(tmp_path))
    t = TrainingConfig(**training)
    spec = resolve_architecture(dict(TINY_LLAMA)).spec
    assert largest_request_bytes(spec, t) == expected
    source = stream_source(dict(TINY_LLAMA), t, TINY_LLAMA["num_hidden_layers"], model_name="tiny-llama")
    for k in (0, TINY_LLAMA["num_hidden_layers"]):
        stream = source(k)
        assert max(stream.sizes[stream.measured_from :]) == expected
