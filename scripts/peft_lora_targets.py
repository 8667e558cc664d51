"""Write ``memfit/peft_lora_targets.json``, the snapshot of PEFT's default LoRA target modules per model type
(``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``) that :func:`memfit.hf.peft_default_lora_targets`
reads without importing PEFT. Run after changing the PEFT pin in ``constraints-dev.txt``:

    python scripts/peft_lora_targets.py
"""

import json

import peft
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from memfit.hf import PEFT_LORA_TARGETS_PATH

if __name__ == "__main__":
    snapshot = {
        "source": "peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING",
        "peft_version": peft.__version__,
        "lora_target_modules": {
            k: list(v) for k, v in sorted(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.items())
        },
    }
    PEFT_LORA_TARGETS_PATH.write_text(json.dumps(snapshot, indent=1) + "\n")
    print(
        f"{len(snapshot['lora_target_modules'])} model types from peft {peft.__version__} -> {PEFT_LORA_TARGETS_PATH}"
    )
