"""Write ``data/parameter_splits.json``, the snapshot of :func:`model.job.parameter_split` (parameters outside
the decoder layers, parameters of one layer; meta-device builds under the installed transformers) for every catalog
architecture and reduced MoE model, and of one expert-parallel rank's shard of each MoE model, which the
learned-coefficient path reads instead of importing transformers' model code. Run after changing the catalog
(``data/architectures``) or the transformers pin:

    python scripts/parameter_splits.py
"""

import json
from importlib.metadata import version

from data import catalog
from data.reduced_moe import REDUCED_MOE
from memfit.hf import local_expert_config, num_routed_experts
from model.job import PARAMETER_SPLITS_PATH, _parameter_split, config_key

if __name__ == "__main__":
    configs = [catalog.get(name)["hf_config"] for name in catalog.names()] + list(REDUCED_MOE.values())
    # one expert-parallel rank's shard of every MoE model, for expert-parallel sizes 2, 4, 8, ... dividing its experts
    configs += [
        local_expert_config(cfg, ep)
        for cfg in list(configs)
        if (experts := num_routed_experts(cfg))
        for ep in (2**i for i in range(1, experts.bit_length()))
        if experts % ep == 0
    ]
    splits = {}
    for cfg in configs:
        split = _parameter_split(json.dumps(cfg, sort_keys=True))
        if split is not None:
            splits[config_key(cfg)] = list(split)
    PARAMETER_SPLITS_PATH.write_text(
        json.dumps({"transformers": version("transformers"), "splits": dict(sorted(splits.items()))}, indent=0) + "\n"
    )
    print(f"{len(splits)} of {len(configs)} configs -> {PARAMETER_SPLITS_PATH}")
