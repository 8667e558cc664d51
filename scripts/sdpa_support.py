"""Write ``memfit/sdpa_support.json``, the snapshot of which model types' causal-LM classes support PyTorch SDPA
attention in the installed transformers (each class's ``_supports_sdpa``, which ``PreTrainedModel`` checks when
``attn_implementation="sdpa"`` is asked) that :func:`memfit.hf.attention_that_runs` reads without importing every
family's model code. Run after changing the transformers pin in ``constraints-dev.txt``:

    python scripts/sdpa_support.py
"""

import json

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from memfit.hf import SDPA_SUPPORT_PATH, quiet_transformers

if __name__ == "__main__":
    without = []
    with quiet_transformers():
        for model_type, names in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
            name = names[0] if isinstance(names, (list, tuple)) else names
            if not getattr(getattr(transformers, name), "_supports_sdpa", False):
                without.append(model_type)
    snapshot = {
        "source": "transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, <class>._supports_sdpa",
        "transformers_version": transformers.__version__,
        "causal_lm_model_types": len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "without_sdpa": without,
    }
    SDPA_SUPPORT_PATH.write_text(json.dumps(snapshot, indent=1) + "\n")
    print(f"{len(without)} of {len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} model types without SDPA -> {SDPA_SUPPORT_PATH}")
