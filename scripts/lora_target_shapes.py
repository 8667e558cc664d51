"""Write ``memfit/lora_target_shapes.json``, the snapshot of :func:`memfit.hf.lora_target_shapes` for PEFT's default
LoRA targets of every catalog architecture (meta-device builds under the installed transformers), which the
command line and the service read instead of importing transformers' model code. Run after changing the
transformers or PEFT pin in ``constraints-dev.txt``, or the catalog (``data/architectures``):

    python scripts/lora_target_shapes.py
"""

import json
from importlib.metadata import version

from data import catalog
from memfit.errors import InvalidConfiguration
from memfit.hf import (
    LORA_SHAPES_PATH,
    _built_lora_target_shapes,
    lora_shapes_key,
    peft_default_lora_targets,
    quiet_transformers,
)


def runs(pairs: list[tuple[int, int]]) -> list[list[int]]:
    """``[(i, o), (i, o), (j, p)]`` -> ``[[i, o, 2], [j, p, 1]]``."""
    out: list[list[int]] = []
    for i, o in pairs:
        if out and out[-1][:2] == [i, o]:
            out[-1][2] += 1
        else:
            out.append([int(i), int(o), 1])
    return out


if __name__ == "__main__":
    entries = {}
    with quiet_transformers():
        for name in catalog.names():
            cfg = catalog.get(name)["hf_config"]
            targets = peft_default_lora_targets(cfg.get("model_type"))
            if targets is None:
                continue
            try:
                shapes, names = _built_lora_target_shapes(cfg, targets)
            except (InvalidConfiguration, ValueError) as err:
                print(f"skipped {name}: {err}")
                continue
            entries[lora_shapes_key(cfg, targets)] = {
                "model": name,
                "targets": targets,
                "names": names,
                "shapes": {t: runs(v) for t, v in shapes.items()},
            }
    snapshot = {
        "source": "memfit.hf._built_lora_target_shapes on the catalog's hf_config, PEFT default targets",
        "transformers_version": version("transformers"),
        "entries": entries,
    }
    LORA_SHAPES_PATH.write_text(json.dumps(snapshot, indent=None, sort_keys=True) + "\n")
    print(
        f"{len(entries)} catalog architectures under transformers {snapshot['transformers_version']} "
        f"-> {LORA_SHAPES_PATH}"
    )
