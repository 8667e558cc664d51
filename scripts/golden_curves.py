"""Record every curve of a broad request matrix, or check that it is unchanged (a refactoring guard).

``python -m scripts.golden_curves record OUT.json`` writes, per request, the whole
:meth:`model.curve.MemoryPredictor.curve` answer (path, margin group, floor, host bytes, terms key, reason,
notes, and per k the point, bound, peak phase and breakdown, in bytes); ``check OUT.json`` recomputes them
and lists every request whose answer differs (exit 1), or says that all are identical.

The matrix: catalog models × training variants through the service's own resolution
(:meth:`service.recommender.Recommender.curve`: offload of optimizer and parameters, ZeRO-1/2/3, frozen
layers, gradient accumulation, TP, PP, CP, LoRA, QLoRA and their combinations), and shipped traced-terms
entries (``data/terms``) with the same derivations applied, so that the traced bases are exercised. Invalid
combinations are recorded with their error. The predictor is the shipped model version's, with no tracer.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

MODELS = (
    "gpt2",
    "opt-125m",
    "pythia-70m",
    "pythia-410m",
    "bloom-560m",
    "gpt-neo-125m",
    "qwen2.5-0.5b",
    "qwen3-0.6b",
    "llama-3.2-1b",
    "tinyllama-1.1b",
    "gemma-2b",
    "gemma-2-2b",
    "gemma-3-1b",
    "olmo-2-1b",
    "smollm2-135m",
    "phi-3-mini-4k",
    "mistral-7b-v0.1",
    "llama-3-8b",
    "falcon-7b",
    "mixtral-8x7b",
    "olmoe-1b-7b",
    "qwen2.5-72b",
)

BASE = {"micro_batch_size": 2, "seq_len": 1024, "precision": "amp_bf16"}
MASTER = {"precision": "bf16_fp32_master"}
#: (name, training fields over BASE, gpu_count)
VARIANTS: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("base", {}, 1),
    ("bf16", {"precision": "bf16"}, 1),
    ("sgd", {"optimizer": "sgd_momentum"}, 1),
    ("adafactor_bf16", {"optimizer": "adafactor", "precision": "bf16"}, 1),
    ("fused_fp32", {"optimizer": "adamw_fused", "precision": "fp32"}, 1),
    ("adamw8bit", {"optimizer": "adamw_8bit"}, 1),
    ("paged8bit", {"optimizer": "paged_adamw_8bit"}, 1),
    ("off_opt", {**MASTER, "offload_optimizer": "cpu"}, 1),
    ("off_opt_ga", {**MASTER, "offload_optimizer": "cpu", "gradient_accumulation_steps": 4}, 1),
    ("off_opt_zero2", {**MASTER, "offload_optimizer": "cpu", "sharding": "zero2"}, 8),
    ("off_opt_zero1", {"offload_optimizer": "cpu", "sharding": "zero1"}, 4),
    ("off_param", {"offload_optimizer": "cpu", "offload_parameters": "cpu"}, 1),
    ("off_param_zero3", {**MASTER, "offload_optimizer": "cpu", "offload_parameters": "cpu", "sharding": "zero3"}, 8),
    ("off_opt_lora", {"offload_optimizer": "cpu", "finetune": "lora"}, 1),
    ("zero1", {"sharding": "zero1"}, 4),
    ("zero1_sgd", {"sharding": "zero1", "optimizer": "sgd_momentum"}, 4),
    ("zero1_adafactor", {"sharding": "zero1", "optimizer": "adafactor"}, 8),
    ("zero1_bf16", {"sharding": "zero1", "precision": "bf16"}, 2),
    ("zero1_master", {"sharding": "zero1", **MASTER}, 8),
    ("zero1_ga", {"sharding": "zero1", "gradient_accumulation_steps": 2}, 4),
    ("zero1_lora", {"sharding": "zero1", "finetune": "lora"}, 4),
    ("zero1_tp", {"sharding": "zero1", "tensor_parallel_size": 2}, 4),
    ("frozen", {"finetune": "frozen", "frozen_layers": 2}, 1),
    ("frozen_sgd", {"finetune": "frozen", "frozen_layers": 2, "optimizer": "sgd_momentum"}, 1),
    (
        "frozen_bf16_adafactor",
        {"finetune": "frozen", "frozen_layers": 2, "optimizer": "adafactor", "precision": "bf16"},
        1,
    ),
    ("frozen_fsdp", {"finetune": "frozen", "frozen_layers": 2, "sharding": "fsdp_full_shard"}, 8),
    ("frozen_zero2", {"finetune": "frozen", "frozen_layers": 2, "sharding": "zero2", **MASTER}, 8),
    ("frozen_ga", {"finetune": "frozen", "frozen_layers": 2, "gradient_accumulation_steps": 3}, 1),
    ("frozen_off", {"finetune": "frozen", "frozen_layers": 2, "offload_optimizer": "cpu"}, 1),
    ("frozen_zero1", {"finetune": "frozen", "frozen_layers": 2, "sharding": "zero1"}, 4),
    ("zero2_master", {"sharding": "zero2", **MASTER}, 8),
    ("zero2_amp", {"sharding": "zero2"}, 8),
    ("zero2_master_ga", {"sharding": "zero2", **MASTER, "gradient_accumulation_steps": 4}, 8),
    ("zero2_master_pp", {"sharding": "zero2", **MASTER, "pipeline_parallel_size": 2}, 8),
    ("zero3", {"sharding": "zero3"}, 8),
    ("fsdp_sgo", {"sharding": "fsdp_shard_grad_op"}, 8),
    ("ga4", {"gradient_accumulation_steps": 4}, 1),
    ("ga4_pp", {"gradient_accumulation_steps": 4, "pipeline_parallel_size": 2}, 2),
    ("tp2", {"tensor_parallel_size": 2}, 2),
    ("tp2_sp", {"tensor_parallel_size": 2, "sequence_parallel": True}, 2),
    ("pp2", {"pipeline_parallel_size": 2}, 2),
    ("cp2", {"context_parallel_size": 2}, 2),
    ("cp2_fsdp", {"context_parallel_size": 2, "sharding": "fsdp_full_shard"}, 4),
    ("lora", {"finetune": "lora", "lora_rank": 16}, 1),
    ("lora_default", {"finetune": "lora"}, 1),
    ("lora_zero3", {"finetune": "lora", "sharding": "zero3"}, 8),
    ("qlora", {"finetune": "lora", "quantization": "nf4"}, 1),
    ("qlora_dq_ga", {"finetune": "lora", "quantization": "nf4_double_quant", "gradient_accumulation_steps": 2}, 1),
    ("opt_in_bwd", {"optimizer_in_backward": True, "precision": "bf16"}, 1),
    ("ep2", {"expert_parallel_size": 2}, 2),
)

#: derivations applied to shipped terms entries' own training (traced bases)
ENTRY_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("as_is", {}),
    ("zero1", {"sharding": "zero1", "data_parallel_size": 4}),
    ("zero1_64", {"sharding": "zero1", "data_parallel_size": 64}),
    ("off_opt", {"offload_optimizer": "cpu"}),
    ("off_param", {"offload_optimizer": "cpu", "offload_parameters": "cpu"}),
    ("frozen2", {"finetune": "frozen", "frozen_layers": 2, "lora_rank": None, "lora_target_modules": None}),
    ("ga2", {"gradient_accumulation_steps": 2}),
    ("zero2_master", {"sharding": "zero2", "precision": "bf16_fp32_master", "data_parallel_size": 8}),
)


def _answer(curve) -> dict[str, Any]:
    return {
        "path": curve.path,
        "margin_group": curve.margin_group,
        "floor_bytes": curve.floor_bytes,
        "terms_key": curve.terms_key,
        "reason": curve.reason,
        "learned": curve.learned_coefficients,
        "notes": list(curve.notes),
        "points": [[p.predicted_bytes, p.upper_bytes, p.peak_phase, p.breakdown] for p in curve.points],
    }


def _requests():
    """(name, thunk) per request; the thunk returns the answer dict."""
    from memfit.api import TrainingIn
    from memfit.schema import FineTune, TrainingConfig
    from model.registry import Registry
    from service.recommender import Recommender, lora_trainable_params
    from tests.test_curve import ENTRIES_ALL, _config

    loaded = Registry().load()
    rec = Recommender(
        loaded.estimator,
        loaded.version,
        telemetry_range=loaded.meta.get("telemetry_range"),
        margins=loaded.meta.get("bound_margins"),
        coefficients=loaded.coefficients,
    )
    predictor = rec.predictor
    for model in MODELS:
        for name, fields, gpus in VARIANTS:

            def run(model=model, fields=fields, gpus=gpus):
                t = TrainingIn.model_validate({**BASE, **fields})
                c, _spec, _training = rec.curve(model, t, gpus)
                return _answer(c)

            yield f"{model}/{name}", run
    rng = np.random.default_rng(29)
    picks = rng.choice(len(ENTRIES_ALL), size=120, replace=False)
    for i in sorted(int(x) for x in picks):
        entry = ENTRIES_ALL[i]
        mb, seq = int(rng.integers(1, 9)), int(rng.integers(64, 4096))
        for name, update in ENTRY_VARIANTS:

            def run(entry=entry, mb=mb, seq=seq, update=update):
                spec, training, hf = _config(entry, mb, seq)
                if update.get("finetune") == "frozen" and training.finetune is FineTune.LORA:
                    spec = spec.model_copy(update={"total_params": spec.total_params - spec.trainable_params})
                fields = {**training.model_dump(), **update}
                training2 = TrainingConfig.model_validate(fields)
                if training2.finetune is FineTune.FROZEN:
                    from model.frozen import trainable_params

                    spec = spec.model_copy(update={"trainable_params": trainable_params(spec, 2, hf)})
                elif training2.finetune is FineTune.LORA and training.finetune is not FineTune.LORA:
                    extra = lora_trainable_params(spec, training2.lora_rank, training2.lora_target_modules)
                    spec = spec.model_copy(
                        update={"total_params": spec.total_params + extra, "trainable_params": extra}
                    )
                return _answer(predictor.curve(spec, training2, hf))

            yield f"entry{i}:{entry['model_name']}:{mb}x{seq}/{name}", run


def compute() -> dict[str, Any]:
    out = {}
    for name, run in _requests():
        try:
            out[name] = run()
        except Exception as err:  # noqa: BLE001 - invalid combinations are part of the record
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "check"):
        print("usage: python -m scripts.golden_curves record|check FILE.json", file=sys.stderr)
        return 2
    mode, path = argv
    got = compute()
    if mode == "record":
        with open(path, "w") as f:
            json.dump(got, f, sort_keys=True)
        errors = sum("error" in v for v in got.values())
        print(f"recorded {len(got)} requests ({errors} refused) to {path}")
        return 0
    with open(path) as f:
        want = json.load(f)
    # JSON turns tuples into lists: compare through the same round trip
    got = json.loads(json.dumps(got, sort_keys=True))
    differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    for k in differ:
        print(f"DIFFERS {k}")
    print(f"{len(got)} requests, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
