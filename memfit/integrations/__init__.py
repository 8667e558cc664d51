"""Framework integrations, each imported on demand so memfit itself stays light.

* :mod:`memfit.integrations.hf` — ``MemfitTrainerCallback`` for the HF ``Trainer`` (needs transformers).
* :mod:`memfit.integrations.deepspeed` — patch ``deepspeed.checkpointing.checkpoint`` to recompute only
  the chosen layers; the matching ``activation_checkpointing`` block; a config check.
* :mod:`memfit.integrations.megatron` — Megatron-LM recompute flags for a recommendation.
"""
