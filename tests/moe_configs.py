"""Tiny MoE configs of the transformers 5 families memfit traces (shared by the MoE tests).

Widths are multiples of 128 so most tensors are whole 512-byte blocks; two or four layers.
"""

from __future__ import annotations

BASE = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

TINY_MOE = {
    "mixtral": {
        **BASE,
        "model_type": "mixtral",
        "intermediate_size": 256,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
    },
    # shared expert with a sigmoid gate beside the routed experts
    "qwen2_moe": {
        **BASE,
        "model_type": "qwen2_moe",
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3_moe": {
        **BASE,
        "model_type": "qwen3_moe",
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "olmoe": {
        **BASE,
        "model_type": "olmoe",
        "intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
    },
    # DeepSeek-style: MLA attention, grouped top-k routing, routed + shared experts, every layer MoE
    "deepseek_v3": {
        **BASE,
        "model_type": "deepseek_v3",
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "kv_lora_rank": 64,
        "q_lora_rank": 96,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
    },
}
