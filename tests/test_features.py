"""Feature rows of flat telemetry (model.features): settings from the parquet reach the analytic terms intact."""

from __future__ import annotations

import enum

import pandas as pd

from memfit.schema import TrainingConfig
from model.features import _ENUMS, build_features
from tests.helpers import record

LATER = ["quantization", "offload_optimizer", "offload_parameters", "pipeline_schedule"]


def test_every_enum_field_of_the_training_config_is_converted():
    enums = {
        n
        for n, f in TrainingConfig.model_fields.items()
        if isinstance(f.annotation, type) and issubclass(f.annotation, enum.Enum)
    }
    assert enums <= set(_ENUMS)


def test_default_strings_in_a_row_equal_the_missing_columns():
    # the merged parquet holds quantization="none" etc. on every row: read as strings they once made every
    # LoRA row's frozen base count as quantized (identity comparison with Quantization.NONE)
    row = pd.DataFrame([record(finetune="lora", lora_rank=8, trainable_params=1000).to_row()])
    with_cols = build_features(row)
    without = build_features(row.drop(columns=LATER))
    pd.testing.assert_frame_equal(with_cols, without)
    assert with_cols.at[0, "weights_bytes"] == 4 * 100_000  # amp_bf16 default: fp32 weights, none quantized


def test_a_quantized_row_counts_its_base_smaller():
    plain = build_features(
        pd.DataFrame([record(finetune="lora", lora_rank=8, trainable_params=1000, precision="bf16").to_row()])
    )
    nf4 = build_features(
        pd.DataFrame(
            [record(finetune="lora", lora_rank=8, trainable_params=1000, precision="bf16", quantization="nf4").to_row()]
        )
    )
    assert nf4.at[0, "weights_bytes"] < plain.at[0, "weights_bytes"]
