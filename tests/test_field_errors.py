"""Every 422 names the exact field: model-level checks inside pydantic validators, LoRA targets that the
model does not have, and the exact LoRA parameter count from the model's real matrices."""

import pytest
from fastapi.testclient import TestClient

from data import catalog
from memfit.errors import InvalidConfiguration
from memfit.hf import lora_trainable_params
from service.app import create_app
from service.settings import Settings


@pytest.fixture(scope="module")
def client(tmp_path_factory, small_registry):
    tmp = tmp_path_factory.mktemp("fields")
    app = create_app(Settings(db_url=f"sqlite:///{tmp / 's.db'}", registry_dir=str(small_registry.root)))
    with TestClient(app) as c:
        yield c


def _errors(client, training=None, cluster=None, model="llama-3-8b"):
    r = client.post(
        "/recommend",
        json={
            "model": model,
            "training": {"micro_batch_size": 1, "seq_len": 1024, **(training or {})},
            "cluster": cluster or {"gpu": "H100-80GB"},
        },
    )
    assert r.status_code == 422, r.text
    return r.json()["errors"]


@pytest.mark.parametrize(
    "training, cluster, field, words",
    [
        ({"sharding": "zero3"}, {"gpu": "H100-80GB", "gpu_count": 1}, "training.sharding", "data_parallel_size is 1"),
        ({}, {"gpu": "H900"}, "cluster.gpu", "H100-80GB, H100-94GB, H200, L4"),
        ({}, {"gpu": "H100-80GB", "gpu_memory_gib": 80}, "cluster.gpu", "exactly one of"),
        (
            {"finetune": "lora", "lora_target_modules": ["q_proj", "qproj"]},
            None,
            "training.lora_target_modules",
            "'gate_proj'",
        ),
        (
            {"finetune": "frozen", "frozen_layers": 4, "trainable_params": 10**12},
            None,
            "training.trainable_params",
            "total_params=8030261248",
        ),
        # frozen layers without frozen fine-tuning were ignored silently (a full fine-tune was answered)
        ({"frozen_layers": 4}, None, "training.frozen_layers", "0 unless finetune='frozen'"),
    ],
)
def test_model_level_checks_name_their_field(client, training, cluster, field, words):
    (err,) = _errors(client, training, cluster)
    assert err["field"] == field and words in err["message"] and "Value error" not in err["message"]
    assert err["message"].startswith(field + ":")


def test_shape_checks_name_the_model_field(client):
    bad = {
        "model_type": "llama",
        "hidden_size": 768,
        "num_hidden_layers": 2,
        "num_attention_heads": 5,
        "vocab_size": 1000,
    }
    (err,) = _errors(client, model=bad)
    assert err["field"] == "model.num_attention_heads" and "divisor of hidden_size=768" in err["message"]


def test_lora_counts_the_models_real_matrices():
    gpt2, llama = catalog.get("gpt2")["hf_config"], catalog.get("llama-3-8b")["hf_config"]
    # GPT-2: PEFT's default target is the fused c_attn Conv1D, 768 -> 3 * 768, in each of 12 layers
    assert lora_trainable_params(catalog.spec("gpt2"), 8, None, gpt2) == 8 * (768 + 3 * 768) * 12
    # Llama-3-8B q_proj 4096 -> 4096 and v_proj 4096 -> 1024 (8 KV heads of 128), 32 layers
    assert (
        lora_trainable_params(catalog.spec("llama-3-8b"), 16, ["q_proj", "v_proj"], llama)
        == 16 * ((4096 + 4096) + (4096 + 1024)) * 32
    )
    with pytest.raises(InvalidConfiguration) as info:
        lora_trainable_params(catalog.spec("gpt2"), 8, ["q_proj"], gpt2)
    assert info.value.field == "training.lora_target_modules" and "c_attn" in info.value.allowed


@pytest.mark.parametrize("model, limit", [("gpt2", 1024), ("opt-125m", 2048), ("gpt-neo-125m", 2048)])
def test_a_sequence_beyond_a_learned_position_table_is_refused(client, model, limit):
    # GPT-2, OPT and GPT-Neo look positions up in a learned table: a longer sequence raises IndexError in the real
    # step, so memfit must not answer for it (it used to, from the learned paths)
    (err,) = _errors(client, {"seq_len": limit + 1}, model=model)
    assert err["field"] == "training.seq_len" and f"[1, {limit}]" in err["message"]
    assert err["message"].startswith("training.seq_len:")
    at_limit = {"model": model, "training": {"micro_batch_size": 1, "seq_len": limit}, "cluster": {"gpu": "H100-80GB"}}
    ok = client.post("/recommend", json=at_limit)
    assert ok.status_code == 200, ok.text


def test_rotary_models_have_no_position_table_limit():
    from memfit.hf import max_seq_len

    assert max_seq_len(catalog.get("llama-3-8b")["hf_config"]) is None
    assert max_seq_len(catalog.get("gpt2")["hf_config"]) == 1024


def test_predict_without_a_cluster_says_the_cluster_is_missing(client):
    """A /predict item without a cluster has one GPU: a ZeRO-3 item is refused for that cause, which the message
    names (it blamed training.sharding alone)."""
    item = {"model": "gpt2", "training": {"micro_batch_size": 1, "seq_len": 512, "sharding": "zero3"}, "k": 0}
    r = client.post("/predict", json={"items": [item]})
    assert r.status_code == 422, r.text
    (err,) = r.json()["errors"]
    assert err["field"] == "items.0.training.sharding" and "this item gives no cluster, so one GPU" in err["message"]
    ok = client.post("/predict", json={"items": [{**item, "cluster": {"gpu": "H100-80GB", "gpu_count": 8}}]})
    assert ok.status_code == 200, ok.text
