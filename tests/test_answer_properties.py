"""Property (issue 28): over random valid requests with tensor, pipeline, context and expert parallelism, QLoRA,
offload and answers that plan alternatives, ``POST /recommend`` never answers 5xx and no byte count anywhere in an
answer is negative.

Kept cheap: catalog models only, the service's background tracer replaced by one that traces nothing (untraced
configurations are answered on the provisional path, as a first request is), a few derandomized examples.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODELS = ["smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "gpt2", "olmoe-1b-7b", "mixtral-8x7b", "llama-3-8b"]
MOE = {"olmoe-1b-7b", "mixtral-8x7b"}
GPUS = ["L4", "RTX-4090", "A100-40GB", "H100-80GB"]


def negative_byte_counts(value, path=""):
    """(path, value) of every number below 0 under a key ending in ``_bytes`` in an answer's JSON."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k.endswith("_bytes") and isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                yield f"{path}.{k}", v
            yield from negative_byte_counts(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from negative_byte_counts(v, f"{path}[{i}]")


@st.composite
def requests(draw):
    model = draw(st.sampled_from(MODELS))
    tp, pp, cp, dp = (draw(st.sampled_from(s)) for s in ([1, 2, 4], [1, 2], [1, 2, 4], [1, 2, 4]))
    training = {
        "micro_batch_size": draw(st.integers(1, 4)),
        "seq_len": draw(st.sampled_from([512, 1024, 4096])),
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "context_parallel_size": cp,
        "precision": draw(st.sampled_from(["amp_bf16", "bf16", "bf16_fp32_master"])),
    }
    if dp * cp >= 2:
        training["sharding"] = draw(st.sampled_from(["none", "zero1", "zero2", "zero3", "fsdp_full_shard"]))
    tune = draw(st.sampled_from(["full", "lora", "qlora"]))
    if tune != "full":
        training.update(finetune="lora", lora_rank=draw(st.sampled_from([8, 16])))
    if tune == "qlora":
        training["quantization"] = draw(st.sampled_from(["nf4", "nf4_double_quant", "int8"]))
    if model in MOE and dp > 1:
        training["expert_parallel_size"] = draw(st.sampled_from([1, dp]))
    if draw(st.booleans()):
        training["offload_optimizer"] = "cpu"
        if training.get("sharding") in ("zero3", "fsdp_full_shard") and draw(st.booleans()):
            training["offload_parameters"] = "cpu"
    return {
        "model": model,
        "training": training,
        "cluster": {"gpu": draw(st.sampled_from(GPUS)), "gpu_count": dp * tp * pp * cp},
    }


@pytest.fixture(scope="module")
def service(tmp_path_factory, small_registry):
    from service.app import create_app
    from service.settings import Settings
    from service.tracing import BackgroundTracer

    patch = pytest.MonkeyPatch()
    patch.setattr(BackgroundTracer, "__call__", lambda self, key, hf_config, training: "not traced in this test")
    db = tmp_path_factory.mktemp("properties") / "p.db"
    with TestClient(
        create_app(Settings(db_url=f"sqlite:///{db}", registry_dir=str(small_registry.root), warm_up=False))
    ) as client:
        yield client
    patch.undo()


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=requests())
def _answer_one(service, seen: dict[str, int], body):
    r = service.post("/recommend", json=body)
    assert r.status_code < 500, (body, r.text)
    assert r.status_code in (200, 422), (body, r.status_code, r.text)
    if r.status_code == 200:
        answer = r.json()
        assert not list(negative_byte_counts(answer)), (body, list(negative_byte_counts(answer)))
        seen["alternatives"] = seen.get("alternatives", 0) + bool(answer["alternatives"])
    seen[str(r.status_code)] = seen.get(str(r.status_code), 0) + 1


def test_no_5xx_and_no_negative_byte_count(service):
    # the examples and the check that they were answered in one test: pytest-xdist may run two tests of a file in
    # different workers, where a second test's view of the first's examples was empty (it skipped)
    seen: dict[str, int] = {}
    _answer_one(service, seen)
    # the random requests were not all refused, and some planned alternatives
    assert seen.get("200", 0) >= 10 and seen.get("alternatives", 0) >= 3, seen
