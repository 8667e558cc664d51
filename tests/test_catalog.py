"""Catalog of public architectures (``data/architectures/*.json``).

Every entry is built from its ``hf_config`` with transformers on the ``meta`` device and its
parameter count must match the independently published count within 1%.
"""

from __future__ import annotations

import json

import pytest

from data import catalog
from data.catalog import ARCH_DIR

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit.hf import count_params_from_config, quiet_transformers

ENTRIES = {e["name"]: e for e in (json.loads(p.read_text()) for p in sorted(ARCH_DIR.glob("*.json")))}
REL_TOL = 0.01


def built_params(cfg: dict) -> int:
    """Parameters of the model built from ``cfg`` on the meta device (tied weights once)."""
    with quiet_transformers():
        return count_params_from_config(cfg)


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_built_params_match_published(name):
    entry = ENTRIES[name]
    built = built_params(entry["hf_config"])
    published = entry["published_params"]
    rel = abs(built - published) / published
    assert rel < REL_TOL, f"{name}: built {built:,} vs published {published:,} ({rel:.2%})"


@pytest.mark.parametrize("model_type", sorted({e["hf_config"]["model_type"] for e in ENTRIES.values()}))
def test_count_params_from_config_builds_family(model_type):
    """One catalog model of every family builds (SDPA-less families fall back to eager attention)."""
    cfg = min(
        (e for e in ENTRIES.values() if e["hf_config"]["model_type"] == model_type),
        key=lambda e: e["published_params"],
    )["hf_config"]
    with quiet_transformers():
        assert count_params_from_config(cfg) > 0


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_spec_for_every_entry(name):
    spec = catalog.spec(name)
    assert spec.model_name == name
    assert spec.total_params == ENTRIES[name]["published_params"]


def test_get_is_case_insensitive_and_resolves_aliases():
    assert catalog.get("LLAMA-3-8B")["name"] == "llama-3-8b"
    assert catalog.get("  Llama_3_8B ")["name"] == "llama-3-8b"
    assert catalog.get("meta-llama/Meta-Llama-3-8B")["name"] == "llama-3-8b"
    assert catalog.get("meta-llama/meta-llama-3-8b")["name"] == "llama-3-8b"
    assert catalog.get("Qwen/Qwen2.5-7B-Instruct")["name"] == "qwen2.5-7b"
    assert catalog.get("openai-community/gpt2")["name"] == "gpt2"
    assert catalog.get("TIIUAE/FALCON-7B")["name"] == "falcon-7b"
    for name, entry in ENTRIES.items():
        assert catalog.get(name) is catalog.get(name.upper())
        for alias in entry["aliases"]:
            assert catalog.get(alias)["name"] == name


def test_unknown_name_raises_with_close_matches():
    with pytest.raises(KeyError) as info:
        catalog.get("llama-3-9b")
    msg = str(info.value)
    assert "close matches" in msg
    assert "llama-3-8b" in msg


def test_unknown_name_without_close_match():
    with pytest.raises(KeyError, match="none"):
        catalog.get("zzzz-no-such-model-qqqq")


@pytest.mark.parametrize(
    "name, layers, hidden, kv_heads, head_dim, tied",
    [
        ("llama-3-8b", 32, 4096, 8, None, False),
        ("llama-2-70b", 80, 8192, 8, None, False),
        ("gpt2-xl", 48, 1600, 25, None, True),
        ("gemma-7b", 28, 3072, 16, 256, True),
        ("falcon-7b", 32, 4544, 1, None, True),
        ("opt-13b", 40, 5120, 40, None, True),
    ],
)
def test_spec_fields(name, layers, hidden, kv_heads, head_dim, tied):
    spec = catalog.spec(name)
    entry = catalog.get(name)
    assert spec.model_name == name
    assert spec.architecture == entry["hf_config"]["model_type"]
    assert spec.num_layers == layers
    assert spec.hidden_size == hidden
    assert spec.num_key_value_heads == kv_heads
    assert spec.head_dim == head_dim
    assert spec.tie_word_embeddings is tied
    assert spec.total_params == spec.trainable_params == entry["published_params"]


def test_spec_moe_fields():
    spec = catalog.spec("mixtral-8x7b")
    assert (spec.num_experts, spec.num_experts_per_token) == (8, 2)
    assert spec.num_layers == 32


def test_gemma_legacy_gelu_builds_the_tanh_approximation_and_leaves_the_dict_alone():
    """The official Gemma configs say ``hidden_act="gelu"``, which transformers builds as the tanh approximation
    (and warns about on every build); memfit builds the same activation without the warning and keeps the
    catalog's dict, whose hash keys the traced terms, unchanged."""
    from memfit.hf import _hf_config

    cfg = catalog.get("gemma-2b")["hf_config"]
    assert cfg["hidden_act"] == "gelu"
    assert _hf_config(cfg).hidden_act == "gelu_pytorch_tanh"
    assert cfg["hidden_act"] == "gelu"


def test_sdpa_support_snapshot_is_the_installed_transformers_and_the_families_build_as_it_says():
    """memfit reads which families have no SDPA (BLOOM, Gemma-2, GPT-Neo run eager whatever is asked) from a snapshot
    of transformers' classes: it must be the installed transformers' (after a pin change, run
    `python scripts/sdpa_support.py`), and a meta build of every catalog family must run the attention it names."""
    import json

    import torch
    import transformers

    from memfit.hf import SDPA_SUPPORT_PATH, attention_that_runs, build_causal_lm
    from memfit.schema import Attention

    snapshot = json.loads(SDPA_SUPPORT_PATH.read_text())
    assert snapshot["transformers_version"] == transformers.__version__
    assert {"bloom", "gemma2", "gpt_neo"} <= set(snapshot["without_sdpa"])
    for mt in sorted({catalog.get(n)["hf_config"]["model_type"] for n in catalog.names()} - {"gpt_neo"}):
        cfg = next(
            catalog.get(n)["hf_config"] for n in catalog.names() if catalog.get(n)["hf_config"]["model_type"] == mt
        )
        with torch.device("meta"):
            built = build_causal_lm({**cfg, "num_hidden_layers": 2}, attention="sdpa")
        assert built.config._attn_implementation == attention_that_runs(mt, Attention.SDPA).value, mt
    assert attention_that_runs("gpt_neo", Attention.FLASH) is Attention.EAGER
    assert attention_that_runs("llama", Attention.FLASH) is Attention.FLASH
    assert attention_that_runs("no-such-family", Attention.SDPA) is Attention.SDPA


def test_peft_lora_target_snapshot_is_peft_mapping():
    # memfit reads PEFT's default LoRA targets from a snapshot (importing peft costs most of a CLI answer); it must
    # be the installed PEFT's dict: after a PEFT pin change, run `python scripts/peft_lora_targets.py`
    import json

    peft = pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    from memfit.hf import PEFT_LORA_TARGETS_PATH, peft_default_lora_targets

    snapshot = json.loads(PEFT_LORA_TARGETS_PATH.read_text())
    assert snapshot["peft_version"] == peft.__version__
    assert snapshot["lora_target_modules"] == {k: list(v) for k, v in mapping.items()}
    assert peft_default_lora_targets("llama") == ["q_proj", "v_proj"]
    assert peft_default_lora_targets("gpt2") == ["c_attn"]
    assert peft_default_lora_targets("no-such-model-type") is None


def test_catalog_layers_snapshot_matches_the_catalog():
    # the client's fallback plan reads layer counts from memfit/catalog_layers.json (the wheel ships no data/); it
    # must be the catalog's: after changing data/architectures, run `python scripts/catalog_layers.py`
    from memfit.hf import CATALOG_LAYERS_PATH, catalog_num_layers
    from scripts.catalog_layers import snapshot

    assert json.loads(CATALOG_LAYERS_PATH.read_text()) == snapshot()
    assert len(snapshot()["num_layers"]) == len(catalog.load_catalog()) == 196
    assert catalog_num_layers("llama-3-8b") == 32 and catalog_num_layers("Meta-Llama/Meta-Llama-3-8B") == 32
    assert catalog_num_layers("gpt2") == 12 and catalog_num_layers("my-private-model") is None


def test_lora_target_shapes_snapshot_matches_meta_builds():
    # memfit reads the LoRA matrices' shapes of catalog architectures from a snapshot (the meta build imports
    # transformers' model code: ~4 s of a 16 s CLI answer); it must be this transformers' build: after a transformers
    # or PEFT pin change or a catalog edit, run `PYTHONPATH=. python scripts/lora_target_shapes.py`
    import json
    from importlib.metadata import version

    from data import catalog
    from memfit.hf import (
        LORA_SHAPES_PATH,
        _built_lora_target_shapes,
        lora_shapes_key,
        lora_target_shapes,
        peft_default_lora_targets,
    )

    snapshot = json.loads(LORA_SHAPES_PATH.read_text())
    assert snapshot["transformers_version"] == version("transformers")
    entries = snapshot["entries"]
    with_default = [
        n
        for n in catalog.names()
        if peft_default_lora_targets(catalog.get(n)["hf_config"].get("model_type")) is not None
    ]
    assert sorted(e["model"] for e in entries.values()) == sorted(with_default)
    for name in ("gpt2", "pythia-70m", "llama-3.2-1b"):
        cfg = catalog.get(name)["hf_config"]
        targets = peft_default_lora_targets(cfg["model_type"])
        assert lora_shapes_key(cfg, targets) in entries
        assert lora_target_shapes(cfg, None) == _built_lora_target_shapes(cfg, targets)
    shapes, names = lora_target_shapes(catalog.get("llama-3-8b")["hf_config"], None)
    assert shapes == {"q_proj": [(4096, 4096)] * 32, "v_proj": [(4096, 1024)] * 32}  # 8 KV heads of 128
    assert names == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
