"""QLoRA on a mixture-of-experts model is refused with its reason (issue 28.3), in one place
(:func:`memfit.schema.check_quantized_base`) for the service, the command line and the tracer.

Mixtral-8x7B QLoRA (nf4) runs reported 43.2 GiB on one GPU; memfit answered 190.6 GiB because transformers 5 holds the
experts as 3-D parameters that its bitsandbytes loader leaves in 16 bits, while memfit's analytic count quantized
one expert MLP per layer. Neither answer was the run's.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from memfit.errors import InvalidConfiguration
from memfit.schema import TrainingConfig, check_quantized_base
from model.job import resolve_architecture
from service.app import create_app
from service.cli import EXIT_BAD_INPUT, main
from service.settings import Settings
from tests.moe_configs import TINY_MOE

QLORA = {"finetune": "lora", "lora_rank": 16, "quantization": "nf4"}


def test_the_rule_names_the_field_and_leaves_dense_models_and_moe_lora_alone():
    mixtral = resolve_architecture("mixtral-8x7b").spec
    qlora = TrainingConfig(micro_batch_size=1, seq_len=512, **QLORA)
    with pytest.raises(InvalidConfiguration) as err:
        check_quantized_base(mixtral, qlora)
    assert err.value.field == "training.quantization" and "3-D parameters" in str(err.value)
    check_quantized_base(resolve_architecture("llama-3-8b").spec, qlora)  # dense: modelled
    check_quantized_base(mixtral, TrainingConfig(micro_batch_size=1, seq_len=512, finetune="lora", lora_rank=16))


def test_service_answers_422_naming_training_quantization(tmp_path, small_registry):
    app = TestClient(
        create_app(Settings(db_url=f"sqlite:///{tmp_path / 's.db'}", registry_dir=str(small_registry.root)))
    )
    r = app.post(
        "/recommend",
        json={
            "model": "mixtral-8x7b",
            "cluster": {"gpu": "A100-80GB"},
            "training": {"micro_batch_size": 1, "seq_len": 2048, **QLORA},
        },
    )
    assert r.status_code == 422, r.text
    assert "training.quantization" in r.text and "mixture-of-experts" in r.text


def test_cli_exits_2_naming_the_flag(small_registry, capsys):
    code = main(
        [
            "recommend",
            "--model",
            "mixtral-8x7b",
            "--gpu",
            "A100-80GB",
            "--micro-batch",
            "1",
            "--seq-len",
            "2048",
            "--lora-rank",
            "16",
            "--quantization",
            "nf4",
            "--registry",
            str(small_registry.root),
        ]
    )
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err
    assert "--quantization" in err and "mixture-of-experts" in err


def test_the_tracer_refuses_it_too():
    from tracer.collect import measure

    training = TrainingConfig(micro_batch_size=1, seq_len=64, precision="bf16", **QLORA)
    with pytest.raises(InvalidConfiguration, match="training.quantization"):
        measure(TINY_MOE["mixtral"], training)


def test_alternatives_for_a_moe_model_offer_no_qlora(small_registry):
    from memfit.api import RecommendRequest
    from model.registry import Registry
    from service.recommender import Recommender

    loaded = Registry(small_registry.root).load()
    rec = Recommender(loaded.estimator, loaded.version).recommend(
        RecommendRequest.model_validate(
            {
                "model": "mixtral-8x7b",
                "cluster": {"gpu": "A100-80GB"},
                "training": {"micro_batch_size": 1, "seq_len": 2048},
            }
        )
    )
    assert not rec.fits and rec.alternatives
    assert not any(a.change.get("quantization", "none") != "none" for a in rec.alternatives)
