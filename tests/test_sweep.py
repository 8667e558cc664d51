"""A small collection sweep inside the suite (fake tensors on CPU; well under two minutes)."""

import json

from data.store import TelemetryStore
from training.sweep import GRIDS, Family, k_values, main


def test_k_values_cover_zero_to_L():
    assert k_values(12, 13) == list(range(13))
    ks = k_values(80, 13)
    assert ks[0] == 0 and ks[-1] == 80 and len(ks) == 13
    assert k_values(2, 13) == [0, 1, 2]


def test_record_ids_are_stable_and_distinct():
    f = Family("gpt2", 1, 128)
    assert f.record_id(0, "fake") == Family("gpt2", 1, 128).record_id(0, "fake")
    assert len({f.record_id(k, "fake") for k in range(5)} | {f.record_id(0, "cpu")}) == 6


def test_smoke_sweep_is_resumable_and_monotone(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 's.db'}"
    assert (
        main(["--grid", "smoke", "--workers", "2", "--db", url, "--quiet", "--export", str(tmp_path / "s.parquet")])
        == 0
    )
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    fams = GRIDS["smoke"]().families()
    assert first["families"] == len(fams) and first["failed"] == 0
    assert first["stored"] == len(fams) * 3 == first["rows_in_store"] == first["exported"]
    df = TelemetryStore(url).dataframe()
    assert set(df["method"]) == {"fake_tracker"}
    assert (df["recomputed_layers"] == df["num_checkpointed_layers"]).all()
    for _key, fam in df.groupby(["micro_batch_size", "seq_len", "sharding", "precision", "finetune"]):
        peaks = fam.sort_values("num_checkpointed_layers")["peak_allocated_bytes"].tolist()
        assert peaks[0] >= peaks[-1]
    # second run: nothing left to do, nothing duplicated
    assert main(["--grid", "smoke", "--db", url, "--quiet"]) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["to_run"] == 0 and second["rows_in_store"] == first["rows_in_store"]


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["--models", "no-such-model", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--quiet"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_offload_families_keep_old_ids():
    import hashlib
    from dataclasses import asdict

    from training.sweep import _ADDED_FIELDS, SCHEMA_TAG

    fam = Family("gpt2", 1, 128)
    old = {k: v for k, v in asdict(fam).items() if k not in _ADDED_FIELDS and k != "extra"}
    expected = "c" + hashlib.sha256(json.dumps([SCHEMA_TAG, "fake", old, 3], sort_keys=True).encode()).hexdigest()[:31]
    assert fam.record_id(3, "fake") == expected  # ids of families from before offload are unchanged
    offloaded = Family("gpt2", 1, 128, offload_optimizer="cpu")
    assert offloaded.record_id(3, "fake") != expected
    assert offloaded.training().offload_optimizer.value == "cpu"
    assert {f.offload_optimizer for f in GRIDS["offload"]().families()} == {"cpu"}
    assert all(f.offload_optimizer == "none" for f in GRIDS["small"]().families())
