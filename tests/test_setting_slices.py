"""Issue 9's settings on the shipped telemetry: every measured row of each new setting is answered by the traced
path within 0.5 % (the same figures `python -m benchmarks.accuracy` prints per setting)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from benchmarks.accuracy import setting_slices
from memfit.schema import Sharding
from model.curve import TRACED, MemoryPredictor
from model.evaluate import FAMILY_COLUMNS, row_configuration
from model.terms import TermsCache
from tests.conftest import SHIPPED


@pytest.fixture(scope="module")
def answered() -> pd.DataFrame:
    df = pd.read_parquet(SHIPPED)
    df = df[np.any(list(setting_slices(df).values()), axis=0)].reset_index(drop=True)
    predictor = MemoryPredictor(None, TermsCache())  # no learned model: only the traced path can answer
    pred = np.full(len(df), np.nan)
    for _key, g in df.groupby([c for c in FAMILY_COLUMNS if c in df.columns], dropna=False, sort=False):
        job = row_configuration(g.iloc[0].to_dict())
        spec, training, hf = job.spec, job.training, job.hf_config
        if training.sharding is Sharding.ZERO1:  # not traceable (model.terms.not_traceable_reason): one
            assert training.gradient_accumulation_steps > 1  # gradient-accumulation family, left out
            continue
        curve = predictor.curve(spec, training, hf)
        assert curve.path == TRACED, (spec.model_name, curve.reason)
        pred[g.index] = [curve.points[int(k)].predicted_bytes for k in g["num_checkpointed_layers"]]
    return df.assign(pred=pred).dropna(subset=["pred"]).reset_index(drop=True)


def test_every_issue9_setting_has_measured_rows_answered_by_the_traced_path(answered):
    slices = setting_slices(answered)
    assert all(sel.sum() >= 5 for sel in slices.values()), {n: int(s.sum()) for n, s in slices.items()}
    err = (answered["pred"] / answered["peak_allocated_bytes"] - 1).abs()
    for name, sel in slices.items():
        assert 100 * err[sel].mean() <= 0.5, name  # MAPE per setting
        assert 100 * err[sel].max() <= 2.0, name
