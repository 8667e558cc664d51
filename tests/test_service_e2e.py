"""End to end against a real uvicorn server in a subprocess (loopback only)."""

from __future__ import annotations

import itertools
import shutil

import httpx
import pytest

from model.registry import IncompatibleArtifact
from tests.helpers import HTTP_TIMEOUT_S, record, running_service

LLAMA8B_8xH100 = {
    "model": "llama-3-8b",
    "training": {"micro_batch_size": 2, "seq_len": 8192, "sharding": "zero3"},
    "cluster": {"gpu": "H100-80GB", "gpu_count": 8},
}


@pytest.fixture(scope="module")
def server(small_registry, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("srv")
    with running_service(
        small_registry.root, f"sqlite:///{tmp / 't.db'}", MEMFIT_TOKEN="tok", MEMFIT_MAX_BODY_BYTES="200000"
    ) as base:
        yield base, small_registry


def test_recommend_llama_8b(server):
    base, _ = server
    r = httpx.post(base + "/recommend", json=LLAMA8B_8xH100, timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["num_layers"] == 32 and len(j["curve"]) == 33
    uppers = [c["total_upper_bytes"] for c in j["curve"]]
    assert all(b <= a for a, b in itertools.pairwise(uppers))  # monotone in k
    if j["fits"]:  # the fit test keeps the largest request free beside the total (allocator_room_bytes)
        room = j["allocator_room_bytes"] or 0
        assert j["layers"] == list(range(j["k"])) and j["total_upper_bytes"] + room <= j["usable_bytes"]
        assert j["k"] == 0 or uppers[j["k"] - 1] + room > j["usable_bytes"]  # smallest such k
        assert [c["fits"] for c in j["curve"]] == [k >= j["k"] for k in range(33)]
    else:
        assert j["shortfall_bytes"] > 0 and j["alternatives"]
    assert set(j["breakdown"]) >= {"parameters_bytes", "gradients_bytes", "optimizer_states_bytes"}
    assert sum(j["breakdown"].values()) == j["predicted_peak_bytes"]  # the parts add up exactly


@pytest.mark.parametrize(
    "body, word",
    [
        ({**LLAMA8B_8xH100, "model": "no-such-model"}, "unknown model"),
        ({**LLAMA8B_8xH100, "training": {"micro_batch_size": 0, "seq_len": 8192}}, "micro_batch_size"),
        ({**LLAMA8B_8xH100, "training": {"micro_batch_size": -1, "seq_len": 8192}}, "micro_batch_size"),
        (
            {
                **LLAMA8B_8xH100,
                "model": {
                    "architecture": "llama",
                    "num_layers": 4,
                    "hidden_size": 65,
                    "num_attention_heads": 4,
                    "intermediate_size": 128,
                    "vocab_size": 100,
                },
            },
            "hidden_size",
        ),
        (
            {
                **LLAMA8B_8xH100,
                "model": {
                    "architecture": "llama",
                    "num_layers": 4,
                    "hidden_size": 64,
                    "num_attention_heads": 4,
                    "intermediate_size": 128,
                    "vocab_size": 100,
                    "total_params": 10**15,
                },
            },
            "total_params",
        ),
        ({**LLAMA8B_8xH100, "cluster": {"gpu": "H100-80GB", "gpu_count": 8, "gpu_memory_gib": 80}}, "exactly one"),
        ({**LLAMA8B_8xH100, "cluster": {"gpu": "TPU-v9"}}, "cluster.gpu: must be one of"),
        ({**LLAMA8B_8xH100, "headroom_fraction": 2}, "headroom_fraction"),
    ],
)
def test_bad_recommend_inputs_are_problems(server, body, word):
    base, _ = server
    r = httpx.post(base + "/recommend", json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert word in r.text


def test_transport_level_bad_requests(server):
    base, _ = server
    r = httpx.post(
        base + "/recommend", content=b"{oops", headers={"content-type": "application/json"}, timeout=HTTP_TIMEOUT_S
    )
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    assert "invalid JSON" in r.json()["detail"]
    r = httpx.post(
        base + "/recommend",
        content=b"x" * 300_000,
        headers={"content-type": "application/json"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert r.status_code == 413
    r = httpx.post(
        base + "/recommend", content=b"model=x", headers={"content-type": "text/plain"}, timeout=HTTP_TIMEOUT_S
    )
    assert r.status_code == 415 and "application/json" in r.json()["detail"]

    def chunks():  # no Content-Length: the limit is enforced on the bytes that arrive
        for _ in range(50):
            yield b" " * 10_000

    r = httpx.post(
        base + "/recommend", content=chunks(), headers={"content-type": "application/json"}, timeout=HTTP_TIMEOUT_S
    )
    assert r.status_code == 413 and r.headers["content-type"].startswith("application/problem+json")
    assert httpx.get(base + "/v2/health/live", timeout=HTTP_TIMEOUT_S).status_code == 200  # still up


def test_predict_batch_and_k_range(server):
    base, _ = server
    items = [{"model": "gpt2", "training": {"micro_batch_size": 4, "seq_len": 1024}, "k": k} for k in (0, 6, 12)]
    r = httpx.post(base + "/predict", json={"items": items}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert [p["k"] for p in preds] == [0, 6, 12]
    assert all(p["upper_bound_bytes"] >= p["predicted_peak_bytes"] > 0 for p in preds)
    r = httpx.post(base + "/predict", json={"items": [{**items[0], "k": 13}]}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 422 and "[0, num_layers=12]" in r.json()["detail"]


def test_telemetry_roundtrip_and_token(server):
    base, _ = server
    rec = record(record_id="e2e-00000001").model_dump(mode="json")
    assert httpx.post(base + "/telemetry", json=[rec], timeout=HTTP_TIMEOUT_S).status_code == 401
    r = httpx.post(base + "/telemetry", json=[rec], headers={"Authorization": "Bearer tok"}, timeout=HTTP_TIMEOUT_S)
    assert r.json()["stored"] == ["e2e-00000001"]
    r = httpx.post(base + "/telemetry", json=[rec], headers={"Authorization": "Bearer tok"}, timeout=HTTP_TIMEOUT_S)
    assert r.json()["duplicates"] == ["e2e-00000001"]


def test_models_hot_swap_and_refusal(server):
    base, reg = server
    first = reg.current()
    assert httpx.get(base + "/models", timeout=HTTP_TIMEOUT_S).json()["serving"] == first
    # a new version is picked up without a restart
    new_dir = reg.root / f"{int(first) + 1:04d}"
    shutil.copytree(reg.root / first, new_dir)
    reg.promote(new_dir.name)
    assert httpx.get(base + "/v2/health/ready", timeout=HTTP_TIMEOUT_S).json()["model_version"] == new_dir.name
    # a corrupt one is refused and the last good keeps serving
    bad = reg.root / f"{int(first) + 2:04d}"
    shutil.copytree(reg.root / first, bad)
    with pytest.raises(IncompatibleArtifact):  # promotion itself refuses a damaged version ...
        (bad / "model.txt").write_text("not a lightgbm model")
        reg.promote(bad.name)
    shutil.copy(reg.root / first / "model.txt", bad / "model.txt")
    reg.promote(bad.name)
    (bad / "model.txt").write_text("not a lightgbm model")  # ... and damage after promotion is refused at load
    httpx.post(base + "/models/reload", headers={"Authorization": "Bearer tok"}, timeout=HTTP_TIMEOUT_S)
    j = httpx.get(base + "/models", timeout=HTTP_TIMEOUT_S).json()
    assert j["serving"] == new_dir.name and "refused" in j["last_error"]
    assert (
        httpx.post(base + "/recommend", json=LLAMA8B_8xH100, timeout=HTTP_TIMEOUT_S).json()["model_version"]
        == new_dir.name
    )
    reg.promote(first)  # rollback = moving the alias
    back = httpx.post(base + "/models/reload", headers={"Authorization": "Bearer tok"}, timeout=HTTP_TIMEOUT_S).json()
    assert back == {"serving": first, "previous": new_dir.name, "reloaded": True, "swapped": True, "last_error": None}
    # reloading the version already served reads it again but swaps nothing
    again = httpx.post(base + "/models/reload", headers={"Authorization": "Bearer tok"}, timeout=HTTP_TIMEOUT_S).json()
    assert again == {"serving": first, "previous": first, "reloaded": True, "swapped": False, "last_error": None}


def test_metrics_exposes_k_histogram(server):
    base, _ = server
    httpx.post(base + "/recommend", json=LLAMA8B_8xH100, timeout=HTTP_TIMEOUT_S)
    text = httpx.get(base + "/metrics", timeout=HTTP_TIMEOUT_S).text
    assert "memfit_recommended_k_bucket" in text or "memfit_predicted_peak_gib_bucket" in text
    assert "http_request_duration_seconds" in text
