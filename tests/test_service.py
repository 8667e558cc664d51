import time

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.helpers import record


@pytest.fixture
def client(tmp_path, small_registry):
    app = create_app(
        Settings(
            db_url=f"sqlite:///{tmp_path / 's.db'}",
            token="s3cret",
            max_body_bytes=64 * 1024,
            registry_dir=str(small_registry.root),
        )
    )
    return TestClient(app)


def test_not_ready_without_a_model(tmp_path):
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 's.db'}", registry_dir=str(tmp_path / "empty")))
    c = TestClient(app)
    assert c.get("/v2/health/live").status_code == 200
    r = c.get("/v2/health/ready")
    assert r.status_code == 503 and "no model" in r.json()["detail"]
    r = c.post(
        "/recommend",
        json={"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 64}, "cluster": {"gpu": "T4"}},
    )
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
    # items that are not objects are invalid records like any other: rejected one by one, the rest stored (a helper's
    # batch [record, "str", 5] came back 422 as a whole)
    other = record(record_id="job-00000003", seq_len=256).model_dump(mode="json")
    r = client.post("/telemetry", json=[other, "str", 5, None], headers=AUTH)
    assert r.status_code == 200 and r.json()["stored"] == ["job-00000003"]
    assert [e["index"] for e in r.json()["rejected"]] == [1, 2, 3]


def test_telemetry_read_back_stored_quarantined_and_unknown(client):
    good = record(record_id="job-00000011").model_dump(mode="json")
    r = client.post("/telemetry", json=[good], headers=AUTH)
    assert r.json()["stored"] == ["job-00000011"]
    conflict = record(record_id="job-00000011", peak_allocated_bytes=999_999_488).model_dump(mode="json")
    implausible = record(
        record_id="job-00000012", method="cuda", oom=False, peak_allocated_bytes=(1 << 34) + 4096
    ).model_dump(mode="json")
    r = client.post("/telemetry", json=[conflict, implausible], headers=AUTH)
    assert [q["record_id"] for q in r.json()["quarantined"]] == ["job-00000011", "job-00000012"]

    kept = client.get("/telemetry/job-00000011", headers=AUTH)
    assert kept.status_code == 200
    j = kept.json()
    assert j["record"]["measurement"]["peak_allocated_bytes"] == 123_456_512  # the first one: never overwritten
    assert len(j["quarantined"]) == 1 and "different content" in j["quarantined"][0]["reason"]
    assert j["quarantined"][0]["record"]["measurement"]["peak_allocated_bytes"] == 999_999_488

    j = client.get("/telemetry/job-00000012", headers=AUTH).json()
    assert j["record"] is None and "exceeds device_memory_bytes" in j["quarantined"][0]["reason"]

    missing = client.get("/telemetry/job-99999999", headers=AUTH)
    assert missing.status_code == 404 and missing.headers["content-type"].startswith("application/problem+json")
    assert "job-99999999" in missing.json()["detail"]
    bad = client.get("/telemetry/has%20space", headers=AUTH)
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"].endswith("record_id")
    assert client.get("/telemetry/job-00000011").status_code == 401  # reading telemetry needs the token too


def test_telemetry_post_links_to_the_read_back():
    """The ingestion answer's OpenAPI links name the read-back, so stateful clients can follow them."""
    from service.app import create_app as make

    spec = make(Settings(db_url="sqlite:///:memory:", registry_dir="/nonexistent", warm_up=False)).openapi()
    links = spec["paths"]["/telemetry"]["post"]["responses"]["200"]["links"]
    assert {v["operationId"] for v in links.values()} == {"read_telemetry_record"}
    assert spec["paths"]["/telemetry/{record_id}"]["get"]["operationId"] == "read_telemetry_record"
    assert links["ReadStored"]["parameters"] == {"record_id": "$response.body#/stored/0"}


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
    from data import catalog
    from memfit.schema import TrainingConfig
    from model.curve import PROVISIONAL, TRACED, Curve
    from service.recommender import CurveCache

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


def test_curve_cache_recomputes_a_provisional_curve_once_its_trace_failed():
    """A curve answered while its configuration waits in the background tracer's queue says "ask again"; once
    the trace has failed, the next answer is recomputed and says so (it said "ask again" forever)."""
    from data import catalog
    from memfit.schema import TrainingConfig
    from model.curve import PROVISIONAL, Curve
    from service.recommender import CurveCache

    class Tracer:
        pending = {"key"}  # noqa: RUF012 - the stand-in's state; the test swaps it

    class Predictor:
        terms, tracer, calls = {}, Tracer(), 0

        def curve(self, model, training, hf_config=None):
            self.calls += 1
            reason = "tracing it now" if "key" in self.tracer.pending else "tracing it failed"
            return Curve(path=PROVISIONAL, points=[], floor_bytes=1, terms_key="key", reason=reason)

    pred = Predictor()
    cache = CurveCache(pred, recheck_s=0.0)
    spec, t = catalog.spec("gpt2"), TrainingConfig(micro_batch_size=1, seq_len=64)
    assert cache.curve(spec, t).reason == "tracing it now"
    assert cache.curve(spec, t).reason == "tracing it now" and pred.calls == 1  # still queued: cached
    Tracer.pending = set()  # the trace ended without terms
    assert cache.curve(spec, t).reason == "tracing it failed" and pred.calls == 2
    assert cache.curve(spec, t).reason == "tracing it failed" and pred.calls == 2


def test_dependencies_can_be_swapped(client):
    """Routes take the recommender from service.deps: a test (or a deployment) swaps it in one place."""
    from memfit.errors import ModelUnavailable
    from service.deps import get_recommender

    def unavailable():
        raise ModelUnavailable("swapped out for the test", retry_after_s=7)

    client.app.dependency_overrides[get_recommender] = unavailable
    r = client.post(
        "/recommend",
        json={"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 64}, "cluster": {"gpu": "T4"}},
    )
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert r.headers["content-type"].startswith("application/problem+json") and "swapped out" in r.json()["detail"]
    client.app.dependency_overrides.clear()


def test_openapi_documents_error_answers_as_sent(tmp_path):
    """Errors are problem+json in the schema too (schemathesis' conformance checks found 401, 404, 413,
    415 and 503 undocumented and 422 documented as application/json)."""

    def spec(**kw):
        return create_app(
            Settings(db_url=f"sqlite:///{tmp_path / 'o.db'}", registry_dir="/nonexistent", warm_up=False, **kw)
        ).openapi()

    with_token = spec(token="s3cret")
    post = with_token["paths"]["/telemetry"]["post"]
    assert {"400", "401", "413", "415", "422", "503"} <= set(post["responses"])
    assert set(post["responses"]["422"]["content"]) == {"application/problem+json"}
    assert post["security"] == [{"HTTPBearer": []}]
    assert "404" in with_token["paths"]["/telemetry/{record_id}"]["get"]["responses"]
    assert "503" in with_token["paths"]["/recommend"]["post"]["responses"]
    assert "Problem" in with_token["components"]["schemas"]
    items = post["requestBody"]["content"]["application/json"]["schema"]["items"]["anyOf"]
    assert items[0] == {"$ref": "#/components/schemas/TelemetryRecord"}
    assert "TelemetryRecord" in with_token["components"]["schemas"]  # the reference resolves
    assert "HTTPValidationError" not in with_token["components"]["schemas"]
    open_post = spec()["paths"]["/telemetry"]["post"]
    assert open_post["security"] == [{"HTTPBearer": []}, {}] and "401" not in open_post["responses"]


def test_read_back_on_a_read_only_server_is_503(tmp_path, small_registry):
    app = create_app(
        Settings(
            db_url=f"sqlite:///{tmp_path / 'r.db'}",
            registry_dir=str(small_registry.root),
            read_only=True,
            warm_up=False,
        )
    )
    r = TestClient(app).get("/telemetry/job-00000001")
    assert r.status_code == 503 and "read-only" in r.json()["detail"]
    assert r.headers["content-type"].startswith("application/problem+json")


def test_offload_values_are_422_naming_the_field_and_answers_carry_host_memory(client):
    body = {
        "model": "gpt2",
        "training": {"micro_batch_size": 1, "seq_len": 64, "offload_optimizer": "nvme"},
        "cluster": {"gpu": "T4"},
    }
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


def test_local_command_line_and_service_take_the_same_gpu_overhead(tmp_path):
    """A new user's `memfit recommend` gave k = 23 where the service said 24 for the README's own example: the
    local holder took the unfitted default allowance, the service the one measured on GPUs. Both now take
    :func:`service.models.overhead_from` (the shipped GPU pressure measurements without CUDA telemetry)."""
    from model.overhead import DEFAULT_ALLOWANCE_RATIO
    from model.registry import Registry
    from service.models import ModelHolder, overhead_from

    measured = overhead_from(None)
    assert measured.allowance_ratio(False)[0] != DEFAULT_ALLOWANCE_RATIO
    assert measured.allowance_ratio(False)[1].startswith("median reserved / allocated of the GPU pressure runs")
    holder = ModelHolder(Registry(tmp_path / "models"))
    assert holder.overhead.to_dict() == measured.to_dict()


def test_an_empty_or_oversized_batch_is_422_with_the_allowed_length(client):
    # a new user's {"items": []} got a 422 without an allowed range, where every other field names one
    r = client.post("/predict", json={"items": []})
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["errors"][0]["field"] == "items" and r.json()["errors"][0]["allowed"] == "a list of 1 to 1024 items"
    assert "(allowed: a list of 1 to 1024 items)" in r.json()["detail"]


def test_a_layout_outside_its_two_values_names_them(client):
    # a helper's "layout": "random" read "String should match pattern '^(block|even)$' (allowed: a string)"
    body = {"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 64}, "cluster": {"gpu": "T4"}}
    r = client.post("/recommend", json={**body, "layout": "random"})
    assert r.status_code == 422 and r.json()["detail"] == "layout: Input should be 'block' or 'even'"


@pytest.mark.parametrize("gpu", ["T4", "V100-32GB"])
def test_flash_attention_on_a_gpu_before_ampere_is_422(client, gpu):
    # helper 40: --attention flash on a T4 or a V100 answered as if it ran; FlashAttention-2 needs sm80
    body = {"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 64, "attention": "flash"}}
    for path, extra in (("/recommend", {}), ("/predict", {"k": 0})):
        payload = {**body, "cluster": {"gpu": gpu}, **extra}
        r = client.post(path, json=payload if path == "/recommend" else {"items": [payload]})
        assert r.status_code == 422, r.text
        (e,) = r.json()["errors"]
        assert (
            e["field"].endswith("training.attention") and "FlashAttention-2 needs sm80 (A100) or newer" in e["allowed"]
        )


def test_recommender_check_422_detail_names_the_field_and_the_allowed_range(client):
    # the allowed range of a recommender check (InvalidConfiguration, service/errors.py) was only in errors[]:
    # the detail read "training: data*tensor*pipeline*context parallel size = 1*16*1*1 = 16 exceeds
    # cluster.gpu_count=8", naming neither the field nor what it may be
    body = {
        "model": "gpt2",
        "training": {"micro_batch_size": 1, "seq_len": 64, "tensor_parallel_size": 16},
        "cluster": {"gpu": "T4", "gpu_count": 8},
    }
    r = client.post("/recommend", json=body)
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["detail"] == (
        "training.tensor_parallel_size: data*tensor*pipeline*context parallel size = "
        "1*16*1*1 = 16 exceeds cluster.gpu_count=8 (allowed: an integer in [1, 8])"
    )
    assert r.json()["errors"] == [
        {
            "field": "training.tensor_parallel_size",
            "message": "training: data*tensor*"
            "pipeline*context parallel size = 1*16*1*1 = 16 exceeds cluster.gpu_count=8",
            "allowed": "an integer in [1, 8]",
        }
    ]
    body["training"]["tensor_parallel_size"] = 5  # gpt2: 12 query and 12 KV heads
    r = client.post("/predict", json={"items": [{**body, "k": 0}]})
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "items.0.training.tensor_parallel_size: must be one of 1, 2, 3, 4, 6, 12 (a divisor "
        "of num_attention_heads=12 that divides or is a multiple of num_key_value_heads=12)"
        ", got 5"
    )
    r = client.post("/recommend", json={**body, "model": "gtp2"})
    assert r.status_code == 422
    assert r.json()["detail"].startswith("model: unknown model 'gtp2'; close matches: gpt2")
    assert r.json()["detail"].endswith("(allowed: a catalog name or a HF config.json object)")
    # an item's unknown model: the message was prefixed as if it named a field, "items.0.unknown model 'gtp2'"
    r = client.post("/predict", json={"items": [{**body, "model": "gtp2", "k": 0}]})
    assert r.json()["detail"].startswith("items.0.model: unknown model 'gtp2'; close matches: gpt2"), r.json()


def test_the_warm_up_ends_with_the_application(tmp_path, small_registry):
    # the warm-up thread builds catalog models on the meta device, and transformers sets the process-wide default
    # dtype while it builds one: left running after the application, it doubled a fake-tensor measurement that
    # the same process made next (tests/test_moe.py after tests/test_field_errors.py)
    import threading

    app = create_app(
        Settings(db_url=f"sqlite:///{tmp_path / 's.db'}", registry_dir=str(small_registry.root), warm_up=True)
    )
    with TestClient(app):
        pass
    assert not any(t.name == "memfit-warm-up" for t in threading.enumerate())


def test_the_warm_up_starts_the_tracing_process(tmp_path, small_registry, monkeypatch):
    """With ``start_tracer`` (the default; tests/conftest.py turns it off for the other tests) the tracing process
    is started after the warm-up, before any configuration needs a trace."""
    import service.tracing

    started = []
    monkeypatch.setattr(service.tracing.BackgroundTracer, "start", lambda self: started.append(self))
    settings = Settings(
        db_url=f"sqlite:///{tmp_path / 's.db'}",
        registry_dir=str(small_registry.root),
        start_tracer=True,
        warm_up=True,
    )
    with TestClient(create_app(settings)) as client:
        for _ in range(600):
            if client.get("/v2/health/ready").json().get("details", {}).get("warmed_up") and started:
                break
            time.sleep(0.1)
    assert len(started) == 1


def test_a_section_that_is_no_object_gets_its_fields_as_allowed(client):
    # a new user's "cluster": null answered pydantic's "Input should be a valid dictionary or object to extract
    # fields from" with no allowed key (FastAPI validates bodies with from_attributes: model_attributes_type)
    base = {"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 128}, "cluster": {"gpu": "L4"}}
    for section, value, got in (("cluster", None, "null"), ("training", [], "list"), ("cluster", "A100", "str")):
        r = client.post("/recommend", json={**base, section: value})
        assert r.status_code == 422, r.text
        (error,) = r.json()["errors"]
        assert error["field"] == section and error["message"] == f"must be an object (got {got})"
        assert error["allowed"].startswith("an object with fields [")
        assert ("'gpu'" if section == "cluster" else "'seq_len'") in error["allowed"]
    r = client.post("/recommend", json={**base, "model": None})
    assert r.json()["errors"] == [
        {
            "field": "model",
            "message": "wrong type (got null)",
            "allowed": "catalog name (e.g. 'llama-3-8b'), a HF config.json dict, or explicit architecture fields",
        }
    ]
