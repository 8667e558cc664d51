import pytest
from pydantic import ValidationError

from memfit.schema import ModelSpec, TelemetryRecord, TrainingConfig
from tests.helpers import record


def test_roundtrip_through_flat_row():
    rec = record(checkpoint_layers=[0, 3], finetune="lora", lora_rank=8, lora_target_modules=["q_proj", "v_proj"])
    row = rec.to_row()
    assert row["checkpoint_layers"] == "[0, 3]" and row["num_checkpointed_layers"] == 2
    assert TelemetryRecord.from_row(row) == rec


@pytest.mark.parametrize(
    "over, field_word",
    [
        ({"hidden_size": 65}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"checkpoint_layers": [0, 1, 2, 3, 4]}, "num_layers=4"),
        ({"checkpoint_layers": [7]}, "[0, 3]"),
        ({"checkpoint_layers": [1, 1]}, "checkpoint_layers: must be distinct"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"seq_len": -5}, "seq_len"),
        ({"trainable_params": 200_000}, "trainable_params"),
        ({"total_params": 10**15, "trainable_params": 10}, "total_params"),
        ({"sharding": "zero3"}, "data_parallel_size"),
        ({"finetune": "lora"}, "lora_rank"),
        ({"peak_reserved_bytes": 10}, "peak_reserved_bytes"),
        ({"data_parallel_size": 8, "sharding": "zero1"}, "gpu_count"),
        ({"precision": "fp8"}, "precision"),
        ({"pipeline_stage": 1}, "pipeline_stage=1 must be in [0, pipeline_parallel_size - 1 = 0]"),
        ({"pipeline_stage": 2, "pipeline_parallel_size": 2, "gpu_count": 2}, "pipeline_stage=2 must be in [0, "),
        ({"pipeline_stage": -1}, "pipeline_stage"),
    ],
)
def test_invalid_records_name_the_field(over, field_word):
    with pytest.raises(ValidationError) as err:
        record(**over)
    assert field_word in str(err.value)


def test_k_property_and_defaults():
    t = TrainingConfig(micro_batch_size=1, seq_len=16, checkpoint_layers=[2, 0])
    assert t.num_checkpointed_layers == 2
    assert t.precision.value == "amp_bf16" and t.checkpoint_impl.value == "non_reentrant"


def test_content_hash_ignores_id_and_time_only():
    a = record()
    b = a.model_copy(update={"record_id": "other-id-123"})
    assert a.content_hash() == b.content_hash()
    c = record(peak_allocated_bytes=1024)
    assert c.content_hash() != a.content_hash()


def test_a_pipeline_stage_is_kept_and_records_without_one_keep_their_content_hash():
    """The stage of a pipelined job's measured device goes through the flat row (the store's columns) and back; a
    record without one hashes as before the field existed, so a resent older record is a duplicate, not a
    conflict."""
    import hashlib
    import json

    staged = record(pipeline_parallel_size=2, gpu_count=2, pipeline_stage=1)
    assert staged.to_row()["pipeline_stage"] == 1 and TelemetryRecord.from_row(staged.to_row()) == staged
    plain = record()
    body = plain.model_dump(mode="json", exclude={"record_id", "created_at"})
    assert body["measurement"].pop("pipeline_stage") is None
    del body["training"]["gradient_accumulation_steps"]
    assert plain.content_hash() == hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    other = record(pipeline_parallel_size=2, gpu_count=2, pipeline_stage=0)
    assert other.content_hash() != staged.content_hash()


def test_model_spec_rejects_moe_half_given():
    with pytest.raises(ValidationError, match="num_experts"):
        ModelSpec(
            architecture="mixtral",
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=64,
            vocab_size=10,
            total_params=10,
            trainable_params=10,
            num_experts=8,
        )
