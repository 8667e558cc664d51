import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.helpers import record


@pytest.fixture
def client(tmp_path, small_registry):
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 's.db'}", token="s3cret", max_body_bytes=64 * 1024,
                              registry_dir=str(small_registry.root)))
    return TestClient(app)


def test_not_ready_without_a_model(tmp_path):
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 's.db'}", registry_dir=str(tmp_path / "empty")))
    c = TestClient(app)
    assert c.get("/v2/health/live").status_code == 200
    r = c.get("/v2/health/ready")
    assert r.status_code == 503 and "no model" in r.json()["detail"]
    r = c.post("/recommend", json={"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 64},
                                   "cluster": {"gpu": "T4"}})
    assert r.status_code == 503


AUTH = {"Authorization": "Bearer s3cret"}


def test_health(client):
    assert client.get("/v2/health/live").json() == {"status": "live"}
    j = client.get("/v2/health/ready").json()
    assert j["telemetry_records"] == 0 and j["model_version"] == "0001"


def test_telemetry_ingest_idempotent_with_reasons(client):
    good = record(record_id="job-00000001").model_dump(mode="json")
    bad = record(record_id="job-00000002").model_dump(mode="json")
    bad["training"]["micro_batch_size"] = 0
    r = client.post("/telemetry", json=[good, bad], headers=AUTH)
    assert r.status_code == 200
    body = r.json()
    assert body["stored"] == ["job-00000001"]
    assert body["rejected"][0]["index"] == 1 and "micro_batch_size" in body["rejected"][0]["reason"]
    r = client.post("/telemetry", json=[good], headers=AUTH)
    assert r.json()["duplicates"] == ["job-00000001"]
    assert client.get("/v2/health/ready").json()["telemetry_records"] == 1


def test_token_required(client):
    r = client.post("/telemetry", json=[], headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["content-type"].startswith("application/problem+json")


def test_malformed_and_oversized_bodies_are_problems(client):
    r = client.post("/telemetry", content=b"{not json", headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    r = client.post("/telemetry", json={"not": "a list"}, headers=AUTH)
    assert r.status_code == 422
    big = b"[" + b" " * (70 * 1024) + b"]"
    r = client.post("/telemetry", content=big, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["status"] == 413


def test_curve_cache_reuses_curves_and_refreshes_a_provisional_one_once_traced():
    from memfit.schema import TrainingConfig
    from model.curve import PROVISIONAL, TRACED, Curve
    from service.recommender import CurveCache
    from data import catalog

    class Predictor:
        def __init__(self):
            self.terms, self.calls = {}, 0

        def curve(self, model, training, hf_config=None):
            self.calls += 1
            path = TRACED if "key" in self.terms else PROVISIONAL
            return Curve(path=path, points=[], floor_bytes=1, terms_key="key")

    pred = Predictor()
    cache = CurveCache(pred, recheck_s=0.0)
    spec, t = catalog.spec("gpt2"), TrainingConfig(micro_batch_size=1, seq_len=64)
    first = cache.curve(spec, t, {"model_type": "gpt2"})
    assert cache.curve(spec, t, {"model_type": "gpt2"}) is first and pred.calls == 1
    assert cache.curve(spec, t.model_copy(update={"seq_len": 128}), {"model_type": "gpt2"}).path == PROVISIONAL
    assert pred.calls == 2
    pred.terms["key"] = {"coef": []}  # the background trace landed
    assert cache.curve(spec, t, {"model_type": "gpt2"}).path == TRACED and pred.calls == 3
    assert cache.curve(spec, t, {"model_type": "gpt2"}).path == TRACED and pred.calls == 3


def test_dependencies_can_be_swapped(client):
    """Routes take the recommender from service.deps: a test (or a deployment) swaps it in one place."""
    from memfit.errors import ModelUnavailable
    from service.deps import get_recommender

    def unavailable():
        raise ModelUnavailable("swapped out for the test", retry_after_s=7)

    client.app.dependency_overrides[get_recommender] = unavailable
    r = client.post("/recommend", json={"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 64},
                                        "cluster": {"gpu": "T4"}})
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert r.headers["content-type"].startswith("application/problem+json") and "swapped out" in r.json()["detail"]
    client.app.dependency_overrides.clear()


def test_offload_values_are_422_naming_the_field_and_answers_carry_host_memory(client):
    body = {"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 64, "offload_optimizer": "nvme"},
            "cluster": {"gpu": "T4"}}
    r = client.post("/recommend", json=body)
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    assert "offload_optimizer" in r.text and "'none' or 'cpu'" in r.text
    body["training"] = {"micro_batch_size": 1, "seq_len": 64, "offload_parameters": "cpu"}
    r = client.post("/recommend", json=body)
    assert r.status_code == 422 and "needs offload_optimizer='cpu'" in r.text
    body["training"] = {"micro_batch_size": 1, "seq_len": 64, "offload_optimizer": "cpu"}
    r = client.post("/recommend", json=body)
    assert r.status_code == 200
    rec = r.json()
    assert rec["host_memory_bytes"] > 0 and rec["breakdown"]["optimizer_states_bytes"] == 0
    r = client.post("/predict", json={"items": [{**body, "k": 0}]})
    assert r.status_code == 200 and r.json()["predictions"][0]["host_memory_bytes"] == rec["host_memory_bytes"]
