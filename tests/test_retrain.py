"""Retraining job, evaluation metrics, the k oracle and the promotion rule.

The fixture store holds real collector rows (two tiny families measured with ``training.sweep.run_sweep``
under fake tensors) plus *synthetic* rows for seven more catalog architectures, two of them above
13.5B parameters so the small-to-large split exists. Synthetic peaks are ``analytic peak x
(1.08 - 0.05 k / L)``: a learnable, k-monotone residual, so a trained model beats an untrained one.
LightGBM runs single-threaded (``n_jobs=1``): OpenMP spinning on a busy machine is slow.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pandas as pd
import pytest

from data import catalog
from data.store import TelemetryStore
from memfit.schema import GIB, ClusterSpec, Measurement, TelemetryRecord, TrainingConfig
from model.analytic import analytic_estimate
from model.evaluate import FAMILY_COLUMNS, load_rows, metrics, oracle_eval, row_configuration
from model.features import FEATURE_NAMES
from model.registry import Registry
from training.retrain import EXIT_BAD_INPUT, EXIT_NOT_PROMOTED, EXIT_OK, main, promotion_decision
from training.sweep import Family, k_values, run_sweep

SYNTHETIC_MODELS = [
    "opt-125m",
    "gpt-neo-125m",
    "qwen2.5-0.5b",
    "llama-3.2-1b",
    "tinyllama-1.1b",
    "qwen2.5-14b",
    "gemma-2-27b",
]
SYNTHETIC_FAMILIES = [
    {"micro_batch_size": 1, "seq_len": 256},
    {"micro_batch_size": 2, "seq_len": 512, "precision": "bf16"},
    {"micro_batch_size": 4, "seq_len": 1024, "attention": "eager"},
]
FAST = ["--n-estimators", "40", "--params", '{"n_jobs": 1}', "--min-rows", "20", "--quiet", "--no-coefficients"]


def _synthetic(name: str, fam: dict, k: int) -> TelemetryRecord:
    spec = catalog.spec(name)
    training = TrainingConfig(**fam, checkpoint_layers=list(range(k)))
    peak = analytic_estimate(spec, training).peak_bytes * (1.08 - 0.05 * k / spec.num_layers)
    rid = "syn" + hashlib.sha256(json.dumps([name, fam, k], sort_keys=True).encode()).hexdigest()[:29]
    return TelemetryRecord(
        record_id=rid,
        model=spec,
        training=training,
        cluster=ClusterSpec(device_name="synthetic", device_memory_bytes=80 * GIB),
        measurement=Measurement(peak_allocated_bytes=int(peak), method="fake_tracker"),
    )


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('telemetry') / 't.db'}"
    store = TelemetryStore(url)
    summary = run_sweep(
        [Family("pythia-70m", 1, 128), Family("gpt2", 1, 128)], store=store, workers=1, k_points=4, progress=False
    )
    assert not summary["failed"], summary["failed"]
    recs = [
        _synthetic(m, f, k)
        for m in SYNTHETIC_MODELS
        for f in SYNTHETIC_FAMILIES
        for k in k_values(catalog.spec(m).num_layers, 5)
    ]
    assert not store.add(recs).rejected
    return url


def _run(capsys, *args: str) -> tuple[int, dict]:
    code = main(list(args))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    return code, json.loads(lines[-1])


# -- metrics and the oracle, by hand --------------------------------------------------------------
def test_metrics_by_hand():
    m = metrics([100, 200, 400, 1000], [110, 190, 400, 1300], [120, 195, 500, 1400])
    # relative errors 0.1, 0.05, 0, 0.3
    assert m["mape_pct"] == pytest.approx(11.25)
    assert m["max_rel_err_pct"] == pytest.approx(30.0)
    assert m["p95_rel_err_pct"] == pytest.approx(27.0)  # linear quantile: 0.1 + 0.85 * (0.3 - 0.1)
    assert m["coverage"] == pytest.approx(0.75)  # 200 > 195
    assert m["mean_upper_excess_pct"] == pytest.approx(100 * (0.2 - 0.025 + 0.25 + 0.4) / 4)
    assert m["n"] == 4
    empty = metrics([], [])
    assert empty["n"] == 0 and np.isnan(empty["mape_pct"])
    assert np.isnan(metrics([1.0], [1.0])["coverage"])
    with pytest.raises(ValueError):
        metrics([1, 2], [1])


def test_oracle_eval_by_hand():
    # family: [(k, measured GiB, upper GiB)]
    fams = {
        "A": [(0, 30, 32), (2, 20, 22), (4, 12, 14)],  # exact at 16, 24 and 48
        "B": [(0, 50, 47), (3, 45, 47)],  # 16, 24: nothing fits either way; 48: oracle 3, rec 0 -> OOM
        "C": [(0, 10, 17), (1, 8, 9)],  # 16: oracle 0, rec 1 -> one extra layer; 24, 48 exact
        "D": [(0, 20, 15)],  # 16: nothing fits but rec 0 -> OOM; 24, 48 exact
        "E": [(0, 10, 20)],  # 16: fits but no rec -> false infeasible; 24, 48 exact
    }
    base = {
        c: v
        for c, v in zip(
            FAMILY_COLUMNS,
            [
                None,
                1,
                128,
                "amp_bf16",
                "adamw_foreach",
                "none",
                1,
                "sdpa",
                "full",
                None,
                0,
                "non_reentrant",
                "fake_tracker",
            ],
        )
    }
    rows, upper = [], []
    for name, pts in fams.items():
        for k, peak, up in pts:
            rows.append({**base, "model_name": name, "num_checkpointed_layers": k, "peak_allocated_bytes": peak * GIB})
            upper.append(up * GIB)
    r = oracle_eval(pd.DataFrame(rows), np.array(upper, dtype=float), capacities_gib=(16, 24, 48))
    assert r["n_families"] == 5
    assert r["n_both_infeasible"] == 2
    assert r["n_cases"] == 13
    assert r["exact_k_rate"] == pytest.approx(9 / 13)
    assert r["oom_rate"] == pytest.approx(2 / 13)
    assert r["over_rate"] == pytest.approx(1 / 13)
    assert r["false_infeasible_rate"] == pytest.approx(1 / 13)
    assert r["mean_extra_layers"] == pytest.approx(1.0)
    at16 = r["per_capacity"]["16"]
    assert (at16["n_cases"], at16["n_both_infeasible"]) == (4, 1)
    assert at16["exact_k_rate"] == pytest.approx(1 / 4) and at16["oom_rate"] == pytest.approx(1 / 4)
    assert r["per_capacity"]["48"]["oom_rate"] == pytest.approx(1 / 5)


def test_promotion_rule():
    assert promotion_decision({"mape_pct": 9.0, "coverage": 0.5, "n": 10}, None)[0]
    cur = {"mape_pct": 2.95, "coverage": 0.96, "n": 10}
    assert promotion_decision({"mape_pct": 3.0, "coverage": 0.94, "n": 10}, cur)[0]  # 3.0 <= 3.009, 0.94 >= 0.94
    ok, why = promotion_decision({"mape_pct": 3.1, "coverage": 0.99, "n": 10}, cur)
    assert not ok and "MAPE" in why
    ok, why = promotion_decision({"mape_pct": 1.0, "coverage": 0.93, "n": 10}, cur)
    assert not ok and "coverage" in why
    low = {"mape_pct": 3.0, "coverage": 0.90, "n": 10}  # a current bound below 95 %: need >= 0.89
    assert promotion_decision({"mape_pct": 3.0, "coverage": 0.895, "n": 10}, low)[0]
    assert not promotion_decision({"mape_pct": 3.0, "coverage": 0.885, "n": 10}, low)[0]
    assert not promotion_decision({"mape_pct": float("nan"), "coverage": float("nan"), "n": 0}, cur)[0]


def test_load_rows_validates_dedups_and_drops_oom(db, tmp_path):
    df_store, rejected = load_rows(db)
    assert not rejected and df_store.attrs["n_oom_dropped"] == 0
    good = df_store.iloc[0].to_dict()
    bad = {**good, "record_id": "bad000001", "num_attention_heads": 7}  # does not divide hidden_size
    conflict = {**good, "peak_allocated_bytes": good["peak_allocated_bytes"] + 1}
    oom = {**good, "record_id": "oom000001", "oom": True}
    path = tmp_path / "extra.csv"
    pd.DataFrame([good, bad, conflict, oom]).to_csv(path, index=False)
    df, rejected = load_rows(db, [path])
    assert len(df) == len(df_store) and df["record_id"].is_unique
    assert df.attrs["n_duplicates"] == 1 and df.attrs["n_oom_dropped"] == 1
    reasons = {r["record_id"]: r["reason"] for r in rejected}
    assert "num_attention_heads" in reasons["bad000001"] or "divide" in reasons["bad000001"]
    assert "different content" in reasons[good["record_id"]]
    only_file, _ = load_rows(files=[path])  # files alone: the store is not read
    assert len(only_file) == 1
    with pytest.raises(FileNotFoundError):
        load_rows(files=[tmp_path / "missing.parquet"])


# -- the job ------------------------------------------------------------------------------------------
def test_retrain_lifecycle(db, tmp_path, capsys):
    reg_dir = tmp_path / "models"
    reg = Registry(reg_dir)

    code, s = _run(capsys, "--db", db, "--registry", str(reg_dir), *FAST)
    assert code == EXIT_OK, s
    assert s["status"] == "promoted" and s["version"] == "0001" and reg.current() == "0001"
    report = reg_dir / "0001" / "report"
    for name in ("report.md", "report.json", "pred_vs_measured.png", "error_by_architecture.png", "memory_vs_k.png"):
        assert (report / name).stat().st_size > 0, name
    rep = json.loads((report / "report.json").read_text())
    assert {t["status"] for t in rep["targets"]} <= {"met", "not met", "n/a"}
    assert rep["small_to_large"]["n_test"] > 0  # qwen2.5-14b and gemma-2-27b
    assert set(rep["leave_architecture_out"]["baselines"]) == {"analytic", "deepspeed_states", "accelerate_weights"}
    assert "MAPE leave-architecture-out" in (report / "report.md").read_text()
    assert reg.meta("0001")["feature_names"] == FEATURE_NAMES
    assert reg.load().estimator.predict(load_rows(db)[0]).min() > 0

    # a corrupt current model is reported and treated as absent
    (reg_dir / "0001" / "model.txt").write_text("not a lightgbm model\n")
    code, s = _run(capsys, "--db", db, "--registry", str(reg_dir), *FAST)
    assert code == EXIT_OK, s
    assert s["current"] == "0001" and s["current_status"].startswith("unusable")
    assert s["reason"] == "no usable current model" and reg.current() == "0002"

    # a much worse model (one tiny step away from the analytic estimate) is registered, not promoted
    code, s = _run(
        capsys,
        "--db",
        db,
        "--registry",
        str(reg_dir),
        "--n-estimators",
        "1",
        "--params",
        '{"n_jobs": 1, "learning_rate": 1e-6}',
        "--min-rows",
        "20",
        "--quiet",
        "--no-coefficients",
    )
    assert code == EXIT_NOT_PROMOTED, s
    assert s["status"] == "not_promoted" and "MAPE" in s["reason"]
    assert reg.versions() == ["0001", "0002", "0003"] and reg.current() == "0002"

    # rollback is pointing CURRENT back
    reg.promote("0003")
    reg.promote("0002")
    assert reg.current() == "0002" and reg.load().version == "0002"
    with pytest.raises(ValueError):
        reg.promote("0042")

    pickles = [p for p in reg_dir.rglob("*") if p.suffix in (".pkl", ".pickle", ".joblib", ".pt")]
    assert not pickles, pickles


def test_dry_run_registers_nothing(db, tmp_path, capsys):
    reg_dir, out = tmp_path / "models", tmp_path / "report"
    code, s = _run(capsys, "--db", db, "--registry", str(reg_dir), "--dry-run", "--report-dir", str(out), *FAST)
    assert code == EXIT_OK and s["status"] == "dry_run"
    assert Registry(reg_dir).versions() == [] and Registry(reg_dir).current() is None
    assert (out / "report.md").exists() and (out / "report.json").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--engine", "dask"],  # no --dask-address
        ["--engine", "spark"],
        ["--files", "/nonexistent/t.parquet"],
        ["--min-rows", "100000"],
        ["--params", "[1]"],
        ["--params", '{"bogus": 1}'],
        ["--n-estimators", "0"],
        ["--jobs", "0"],
    ],
)
def test_bad_input_exits_2(db, tmp_path, capsys, args):
    argv = ["--db", db, "--registry", str(tmp_path / "models"), "--quiet", *args]
    assert main(argv) == EXIT_BAD_INPUT
    assert Registry(tmp_path / "models").versions() == []


def test_defaults_are_the_services_store_and_registry(tmp_path, capsys, monkeypatch):
    """Without --db/--files and --registry the retrain reads and writes where the service does
    (``MEMFIT_DATA_DIR``, service.settings): it read the checkout's data/ and promoted where no service looked."""
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(tmp_path))
    for name in ("MEMFIT_DB_URL", "MEMFIT_REGISTRY_DIR"):
        monkeypatch.delenv(name, raising=False)
    code, s = _run(capsys, "--dry-run", "--quiet")
    # no store there: said, not the checkout's 15,168 rows read, and no empty store created by the reading
    assert code == EXIT_BAD_INPUT and s["error"] == (
        f"no telemetry store at {tmp_path / 'telemetry.db'} (--db sqlite:///{tmp_path / 'telemetry.db'})"
    )
    assert s["registry"] == str(tmp_path / "models") and not (tmp_path / "telemetry.db").exists()
    TelemetryStore(f"sqlite:///{tmp_path / 'telemetry.db'}")  # an empty store the service created
    code, s = _run(capsys, "--dry-run", "--quiet")
    assert code == EXIT_BAD_INPUT and s["rows"] == 0
    # a new user's first retrain: the empty store is said, with the way to train on the shipped rows
    assert s["error"].startswith("0 valid rows < --min-rows 100; the store is empty until telemetry arrives")
    assert s["error"].endswith("pass --files data/telemetry/telemetry.parquet to train on those")


def test_dask_engine(db, tmp_path, capsys):
    from distributed import LocalCluster

    reg_dir = tmp_path / "models"
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster:
        code, s = _run(
            capsys,
            "--db",
            db,
            "--registry",
            str(reg_dir),
            "--engine",
            "dask",
            "--dask-address",
            cluster.scheduler_address,
            *FAST,
        )
    assert code == EXIT_OK, s
    loaded = Registry(reg_dir).load()
    assert loaded.estimator.booster_.num_trees() == 40
    df, _ = load_rows(db)
    pred = loaded.estimator.predict(df)
    assert np.isfinite(pred).all() and (pred > 0).all()
    assert np.median(np.abs(pred / df["peak_allocated_bytes"] - 1)) < 0.5


def test_splits_that_cannot_be_formed_are_skipped(db):
    from model.evaluate import cross_evaluate

    df, _ = load_rows(db)
    two = df[df["model_name"].isin(["gpt2", "opt-125m"])].reset_index(drop=True)
    pred, upper, s = cross_evaluate(two, lambda: pytest.fail("nothing to fit"), "leave_architecture_out")
    assert "at least 3 architectures" in s["skipped"] and np.isnan(pred).all() and np.isnan(upper).all()
    _, _, s = cross_evaluate(two, lambda: pytest.fail("nothing to fit"), "small_to_large")
    assert "both sides" in s["skipped"]
    with pytest.raises(ValueError):
        cross_evaluate(two, lambda: None, "random")


def test_folds_in_worker_processes_give_the_same_predictions(db):
    # cross_evaluate(n_jobs=2) fits and answers two folds at once in joblib's worker processes: the predictions,
    # bounds and scores are those of the folds run one after another here
    from model.estimator import PeakMemoryRegressor
    from model.evaluate import CurveEstimator, cross_evaluate
    from model.terms import TermsCache

    df, _ = load_rows(db)
    terms = TermsCache()

    def make():
        return CurveEstimator(terms, lambda: PeakMemoryRegressor(n_estimators=40, n_jobs=1))

    lines = []
    pred, upper, s = cross_evaluate(df, make, "leave_architecture_out")
    pred2, upper2, s2 = cross_evaluate(df, make, "leave_architecture_out", progress=lines.append, n_jobs=2)
    assert s["n_folds"] > 2 and np.isfinite(pred).sum() == len(df)
    np.testing.assert_array_equal(pred2, pred)
    np.testing.assert_array_equal(upper2, upper)
    assert s2["metrics"] == s["metrics"] and s2["oracle"] == s["oracle"]
    assert [ln.split(":")[0] for ln in lines] == [
        f"leave_architecture_out fold {i + 1}/{s['n_folds']}" for i in range(s["n_folds"])
    ]
    with pytest.raises(ValueError, match="n_jobs must be >= 1"):
        cross_evaluate(df, make, "leave_architecture_out", n_jobs=0)


def test_a_version_refused_at_promotion_is_reported_not_raised(db, tmp_path, capsys, monkeypatch):
    """Promotion re-runs the load checks (checksum, child-process parse, canary floor); a refusal is the
    job's answer (not promoted, exit 3, the reason in the summary), and CURRENT does not move."""
    from model.registry import IncompatibleArtifact

    def refuse(self, version):
        raise IncompatibleArtifact(f"model {version}: canary below the model-state floor (test)")

    monkeypatch.setattr(Registry, "promote", refuse)
    reg_dir = tmp_path / "models"
    code, s = _run(capsys, "--db", db, "--registry", str(reg_dir), *FAST)
    assert code == 3 and s["status"] == "not_promoted" and "below the model-state floor" in s["refused"]
    assert Registry(reg_dir).versions() == ["0001"] and Registry(reg_dir).current() is None


def test_retrain_registers_learned_coefficients_and_the_service_serves_them(db, tmp_path, capsys):
    """Issue 8: the job fits the learned phase coefficients on the shipped traced terms, calibrates their bound
    margin on held-out architectures, registers them as LightGBM text files + JSON with checksums (no pickle);
    the loaded version serves them on the provisional path, and a changed coefficient file is refused."""
    from model.curve import PROVISIONAL_COEFFICIENTS
    from model.registry import IncompatibleArtifact
    from model.terms import TermsCache
    from service.models import ModelHolder

    reg_dir = tmp_path / "models"
    fast = [a for a in FAST if a != "--no-coefficients"]
    # two evaluation folds at once: the job's closures (coefficient model, curve) travel to joblib's workers
    code, s = _run(
        capsys, "--db", db, "--registry", str(reg_dir), "--coefficient-estimators", "3", "--jobs", "2", *fast
    )
    assert code == EXIT_OK, s
    reg = Registry(reg_dir)
    meta = reg.meta("0001")
    files = sorted(p.name for p in (reg_dir / "0001" / "coefficients").iterdir())
    assert "coefficients.json" in files and all(f.endswith((".txt", ".json")) for f in files)
    assert {f"coefficients/{f}" for f in files} <= set(meta["artifact_sha256"])
    assert meta["coefficients"]["boosters"] == len(files) - 1 and meta["coefficients"]["n_entries"] > 400
    assert meta["coefficient_canary"] and 0 < meta["bound_margins"][PROVISIONAL_COEFFICIENTS] < 1
    loaded = reg.load()
    assert loaded.coefficients is not None and loaded.coefficients.boosters_

    # the service's recommender answers an untraced, covered configuration from the learned coefficients
    holder = ModelHolder(reg, terms=TermsCache(shipped_dir=None))
    assert holder.refresh(force=True)
    spec, hf = catalog.spec("qwen2.5-0.5b"), catalog.get("qwen2.5-0.5b")["hf_config"]
    c = holder.recommender.predictor.curve(spec, TrainingConfig(micro_batch_size=2, seq_len=1024), hf)
    assert c.path == "provisional" and c.learned_coefficients
    k0 = c.points[0]
    assert k0.upper_bytes == int(np.ceil(k0.predicted_bytes * (1 + meta["bound_margins"][PROVISIONAL_COEFFICIENTS])))

    one = reg_dir / "0001" / "coefficients" / next(f for f in files if f.endswith(".txt"))
    one.write_text(one.read_text().replace("tree", "tre", 1))
    with pytest.raises(IncompatibleArtifact, match="does not match"):
        reg.load("0001")


def test_a_pipeline_stage_row_is_scored_against_that_stage_not_the_bottleneck():
    """A pipelined job reports each stage's peak (``Measurement.pipeline_stage``); the evaluation compared every
    stage's row with the bottleneck stage's answer, so the last stage of a 1F1B pipeline (one micro-batch in
    flight, 16 layers) read as over-predicted by the first stage's activations."""
    from model.evaluate import CurveEstimator
    from model.terms import TermsCache
    from tests.helpers import record

    spec = catalog.spec("llama-3-8b").model_dump()
    training = {"micro_batch_size": 1, "seq_len": 4096, "pipeline_parallel_size": 2, "num_micro_batches": 4}
    rows = []
    for stage in (0, 1, None):
        for k in (0, 8):
            r = record(
                **spec,
                **training,
                checkpoint_layers=list(range(k)),
                gpu_count=2,
                device_memory_bytes=80 << 30,
                pipeline_stage=stage,
            )
            rows.append(r.to_row())
    X = pd.DataFrame(rows)
    est = CurveEstimator(TermsCache())
    est.provisional_, est.margins_ = None, {}
    pred, upper = est.predict_both(X)
    job = row_configuration(X.iloc[0].to_dict())
    predictor = est._predictor(None, {})
    c = predictor.curve(job.spec, job.training, job.hf_config)
    assert c.path == "traced" and c.pipeline is not None and len(c.pipeline.stages) == 2
    margin = predictor.margins[est.path_[0]]
    for i, (stage, k) in enumerate([(0, 0), (0, 8), (1, 0), (1, 8), (None, 0), (None, 8)]):
        if stage is None:  # not said: the answer's (bottleneck) peak, as before
            assert (pred[i], upper[i]) == (c.points[k].predicted_bytes, c.points[k].upper_bytes)
        else:
            assert pred[i] == c.pipeline.stage_peak_bytes[k, stage]
            assert upper[i] == math.ceil(pred[i] * (1 + margin))
    # 1F1B: the first stage holds two micro-batches' activations, the last one: stage 1 peaks lower at k = 0
    assert pred[2] < pred[0] <= pred[4]
