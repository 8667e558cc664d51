"""Key-mapping audit: ``describe()`` reads every catalog family's HF config the way transformers builds it.

For every catalog entry (``data/architectures/*.json``) the model is built on the ``meta`` device from
the *full* config dict (``config.to_json_string(use_diff=False)``: every default written out, as
``model.config`` holds it at run time). ``describe()`` on that model must give the catalog entry's
spec, and the spec must agree with the built modules themselves (key/value heads from the K/V
projection widths, FFN width from the down projection). Variants cover keys whose precedence the
catalog alone does not exercise (Falcon-40B's ``new_decoder_architecture`` over ``multi_query``).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM

from data import catalog
from data.catalog import ARCH_DIR
from memfit.describe import describe
from memfit.hf import decoder_layers, quiet_transformers, spec_fields_from_hf_config

ENTRIES = {e["name"]: e for e in (json.loads(p.read_text()) for p in sorted(ARCH_DIR.glob("*.json")))}
ARCH_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_token",
)
#: names of the FFN down projection (input width = FFN width) across the catalog's families
DOWN_PROJ = ("down_proj", "dense_4h_to_h", "fc2", "fc_out", "c_proj")
#: fused Q/K/V projections: output width = (heads + 2 * kv_heads) * head_dim
FUSED_QKV = ("query_key_value", "c_attn", "qkv_proj")


def full_config(cfg: dict) -> dict:
    """The config dict with every transformers default written out."""
    with quiet_transformers():
        config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    return json.loads(config.to_json_string(use_diff=False))


def meta_model(cfg: dict):
    with quiet_transformers():
        config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)


def described_fields(model) -> dict:
    req = describe(model, seq_len=128, micro_batch_size=1, gpu="H100-80GB")
    assert isinstance(req.model, dict), "a HF model is described by its config dict"
    return spec_fields_from_hf_config(req.model)


def module_truth(model, fields: dict) -> dict:
    """Key/value heads and FFN width as the built first decoder layer has them."""
    layer = decoder_layers(model)[0]
    heads = fields["num_attention_heads"]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // heads
    out: dict = {}
    for name, mod in layer.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        w = getattr(mod, "weight", None)
        if w is None or w.dim() != 2:
            continue
        conv1d = type(mod).__name__ == "Conv1D"  # GPT-2: weight is (in, out)
        in_f, out_f = (w.shape[0], w.shape[1]) if conv1d else (w.shape[1], w.shape[0])
        if leaf == "k_proj":
            out["num_key_value_heads"] = out_f // head_dim
        elif leaf in FUSED_QKV:
            out["num_key_value_heads"] = (out_f // head_dim - heads) // 2
        elif leaf in DOWN_PROJ and "attn" not in name and in_f != fields["hidden_size"]:
            out["intermediate_size"] = in_f
    return out


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_describe_of_full_config_model_equals_catalog_spec(name):
    entry = ENTRIES[name]
    full = full_config(entry["hf_config"])
    model = meta_model(full)
    got = described_fields(model)
    want = catalog.spec(name).model_dump(include=set(ARCH_FIELDS), exclude_none=True)
    assert got == want, {k: (got.get(k), want.get(k)) for k in ARCH_FIELDS if got.get(k) != want.get(k)}
    assert spec_fields_from_hf_config(full) == want  # the service reading the full dict agrees too
    truth = module_truth(model, got)
    assert truth.get("num_key_value_heads", got["num_key_value_heads"]) == got["num_key_value_heads"]
    if got.get("num_experts") is None:  # MoE experts are fused tensors, not a down-projection Linear
        assert truth["intermediate_size"] == got["intermediate_size"], name


TINY = {"hidden_size": 64, "num_attention_heads": 8, "vocab_size": 128, "num_hidden_layers": 2}
VARIANTS = {
    # Falcon-40B/180B: new_decoder_architecture with 8 KV heads; multi_query (default True) must not win.
    "falcon-40b-style": (
        {**TINY, "model_type": "falcon", "new_decoder_architecture": True, "num_kv_heads": 2},
        {"num_key_value_heads": 2, "intermediate_size": 256},
    ),
    "falcon-40b-style-explicit-multi-query": (
        {**TINY, "model_type": "falcon", "new_decoder_architecture": True, "num_kv_heads": 2, "multi_query": True},
        {"num_key_value_heads": 2},
    ),
    "falcon-7b-style": ({**TINY, "model_type": "falcon", "multi_query": True}, {"num_key_value_heads": 1}),
    "falcon-7b-style-default": ({**TINY, "model_type": "falcon"}, {"num_key_value_heads": 1}),
    "falcon-rw-style": ({**TINY, "model_type": "falcon", "multi_query": False}, {"num_key_value_heads": 8}),
    "gpt_bigcode-mqa": (
        {"model_type": "gpt_bigcode", "n_embd": 64, "n_head": 8, "n_layer": 2, "vocab_size": 128},
        {"num_key_value_heads": 1, "intermediate_size": 256},
    ),
    "gpt2-n_inner": (
        {"model_type": "gpt2", "n_embd": 64, "n_head": 8, "n_layer": 2, "vocab_size": 128, "n_inner": 96},
        {"num_key_value_heads": 8, "intermediate_size": 96},
    ),
    "opt-ffn_dim": ({**TINY, "model_type": "opt", "ffn_dim": 200}, {"intermediate_size": 200}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_precedence_variants_match_the_built_modules(variant):
    cfg, expected = VARIANTS[variant]
    for source in (cfg, full_config(cfg)):
        model = meta_model(source)
        got = described_fields(model)
        assert {k: got[k] for k in expected} == expected, (variant, source is cfg)
        truth = module_truth(model, got)
        assert {k: truth[k] for k in expected if k in truth} == {k: expected[k] for k in truth if k in expected}
        assert got["num_key_value_heads"] == truth["num_key_value_heads"]
