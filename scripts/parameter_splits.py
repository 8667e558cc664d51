"""Write ``data/parameter_splits.json``, the snapshot of :func:`model.job.parameter_split` (parameters outside
the decoder layers, parameters of one layer; meta-device builds under the installed transformers) for every catalog
architecture and reduced MoE model, and of one expert-parallel rank's shard of each MoE model, which the
learned-coefficient path reads instead of importing transformers' model code; of :func:`model.job.parameter_tensors`
(the parameter tensors in allocation order, for the caching allocator's parameter blocks); and of each one's parameter
count (``params``: :func:`memfit.hf.count_params_from_config`, the count a resolved architecture's spec carries); and
of the parameter elements DeepSpeed's stage 3 keeps on every rank (``persistent``:
:func:`model.deepspeed_zero.persistent_parameter_elements`, on a full meta build). Run after changing the catalog
(``data/architectures``) or the transformers pin:

    python scripts/parameter_splits.py
"""

import json
from importlib.metadata import version

from data import catalog
from data.reduced_moe import REDUCED_MOE
from memfit.hf import count_params_from_config, local_expert_config, num_routed_experts
from model.deepspeed_zero import _persistent_elements
from model.job import _parameter_split, _parameter_tensors
from model.snapshot import PARAMETER_SPLITS_PATH, config_key

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
    splits, tensors, params, persistent = {}, {}, {}, {}
    for cfg in configs:
        params[config_key(cfg)] = count_params_from_config(cfg)
        persistent[config_key(cfg)] = _persistent_elements(json.dumps(cfg, sort_keys=True))
        split = _parameter_split(json.dumps(cfg, sort_keys=True))
        if split is not None:
            splits[config_key(cfg)] = list(split)
        found = _parameter_tensors(json.dumps(cfg, sort_keys=True))
        if found is not None:
            tensors[config_key(cfg)] = [list(part) for part in found]
    snapshot = {
        "transformers": version("transformers"),
        "splits": dict(sorted(splits.items())),
        "params": dict(sorted(params.items())),
        "persistent": dict(sorted(persistent.items())),
        "tensors": {k: json.dumps(v, separators=(",", ":")) for k, v in sorted(tensors.items())},
    }
    text = json.dumps(snapshot, indent=0)
    for v in snapshot["tensors"].values():  # one line per configuration's tensor list
        text = text.replace(json.dumps(v), v)
    PARAMETER_SPLITS_PATH.write_text(text + "\n")
    print(
        f"{len(splits)} splits, {len(tensors)} tensor lists, {len(params)} counts, {len(persistent)} persistent counts of {len(configs)} configs -> {PARAMETER_SPLITS_PATH}"
    )
