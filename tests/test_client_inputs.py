"""Client-side inputs a new user's trial got wrong: the layers a telemetry report says were checkpointed, a torn
spool line, DeepSpeed config values, ``describe``'s bad arguments, the decoder-layer list of a plain model, saved
recommendations as dicts and impossible k for the DeepSpeed JSON block."""

from __future__ import annotations

import json

import pytest
import torch

from memfit.api import Recommendation
from memfit.checkpointing import CheckpointPlan, apply, checkpointed_layers
from memfit.describe import describe
from memfit.errors import InvalidConfiguration
from memfit.hf import decoder_layers
from memfit.integrations.deepspeed import deepspeed_activation_checkpointing_config as ds_block
from memfit.reporter import build_record, flush_spool, spool
from memfit.schema import Method
from tests.test_client import FakeService, answer, llama, mock_client


def _record(model, plan, **kw):
    req = describe(model, micro_batch_size=2, seq_len=16, gpu="RTX-4090")
    return build_record(model, plan, req, peak_allocated_bytes=5 * 10**7, method=Method.CPU_TRACKER, **kw)


def test_a_report_lists_every_layer_for_every_layer_plans():
    """An every-layer plan (CheckpointPlan(None), a "nothing fits" answer, the client's fallback) is carried out
    on every layer by memfit.apply, so its report says so (it said checkpoint_layers=[]: k = 0)."""
    model = llama(4)
    nothing_fits = Recommendation.model_validate(answer(k=None, layers=[], fits=False, num_layers=4))
    for plan in (CheckpointPlan(None), nothing_fits, [1, 3]):
        with pytest.warns(UserWarning) if plan is nothing_fits else _no_warning():
            layers = _record(model, plan).training.checkpoint_layers
        assert layers == ([1, 3] if plan == [1, 3] else [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"layer_indices \[7\] out of range"):
        _record(model, [7])


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_without_a_plan_the_report_reads_the_live_model():
    """No plan (the HF Trainer's own activation checkpointing with the reporter callback): the layers' flags."""
    model = llama(4)
    assert checkpointed_layers(model) == [] and _record(model, None).training.checkpoint_layers == []
    model.gradient_checkpointing_enable()  # what TrainingArguments(gradient/activation_checkpointing=True) calls
    assert _record(model, None).training.checkpoint_layers == [0, 1, 2, 3]
    apply(model, [2])
    assert checkpointed_layers(model) == [2] == _record(model, None).training.checkpoint_layers
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert checkpointed_layers(plain) is None


def test_a_torn_spool_line_quarantines_only_itself(tmp_path):
    model = llama(2)
    path = tmp_path / "spool.jsonl"
    a, c = _record(model, [0]), _record(model, [1])
    spool(a, path)
    with path.open("a") as f:  # a crash in the middle of writing record B
        f.write(_record(model, [0]).model_dump_json()[:120])
    spool(c, path)
    svc = FakeService()
    assert flush_spool(mock_client(svc), path) == 2
    assert set(svc.records) == {a.record_id, c.record_id}
    (held,) = [json.loads(line) for line in (tmp_path / "spool.jsonl.quarantine").read_text().splitlines()]
    assert held["reason"].startswith("not JSON") and len(held["line"]) == 120


def test_deepspeed_config_values_as_deepspeed_reads_them():
    model = llama(4)

    def sharding(ds):
        return describe(model, seq_len=128, deepspeed_config=ds, gpu="A100-80GB", gpu_count=8).training.sharding

    base = {"train_micro_batch_size_per_gpu": 2}
    assert sharding({**base, "zero_optimization": {"stage": "3"}}).value == "zero3"  # DeepSpeed reads "3" as 3
    with pytest.raises(InvalidConfiguration, match=r"zero_optimization.stage: must be one of 0, 1, 2, 3, got 4"):
        sharding({**base, "zero_optimization": {"stage": 4}})
    with pytest.raises(InvalidConfiguration, match=r"deepspeed_config.optimizer.type: must be one of adam, adamw"):
        sharding({**base, "optimizer": {"type": "Lamb"}})


def test_the_micro_batch_is_derived_from_deepspeeds_train_batch_size(tmp_path):
    """DeepSpeed derives the micro-batch from train_batch_size = micro x accumulation x data-parallel ranks; describe
    said "micro_batch_size is required" for such a config."""
    model = llama(4)

    def batch(ds, **kw):
        t = describe(model, seq_len=128, deepspeed_config=ds, gpu="A100-80GB", gpu_count=8, **kw).training
        return t.micro_batch_size, t.gradient_accumulation_steps

    assert batch({"train_batch_size": 64, "gradient_accumulation_steps": 4}) == (2, 4)
    assert batch({"train_batch_size": 64}) == (8, 1)
    assert batch({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}) == (2, 4)
    assert batch({"train_batch_size": 64, "gradient_accumulation_steps": 4}, tensor_parallel_size=2) == (4, 4)
    with pytest.raises(InvalidConfiguration, match=r"train_batch_size: must be a positive multiple of .* = 24"):
        batch({"train_batch_size": 64, "gradient_accumulation_steps": 3})
    # all three given and not multiplying up: DeepSpeed refuses it (DeepSpeedConfig._batch_assertion), so does describe
    ds = {"train_batch_size": 60, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(InvalidConfiguration, match=r"train_batch_size: must be .* = 4 x 2 x 8 = 64, got 60"):
        batch(ds)
    with pytest.raises(ValueError, match=r'"auto" is filled in from training_args'):
        batch({"train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(ValueError, match=r"deepspeed_config: cannot read '/nonexistent/ds.json'"):
        batch("/nonexistent/ds.json")
    (tmp_path / "ds.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"deepspeed_config: '.*ds.json' holds a JSON list, not an object"):
        batch(str(tmp_path / "ds.json"))
    for wrong in ([1, 2], 3):  # was silently ignored: a plain job without DeepSpeed's settings
        with pytest.raises(TypeError, match=r"deepspeed_config: a dict, a JSON file path or text, .* got"):
            batch(wrong, micro_batch_size=2)


def test_wrong_types_name_the_argument():
    """A new-user trial: verify(rec) (the answer, not what apply returned), apply("llama", 1) and apply(model,
    torch.tensor(2)) raised AttributeError or TypeError from deep inside."""
    from memfit.checkpointing import verify

    model = llama(2)
    with pytest.raises(TypeError, match=r"plan: verify\(\) checks what memfit.apply returned .* got Recommendation"):
        verify(Recommendation.model_validate(answer()))
    with pytest.raises(TypeError, match=r"plan: .* got NoneType"):
        verify(None)
    with pytest.raises(TypeError, match=r"model: apply\(\) checkpoints a live torch.nn.Module, got str"):
        apply("llama", 1)
    for bad in (torch.tensor(2), 3.0, "0,1"):
        with pytest.raises(ValueError, match=r"recommendation: .* a k \(an int\) or a list of layer indices"):
            apply(model, bad)
    from memfit.reporter import report_peak

    res = report_peak(
        mock_client(FakeService()), model, [0], micro_batch_size=1, seq_len=8, gpu="L4", peak_allocated_bytes="abc"
    )
    assert res.status == "error" and res.detail == "peak_allocated_bytes: must be an integer number of bytes, got 'abc'"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"tensor_parallel_size": 0}, "training.tensor_parallel_size"),  # read as "not given" (1) before
        ({"gradient_accumulation_steps": 0}, "training.gradient_accumulation_steps"),
        ({"precision": "fp8"}, "training.precision"),
        ({"seq_len": 0}, "training.seq_len"),
        ({"headroom_fraction": 2}, "headroom_fraction"),
    ],
)
def test_describe_names_a_bad_argument_in_one_line(kw, field):
    args = {"micro_batch_size": 2, "seq_len": 128, "gpu": "A100-80GB", **kw}
    with pytest.raises(InvalidConfiguration) as err:
        describe(llama(2), **args)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")
    assert "\n" not in str(err.value) and "errors.pydantic.dev" not in str(err.value)


def test_the_outermost_layer_list_of_a_plain_model():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(6))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(4))

    net = Net()
    assert decoder_layers(net) is net.blocks  # not block 0's six inner layers (the longest list)


def test_a_saved_recommendation_dict_is_read_as_a_recommendation():
    saved = json.loads(Recommendation.model_validate(answer(k=2, layers=[0, 1], num_layers=4)).model_dump_json())
    assert CheckpointPlan.from_recommendation(saved, num_layers=4).layer_indices == (0, 1)
    assert ds_block(saved, num_layers=4)["activation_checkpointing"]["number_checkpoints"] == 2


@pytest.mark.parametrize(
    ("rec", "message"),
    [
        ([9], r"layer_indices \[9\] out of range: allowed \[0, 3\]"),
        (list(range(10)), "out of range"),
        (10, r"k=10 must be an integer in \[0, 4\]"),
        (-1, r"k=-1 must be an integer in \[0, 4\]"),
        (True, "k=True must be"),
    ],
)
def test_deepspeed_block_refuses_impossible_k(rec, message):
    with pytest.raises(ValueError, match=message):
        ds_block(rec, num_layers=4)
    assert ds_block(2, num_layers=4)["activation_checkpointing"]["number_checkpoints"] == 2


def test_a_gpu_name_with_its_memory_suggests_the_gpu():
    from memfit.api import GPUS
    from memfit.errors import close_names

    assert close_names("T4-16GB", GPUS)[0] == "T4"  # it suggested V100-16GB only
    assert close_names("H100", GPUS)[:2] == ["H100-80GB", "H100-94GB"]


@pytest.mark.parametrize("model", ["gpt2", {"model_type": "gpt2", "n_layer": 2}])
def test_describe_given_a_name_or_a_config_says_it_reads_a_live_module(model):
    """A new user's first try: describe("gpt2", ...) raised AttributeError: 'str' object has no attribute
    'parameters' from inside describe."""
    with pytest.raises(
        TypeError, match=r"^model: describe\(\) reads a live torch.nn.Module, got (str|dict) .*RecommendRequest"
    ):
        describe(model, seq_len=4096, micro_batch_size=2, gpu="T4")


def test_a_pipelined_jobs_report_says_its_stage(monkeypatch):
    """Each stage of a pipelined job peaks differently: the report carries the measured device's stage, given or
    read from Megatron's pipeline rank where its model-parallel groups run; a stage the job has not is refused
    naming the field and its range."""
    import sys
    import types

    model = llama(4)
    req = describe(model, micro_batch_size=2, seq_len=16, gpu="RTX-4090", gpu_count=2, pipeline_parallel_size=2)

    def rec(**kw):
        return build_record(model, [0], req, peak_allocated_bytes=5 * 10**7, method=Method.CPU_TRACKER, **kw)

    assert rec().measurement.pipeline_stage is None  # not said, and no Megatron here
    assert rec(pipeline_stage=1).measurement.pipeline_stage == 1
    with pytest.raises(
        InvalidConfiguration, match=r"pipeline_stage=2 must be in \[0, pipeline_parallel_size - 1 = 1\]"
    ):
        rec(pipeline_stage=2)
    state = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: True, get_pipeline_model_parallel_rank=lambda: 1
    )
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
    assert rec().measurement.pipeline_stage == 1 and rec(pipeline_stage=0).measurement.pipeline_stage == 0
    state.model_parallel_is_initialized = lambda: False
    assert rec().measurement.pipeline_stage is None
