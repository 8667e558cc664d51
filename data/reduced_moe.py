"""Reduced-width MoE architectures: the public configs' layouts at a small width, for telemetry collected in
seconds under fake tensors (``python -m training.moe_telemetry``) and for the configs of those rows."""

from __future__ import annotations

from typing import Any

_BASE = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "num_hidden_layers": 6,
}

#: reduced-width MoE architectures: the public configs' layouts (expert counts, top-k, shared experts) at
#: hidden 512 and 6 layers; sources: config.json of mistralai/Mixtral-8x7B-v0.1, allenai/OLMoE-1B-7B-0924,
#: Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen3-30B-A3B, deepseek-ai/DeepSeek-V3 on the HF hub
REDUCED_MOE: dict[str, dict[str, Any]] = {
    "mixtral-reduced": {
        **_BASE,
        "model_type": "mixtral",
        "intermediate_size": 1792,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "olmoe-reduced": {
        **_BASE,
        "model_type": "olmoe",
        "intermediate_size": 256,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_key_value_heads": 8,
    },
    "qwen1.5-moe-reduced": {
        **_BASE,
        "model_type": "qwen2_moe",
        "intermediate_size": 1408,
        "moe_intermediate_size": 176,
        "shared_expert_intermediate_size": 704,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3-moe-reduced": {
        **_BASE,
        "model_type": "qwen3_moe",
        "intermediate_size": 1536,
        "moe_intermediate_size": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "head_dim": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "deepseek-v3-reduced": {
        **_BASE,
        "model_type": "deepseek_v3",
        "intermediate_size": 1536,
        "moe_intermediate_size": 128,
        "n_routed_experts": 32,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 0,
        "kv_lora_rank": 128,
        "q_lora_rank": 192,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 32,
        "v_head_dim": 64,
        "num_key_value_heads": 8,
    },
}
